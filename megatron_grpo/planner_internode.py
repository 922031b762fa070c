"""Bytes one rank sends per step across nodes: flat and hierarchical, megatron and GRPO.

The layouts (one pipeline stage; the counter's link classes, megatron_grpo.comm.wire):

* **flat** (one distributed-optimizer instance): when the data-parallel group spans nodes, all
  of its traffic is inter-node (the ring runs at its slowest hop): megatron's reduce-scatter +
  all-gather, or GRPO's per-tier traffic (``planner.plan``).
* **hierarchical** (``ClusterSpec.instances`` = I > 1, megatron's partial distributed
  optimizer, one instance per node): reduce-scatter and all-gather stay inside the instance
  (intra = dp / I ranks, buckets padded to lcm(intra, 128)); between instances megatron
  all-reduces each rank's shard, 2 (I-1)/I of its fp32 bytes. GRPO (megatron_grpo.comm.hierarchical)
  sends a compressing tier's shard as a compressed reduce-scatter + all-gather: 2 (I-1)
  payloads of one row of ceil(shard / I) elements; an exact core, and a stable unit on its
  update step, megatron's all-reduce; a stable unit between updates nothing.

Not counted: GRPO's control traffic (importance and health all-reduces, a few hundred bytes)
and logging scalars. tests/multiproc/test_hierarchy.py checks these figures against counted
bytes of real runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_grpo.comm.analytic import baseline_step_bytes, ddp_bucket_numels
from megatron_grpo.comm.compress import build_compressor
from megatron_grpo.comm.wire_rules import _ring_allreduce  # the wire counter's own rule
from megatron_grpo.planner import parse_tiers, stage_param_numels


@dataclass
class InterNodeTraffic:
    """Inter-node bytes one data-parallel rank sends per step (steady state for GRPO)."""

    instances: int
    """Distributed-optimizer instances of the hierarchical layout."""
    flat_baseline: int
    """megatron, one instance: reduce-scatter + all-gather when the DP group spans nodes, else 0."""
    hier_baseline: int
    """megatron's partial distributed optimizer: the shards' all-reduce between instances."""
    hier_core: int
    """GRPO hierarchical, core tier, every step."""
    hier_dynamic: int
    """GRPO hierarchical, dynamic tier, every step."""
    hier_stable_update: int
    """GRPO hierarchical, stable tier on its update step (exact), 0 on the other steps; in
    --grpo-stable-mode compressed its compressed all-reduce, every step."""
    stable_interval: int
    """Steps between stable updates (0: never)."""

    @property
    def hier_grpo(self) -> float:
        """GRPO hierarchical, average over a stable interval."""
        stable = self.hier_stable_update / self.stable_interval if self.stable_interval else 0.0
        return self.hier_core + self.hier_dynamic + stable

    @property
    def ratio(self) -> float:
        """GRPO hierarchical over megatron hierarchical."""
        return self.hier_grpo / self.hier_baseline if self.hier_baseline else 0.0


def internode(model, cluster, grpo, bucket_size: Optional[int] = None,
              tiers: Optional[Sequence[str]] = None, stage: int = 0) -> InterNodeTraffic:
    """Inter-node bytes per step of pipeline ``stage`` under ``cluster.instances`` instances.

    ``tiers``: one tier per GRPO unit of the stage under the hierarchical layout (a metrics
    ``grpo_tier_map``) for exact bytes; None assumes the quota shares by element."""
    model.validate()
    cluster.validate(model)
    grpo.validate()
    dp, inst = cluster.dp, cluster.instances
    if dp % inst:
        raise ValueError(f"instances ({inst}) must divide the data-parallel size ({dp})")
    intra = dp // inst
    numels = stage_param_numels(model, cluster, stage)
    default_bucket = bucket_size or max(40_000_000, 1_000_000 * dp)
    first = stage == 0
    flat = 0
    if cluster.dp_spans_nodes:
        flat = sum(baseline_step_bytes(ddp_bucket_numels(numels, default_bucket if first else None, dp),
                                       dp, 4, model.param_bytes))
    base = ddp_bucket_numels(numels, default_bucket if first else None, intra)
    hier = sum(_ring_allreduce(inst, 4 * (n // intra)) for n in base) if inst > 1 else 0

    units = ddp_bucket_numels(numels, grpo.bucket_elements, intra)
    compressor = build_compressor(grpo.compressor, grpo.compress_chunk, grpo.topk_ratio)
    core_c = (None if grpo.core_compressor == "none" else
              build_compressor(grpo.core_compressor, grpo.compress_chunk, grpo.topk_ratio))

    def exact(n: int) -> int:
        return _ring_allreduce(inst, 4 * (n // intra)) if inst > 1 else 0

    def compressed(n: int, c) -> int:
        if inst <= 1:
            return 0
        row = -(-(n // intra) // inst)
        return 2 * (inst - 1) * c.payload_bytes(row)

    core_b = [exact(n) if core_c is None else compressed(n, core_c) for n in units]
    dyn_b = [compressed(n, compressor) for n in units]
    # --grpo-stable-mode compressed: the stable tier's own compressor, every step.
    stable_c = (build_compressor(grpo.stable_compressor, grpo.compress_chunk)
                if grpo.stable_mode == "compressed" else None)
    stable_b = [exact(n) if stable_c is None else compressed(n, stable_c) for n in units]
    if tiers is not None:
        tier_list = parse_tiers(tiers, len(units))
        core = sum(b for b, t in zip(core_b, tier_list) if t == "core")
        dynamic = sum(b for b, t in zip(dyn_b, tier_list) if t == "dynamic")
        stable = sum(b for b, t in zip(stable_b, tier_list) if t == "stable")
    else:
        core = round(grpo.core_share * sum(core_b))
        dynamic = round(grpo.dynamic_share * sum(dyn_b))
        stable = round(grpo.stable_share * sum(stable_b))
    return InterNodeTraffic(inst, flat, hier, core, dynamic, stable,
                            1 if stable_c is not None else grpo.stable_interval)


def format_internode(t: InterNodeTraffic, flat_grpo: Optional[float] = None) -> str:
    """A few lines for launch/plan.py."""
    mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
    lines = [f"inter-node bytes per rank per step ({t.instances} distributed-optimizer instances):",
             f"  megatron flat          {mb(t.flat_baseline)}"]
    if flat_grpo is not None:
        lines.append(f"  GRPO flat              {mb(flat_grpo)}")
    lines += [f"  megatron hierarchical  {mb(t.hier_baseline)}",
              f"  GRPO hierarchical      {mb(t.hier_grpo)} ({t.ratio:.3f}x megatron hierarchical; "
              f"core {mb(t.hier_core)}, dynamic {mb(t.hier_dynamic)}, stable {mb(t.hier_stable_update)} "
              f"every {t.stable_interval or 'never'})"]
    return "\n".join(lines)
