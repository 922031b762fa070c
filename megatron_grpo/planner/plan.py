"""Planner: per-GPU memory and per-step data-parallel traffic of a GPT run, baseline vs GRPO.

Pure arithmetic over the model's parameter shapes; nothing is built. The DDP bucket layout and
the baseline's per-step bytes come from ``megatron_grpo.comm.analytic`` (the same layout rules
the tests check against counted bytes); GRPO's dynamic-tier payloads come from the compressor's
own ``payload_bytes``. Formulas, assumptions and limits: docs/planner.md.

All memory figures are bytes on one GPU of the reported pipeline stage; all traffic figures are
bytes one data-parallel rank sends per step under the ring model of ``comm/wire.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from megatron_grpo.comm.analytic import baseline_step_bytes, ddp_bucket_numels, gpt_param_numels
from megatron_grpo.comm.compress import build_compressor
from megatron_grpo.grpo.config import TIERS, GRPOConfig, default_bucket_elements
# The inputs (model and cluster) live in their own file, re-exported here.
from megatron_grpo.planner.spec import ClusterSpec, ModelSpec  # noqa: F401
# The gradient, residual and placement model lives in its own file.
from megatron_grpo.planner.grads import (RESIDUAL_BYTES, RESIDUALS_RESIDENT,  # noqa: F401
                                         backward_order, late_bytes, param_units, place,
                                         release_memory, residual_bytes, stream_window_bytes)
# The renderings (launch/plan.py, docs/planner.md) live in their own file, re-exported here.
from megatron_grpo.planner.format import GB, format_plan, format_table  # noqa: F401


@dataclass
class Memory:
    """Bytes held on one GPU."""

    params: int
    """Model parameters: megatron's param buffer (padded), bf16 or fp32."""
    grads: int
    """Gradient buffer (padded), fp32 (megatron grad_reduce_in_fp32=True)."""
    master_params: int
    """fp32 master copy of this rank's optimizer shard; 0 for the fp32 baseline (views)."""
    optimizer_moments: int
    """Adam exp_avg + exp_avg_sq, fp32, of this rank's shard (sharded over DP)."""
    activations: int
    """Tensors saved for backward of all in-flight micro-batches (formula: docs/planner.md)."""
    error_feedback: int = 0
    """GRPO: the committed error-feedback residuals of the tiers compressed every step, in
    --grpo-residual-dtype (4, 2 or 1 + 4/--grpo-compress-chunk bytes per element). One
    instance: one per element of those units, on every DP rank. Several instances: only the
    inter-instance stage compresses, so one per element of this rank's shard, padded to a
    multiple of the instances (megatron_grpo/comm/hierarchical.py)."""
    error_feedback_staged: int = 0
    """--grpo-release-grads: the new residuals staged at the units' syncs, beside the committed
    ones (kept for a skipped step) until the step ends, at the peak."""
    residual_dtype: str = "fp32"
    """Storage of the residuals (--grpo-residual-dtype)."""
    residuals_by_dtype: Dict[str, int] = field(default_factory=dict)
    """The committed residuals' bytes were they stored in each --grpo-residual-dtype."""
    grads_full: int = 0
    """--grpo-release-grads: full unit storage resident at the peak (of the ``grads``): the unit
    being filled and those whose sync is in flight (--grpo-grad-units-in-flight); every unit
    while micro-batches accumulate or without --overlap-grad-reduce."""
    grad_shards: int = 0
    """--grpo-release-grads: this rank's shards of the units already synced, kept to the step's end."""
    grad_late_copies: int = 0
    """--grpo-release-grads: own gradient copies of the parameters megatron reads after the sync
    (the position embedding with pipeline parallelism), kept to the step's end."""
    grads_held: int = 0
    """--grpo-release-grads: delayed stable units between updates keep their full gradient to
    the step's end (it is added into their accumulator then)."""
    activations_freed: int = 0
    """--grpo-release-grads: activations backward has freed by the peak moment (released in
    proportion to the gradient elements backward has reached)."""
    grad_peaks: Dict[str, int] = field(default_factory=dict)
    """GRPO: the most gradient bytes at any moment of a step between stable updates
    ("between"), of an update step ("update") and, with --grpo-release-grads, of the first
    iteration ("first"): what the gradient storage's ``grad_bytes_peak`` metric reports."""
    step_peaks: Dict[str, int] = field(default_factory=dict)
    """GRPO: the peak of a step between stable updates ("between"), of an update step
    ("update") and, with --grpo-release-grads, of the first iteration ("first")."""
    first_iteration: int = 0
    """--grpo-release-grads: the peak of the first iteration (megatron's first batch syncs every
    unit after backward, so all units are full at its end; GRPO's warm-up is exact, so no
    residuals; no Adam moments yet). ``total`` is the larger of this and the steady peak."""
    delayed_accumulators: int = 0
    """GRPO --grpo-stable-mode delayed: fp32 gradient accumulator per stable-tier element."""
    outer_state: int = 0
    """GRPO periodic tiers (instances > 1): per element of this rank's shard of a periodic unit,
    the fp32 anchor of the last sync, the outer momentum (--grpo-outer-momentum > 0) and, when
    the tier's deltas are compressed, their residual padded like error_feedback's, in
    --grpo-residual-dtype (megatron_grpo/comm/outer.py)."""
    offloaded: int = 0
    """Bytes of this rank's state on host/SSD at the step's peak (--grpo-offload): with
    streaming, the fp32 masters and Adam moments of the dynamic and stable units, less the two
    units' worth streaming keeps resident; with --grpo-offload-residuals, the error-feedback
    residuals but three buckets'. Subtracted from model_state."""
    offloaded_between_updates: int = 0
    """--no-grpo-offload-stream: the stable tier's state, away only between its updates; not
    subtracted: the update steps hold it."""

    @property
    def optimizer(self) -> int:
        return self.master_params + self.optimizer_moments

    @property
    def model_state(self) -> int:
        """Model state at the steady peak moment."""
        return (self.params + self.grads + self.master_params + self.optimizer_moments
                + self.error_feedback + self.error_feedback_staged + self.delayed_accumulators
                + self.outer_state - self.offloaded)

    @property
    def steady(self) -> int:
        """Peak of a step after the first: model state and the activations still held."""
        return self.model_state + self.activations - self.activations_freed

    @property
    def total(self) -> int:
        """The peak per GPU: the larger of the steady and the first iteration's."""
        return max(self.steady, self.first_iteration)

    @property
    def peak_phase(self) -> str:
        return "first iteration" if self.first_iteration > self.steady else "steady"


@dataclass
class TierTraffic:
    """Bytes one rank sends per step in GRPO's steady state, by tier."""

    core: int
    """Exact reduce-scatter (fp32) + all-gather (param dtype) of the core units, every step."""
    dynamic: int
    """Compressed all_to_all of gradients + compressed (or exact) parameter gather, every step."""
    stable_update: int
    """Exact sync of the stable units on their update step (0 bytes on the other steps); in
    --grpo-stable-mode compressed their compressed sync, every step."""
    stable_interval: int
    """Steps between stable updates (1 in --grpo-stable-mode compressed)."""

    @property
    def stable_average(self) -> float:
        # stable_interval 0 (static-freeze ablation): the stable tier never syncs.
        return self.stable_update / self.stable_interval if self.stable_interval else 0.0

    @property
    def per_step(self) -> float:
        """Average over a stable interval."""
        return self.core + self.dynamic + self.stable_average


@dataclass
class Plan:
    """What ``plan`` predicts for one model on one cluster."""

    model: ModelSpec
    """The model planned."""
    cluster: ClusterSpec
    """The cluster planned."""
    grpo: GRPOConfig
    """GRPO settings (used for the GRPO column whether or not ``enabled`` is set)."""
    memory_stage: int
    """Pipeline stage the memory figures are for (the most loaded one unless ``stage`` given)."""
    traffic_stage: int
    """Pipeline stage the traffic figures are for (the most loaded one unless ``stage`` given)."""
    baseline_memory: Memory
    """Per-GPU memory of the megatron baseline."""
    grpo_memory: Memory
    """Per-GPU memory with GRPO (its unit layout, separate fp32 masters, error feedback)."""
    baseline_buckets: List[int]
    """Padded elements of each megatron DDP bucket of the traffic stage (baseline layout)."""
    baseline_grad_bytes: int
    """Baseline reduce-scatter bytes per step (analytic.baseline_step_bytes)."""
    baseline_param_bytes: int
    """Baseline parameter all-gather bytes per step."""
    units: List[int]
    """Padded elements of each GRPO tier unit of the traffic stage (--grpo-bucket-mb layout)."""
    tiers: List[str]
    """Tier of each unit when given explicitly; empty when the quota shares are assumed."""
    tier_elements: Dict[str, float]
    """Gradient elements per tier on the traffic stage (fractional under quota shares)."""
    grpo_traffic: TierTraffic
    """GRPO's steady-state bytes per step, by tier."""
    grpo_warmup_bytes: int
    """Bytes per step while every unit is core (GRPO warm-up), on GRPO's unit layout."""
    baseline_peak: int = 0
    """The baseline's peak per GPU on its own busiest stage (``baseline_memory`` is for
    ``memory_stage``, GRPO's busiest)."""

    baseline_bytes = property(lambda self: self.baseline_grad_bytes + self.baseline_param_bytes)
    grpo_bytes = property(lambda self: self.grpo_traffic.per_step)  # steady-state average

    @property
    def ratio(self) -> float:
        return self.grpo_bytes / self.baseline_bytes if self.baseline_bytes else 0.0

    def wire_seconds(self, nbytes: float) -> float:
        """Time to push ``nbytes`` through the DP ring's slowest link (no overlap assumed)."""
        return nbytes * 8 / (self.cluster.dp_link_gbps * 1e9)

    baseline_wire_s = property(lambda self: self.wire_seconds(self.baseline_bytes))
    grpo_wire_s = property(lambda self: self.wire_seconds(self.grpo_bytes))

    def fits(self, memory: Memory) -> bool:
        return memory.total <= self.cluster.gpu_memory_gb * GB


# Activations: megatron_grpo/planner/activations.py (re-exported: the planner's public names).
from megatron_grpo.planner.activations import (backward_freed_bytes, last_backward_activation_bytes,  # noqa: E402
                                       layer_activation_bytes as layer_activation_bytes,
                                       stage_activation_bytes, stage_kept_bytes as stage_kept_bytes)

# ---------------------------------------------------------------------------------- the plan
def stage_param_numels(model: ModelSpec, cluster: ClusterSpec, stage: int) -> List[int]:
    """Parameter sizes of one TP rank of ``stage`` in named_parameters() order."""
    return gpt_param_numels(model.num_layers // cluster.pp, model.hidden, model.ffn,
                            model.padded_vocab(cluster.tp), 0 if model.rope else model.positions,
                            tp=cluster.tp, pre_process=stage == 0, post_process=stage == cluster.pp - 1,
                            heads=model.heads, groups=model.groups, swiglu=model.swiglu,
                            norm_bias=not model.rmsnorm, bias=model.bias_linear)


def _unit_bytes(numel: int, dp: int, param_bytes: int) -> int:
    """Exact sync of one unit: fp32 reduce-scatter + all-gather in the param dtype."""
    return (dp - 1) * (numel // dp) * (4 + param_bytes) if dp > 1 else 0


def _dynamic_bytes(numel: int, dp: int, param_bytes: int, grpo: GRPOConfig, compressor) -> int:
    if dp <= 1:
        return 0
    payload = (dp - 1) * compressor.payload_bytes(numel // dp)  # all_to_all: dp-1 shards leave
    gather = payload if grpo.compress_param_gather else (dp - 1) * (numel // dp) * param_bytes
    return payload + gather


def parse_tiers(tiers: Sequence[str], n_units: int) -> List[str]:
    """Tier names from names or one-letter codes (a metrics ``grpo_tier_map`` string works)."""
    letters = {t[0]: t for t in TIERS}
    out = [t if t in TIERS else letters.get(t) for t in map(str, tiers)]
    if len(out) != n_units or None in out:
        raise ValueError(f"tiers must give one of {'/'.join(TIERS)} (or c/d/s) per GRPO unit of the "
                         f"stage ({n_units} units), got {len(out)} entries: "
                         f"{' '.join(map(str, tiers))[:80]!r}")
    return out


def _memory(model: ModelSpec, cluster: ClusterSpec, buckets: List[int], unpadded: int,
            activations: int, separate_fp32_master: bool, ef_bytes: float = 0.0,
            accum_elements: float = 0.0, outer_bytes: float = 0.0) -> Memory:
    padded = sum(buckets)
    # The distributed optimizer keeps state only for real parameter elements of this rank's
    # shard; averaged over ranks that is unpadded / (ranks of one instance): megatron's partial
    # distributed optimizer shards inside an instance and replicates the state across instances
    # (a rank differs from the average by at most its padding).
    shard = unpadded / (cluster.dp // cluster.instances)
    master = 4 * shard if (model.bf16 or separate_fp32_master) else 0
    return Memory(params=padded * model.param_bytes, grads=padded * 4,
                  master_params=round(master), optimizer_moments=round(8 * shard),
                  activations=activations, error_feedback=round(ef_bytes),
                  delayed_accumulators=round(4 * accum_elements),
                  outer_state=round(outer_bytes))


def _local_tiers(grpo: GRPOConfig) -> set:
    """Tiers trained inside an instance and averaged between instances periodically."""
    local = {t for t in ("core", "dynamic") if grpo.sync_interval(t) > 1}
    return local | ({"stable"} if grpo.stable_local else set())


def _outer_bytes(units: List[int], weights: List[Dict[str, float]], residuals: List[int],
                 grpo: GRPOConfig, intra: int, compressing: Sequence[str]) -> float:
    """Outer state of one rank with instances > 1 (comm/outer.py): per periodic-tier element
    of this rank's shard the fp32 anchor (and momentum), and, when the tier's deltas are
    compressed, their residual (``residuals``: one per unit, rows padded like the
    inter-instance stage's, in --grpo-residual-dtype)."""
    per_anchor = 2 if grpo.outer_momentum > 0 else 1  # anchor (+ momentum)
    return sum(w[t] * (4 * per_anchor * (n // intra) + (r if t in compressing else 0))
               for n, w, r in zip(units, weights, residuals) for t in _local_tiers(grpo))


def plan(model: ModelSpec, cluster: ClusterSpec, grpo: GRPOConfig,
         bucket_size: Optional[int] = None, tiers: Optional[Sequence[str]] = None,
         stage: Optional[int] = None, offload=None) -> Plan:
    """Predict memory and DP traffic, baseline vs GRPO.

    ``bucket_size``: the baseline's DDP bucket (elements); None is megatron's default
    max(4e7, 1e6 dp). As megatron does, stages after the first use one bucket in the baseline;
    GRPO keeps ``grpo.bucket_elements`` buckets on every stage. ``tiers``: one tier per GRPO
    unit of ``stage`` (e.g. metrics ``grpo_tier_map``) for exact bytes; None assumes the quota
    shares by element. ``stage``: report this pipeline stage (required with ``tiers`` when pp > 1);
    None reports the stage with the most memory and the stage with the most traffic.
    ``offload``: an OffloadConfig (--grpo-offload ...) whose placement is applied to GRPO's memory.
    """
    model.validate()
    cluster.validate(model)
    grpo.validate()
    dp, pb, pp = cluster.dp, model.param_bytes, cluster.pp
    inst = cluster.instances
    intra = dp // inst  # ranks that shard the optimizer (one instance)
    if stage is not None and not (isinstance(stage, int) and 0 <= stage < pp):
        raise ValueError(f"stage must be an integer in [0, {pp - 1}], got {stage!r}")
    if tiers is not None and stage is None:
        if pp > 1:
            raise ValueError("stage must be given with explicit tiers when pp > 1 "
                             "(tier maps are per stage)")
        stage = 0
    if bucket_size is not None and (not isinstance(bucket_size, int) or bucket_size <= 0):
        raise ValueError(f"bucket_size must be None or a positive integer, got {bucket_size!r}")
    default_bucket = bucket_size or default_bucket_elements(dp)
    if grpo.compressor == "powersgd":
        raise ValueError("--grpo-compressor powersgd: the planner does not model this benchmark "
                         "peer (its bytes depend on every parameter's matrix shape); its bytes are "
                         "counted by python -m megatron_grpo.bench comm. Plan with int4/int8/topk")
    compressor = build_compressor(grpo.compressor, grpo.compress_chunk, grpo.topk_ratio)
    core_compressor = (None if grpo.core_compressor == "none" else
                       build_compressor(grpo.core_compressor, grpo.compress_chunk, grpo.topk_ratio))
    # --grpo-stable-mode compressed: the stable tier sends its own compressor's bytes every step.
    stable_compressor = (build_compressor(grpo.stable_compressor, grpo.compress_chunk)
                         if grpo.stable_compressed else None)
    stable_interval = 1 if stable_compressor is not None else grpo.stable_interval

    per_stage = []
    for st in range(pp):
        numels = stage_param_numels(model, cluster, st)
        base = ddp_bucket_numels(numels, default_bucket if st == 0 else None, dp)
        units = ddp_bucket_numels(numels, grpo.bucket_elements, dp)
        per_stage.append((st, numels, base, units, stage_activation_bytes(model, cluster, st)))

    def stage_memory(entry, share_tiers: Optional[List[str]]):
        st, numels, base, units, act = entry
        if inst > 1:  # megatron pads each bucket for the ranks of one instance
            base = ddp_bucket_numels(numels, default_bucket if st == 0 else None, intra)
            units = ddp_bucket_numels(numels, grpo.bucket_elements, intra)
        baseline = _memory(model, cluster, base, sum(numels), act, separate_fp32_master=False)
        elements = _tier_elements(units, share_tiers, grpo)
        accum = elements["stable"] if grpo.stable_delayed else 0.0
        compressing = ["dynamic"] + (["core"] if core_compressor else []) + \
            (["stable"] if stable_compressor or (grpo.stable_local and inst > 1) else [])
        # Residuals: one instance: every element of the compressed units; several: only the
        # inter-instance stage compresses, per element of this rank's shard padded to one row
        # per instance (comm/hierarchical.py), and the periodic tiers' live in the outer state.
        ef_tiers = set() if dp <= 1 else \
            {t for t in compressing if inst == 1 or t not in _local_tiers(grpo)}
        weights = ([{t: float(t == x) for t in TIERS} for x in share_tiers] if share_tiers else
                   [{"core": grpo.core_share, "dynamic": grpo.dynamic_share,
                     "stable": grpo.stable_share}] * len(units))
        rows = [n if inst == 1 else -(-(n // intra) // inst) * inst for n in units]
        by_dtype = {d: [residual_bytes(n, d, grpo.compress_chunk) for n in rows] for d in RESIDUAL_BYTES}
        by_dtype = {d: (r, sum(w[t] * x for w, x in zip(weights, r) for t in ef_tiers))
                    for d, r in by_dtype.items()}
        residuals, ef = by_dtype[grpo.residual_dtype]
        outer = _outer_bytes(units, weights, residuals, grpo, intra, compressing) if inst > 1 else 0.0
        g = _memory(model, cluster, units, sum(numels), act, separate_fp32_master=True,
                    ef_bytes=ef, accum_elements=accum, outer_bytes=outer)
        g.residual_dtype = grpo.residual_dtype
        g.residuals_by_dtype = {d: round(x) for d, (_, x) in by_dtype.items()}
        streamed = offload is not None and offload.target != "none" and offload.stream
        if offload is not None and offload.target != "none":
            place(g, units, elements, sum(numels) / intra, intra, offload.stream,
                   offload.residuals and grpo.compressor != "powersgd",
                   stable_every_step=stable_compressor is not None, unit_residual=max(residuals),
                   unit_accumulator=4 * max(n * w["stable"] for n, w in zip(units, weights)),
                   core=offload.stream and offload.core)
        # Gradients with --grpo-release-grads, and the new residuals staged at the syncs.
        late = late_bytes(pp, st, model.rope, numels, grpo.bucket_elements, intra, len(units))
        unit_of = param_units(numels, grpo.bucket_elements, intra)
        order = backward_order(model.num_layers // pp, st == 0, st == pp - 1,
                               st == 0 and not model.rope, not model.rmsnorm, model.bias_linear)
        parts, freed, events = backward_freed_bytes(model, cluster, st), 0.0, []
        for i, freed_here in order:  # one micro-batch's backward frees its own activations
            freed += sum(parts.get(part, 0) for part in freed_here)
            events.append((unit_of[i], freed))
        release_memory(g, grpo, units, weights, residuals, late, ef_tiers, intra,
                       # Host accumulation: before the last micro-batch a unit's gradient
                       # leaves as soon as it is complete, so the device sees one micro-batch.
                       1 if grpo.grad_accumulation == "host" else model.micro_batches(dp, pp),
                       model.overlap_grad_reduce, events,
                       min(act, last_backward_activation_bytes(model, cluster, st)),
                       streamed=streamed, shards_away=streamed and offload.grads and grpo.release_grads,
                       core_away=streamed and offload.core)
        return baseline, g

    if stage is not None:
        mem_entry = traffic_entry = per_stage[stage]
        baseline_peak = None
    else:
        memories = [stage_memory(e, None) for e in per_stage]
        mem_entry = per_stage[max(range(pp), key=lambda k: memories[k][1].total)]
        # The baseline's own busiest stage, which GRPO's need not be (--largest-model).
        baseline_peak = max(b.total for b, _ in memories)
        traffic_entry = max(per_stage, key=lambda e: sum(baseline_step_bytes(e[2], dp, 4, pb)))
    units = traffic_entry[3]
    tier_list = parse_tiers(tiers, len(units)) if tiers is not None else []
    baseline_memory, grpo_memory = stage_memory(mem_entry, tier_list or None)
    grad_bytes, param_bytes = baseline_step_bytes(traffic_entry[2], dp, 4, pb)

    exact = [_unit_bytes(n, dp, pb) for n in units]
    dyn = [_dynamic_bytes(n, dp, pb, grpo, compressor) for n in units]
    # Core sends exact bytes, or its own compressor's (pinned units are not modelled: the
    # tied embedding's copies on two stages stay exact, a few units at most).
    core_bytes = exact if core_compressor is None else \
        [_dynamic_bytes(n, dp, pb, grpo, core_compressor) for n in units]
    stable_bytes = exact if stable_compressor is None else \
        [_dynamic_bytes(n, dp, pb, grpo, stable_compressor) for n in units]
    if tier_list:
        core = sum(x for x, t in zip(core_bytes, tier_list) if t == "core")
        dynamic = sum(x for x, t in zip(dyn, tier_list) if t == "dynamic")
        stable = sum(x for x, t in zip(stable_bytes, tier_list) if t == "stable")
    else:  # quota shares by element, applied to the stage's per-unit bytes
        core = round(grpo.core_share * sum(core_bytes))
        dynamic = round(grpo.dynamic_share * sum(dyn))
        stable = round(grpo.stable_share * sum(stable_bytes))
    return Plan(model=model, cluster=cluster, grpo=grpo, memory_stage=mem_entry[0],
                traffic_stage=traffic_entry[0], baseline_memory=baseline_memory,
                grpo_memory=grpo_memory, baseline_buckets=list(traffic_entry[2]),
                baseline_grad_bytes=grad_bytes, baseline_param_bytes=param_bytes, units=list(units),
                tiers=tier_list, tier_elements=_tier_elements(units, tier_list or None, grpo),
                grpo_traffic=TierTraffic(core, dynamic, stable, stable_interval),
                grpo_warmup_bytes=sum(exact),
                baseline_peak=baseline_memory.total if baseline_peak is None else baseline_peak)


def _tier_elements(units: List[int], tiers: Optional[List[str]],
                   grpo: GRPOConfig) -> Dict[str, float]:
    if tiers is not None and len(tiers) == len(units):
        return {t: float(sum(n for n, x in zip(units, tiers) if x == t)) for t in TIERS}
    total = sum(units)
    return {"core": grpo.core_share * total, "dynamic": grpo.dynamic_share * total,
            "stable": grpo.stable_share * total}
