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
* **periodic tiers** (``--grpo-{core,dynamic}-sync-interval H`` > 1, ``--grpo-stable-mode
  local``; megatron_grpo.comm.outer): nothing crosses the instances between syncs; at a sync the
  shard's parameter delta goes exactly (all-reduce) or compressed (the same 2 (I-1) row
  payloads). The step before each re-tier syncs every periodic tier exactly instead: when the
  re-tier interval R is a multiple of H that replaces a regular sync, else it comes on top.

Not counted: GRPO's control traffic (importance and health all-reduces, a few hundred bytes),
logging scalars, the exact sync at the run's last iteration, and the Adam moments of units that
leave a periodic tier at a re-tier (two exact all-reduces of their shards, once).
tests/multiproc/test_hierarchy.py and test_periodic.py check these figures against counted
bytes of real runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from megatron_grpo.comm.analytic import baseline_step_bytes, ddp_bucket_numels
from megatron_grpo.comm.compress import build_compressor
from megatron_grpo.comm.wire_rules import _ring_allreduce  # the wire counter's own rule
from megatron_grpo.grpo.config import default_bucket_elements
from megatron_grpo.planner.plan import parse_tiers, stage_param_numels


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
    """Steps between stable updates (0: never); with --grpo-stable-mode local, between the
    stable tier's syncs (hier_stable_update is then its delta sync)."""
    core_interval: int = 1
    """Steps between the core tier's syncs (hier_core is one sync; 1: every step)."""
    dynamic_interval: int = 1
    """Steps between the dynamic tier's syncs (hier_dynamic is one sync; 1: every step)."""
    exact: Optional[Dict[str, int]] = None
    """Periodic tiers only: bytes of the tier's exact sync (the step before a re-tier)."""
    retier_interval: int = 0
    """Steps between re-tiers (each preceded by an exact sync of every periodic tier)."""

    def per_step(self, tier: str) -> float:
        """A tier's inter-node bytes per step, averaged over its schedule."""
        sync, every = {"core": (self.hier_core, self.core_interval),
                       "dynamic": (self.hier_dynamic, self.dynamic_interval),
                       "stable": (self.hier_stable_update, self.stable_interval)}[tier]
        if not every:
            return 0.0
        out = sync / every
        exact = (self.exact or {}).get(tier)
        if exact is not None and self.retier_interval:
            # The exact sync before a re-tier replaces a regular one when the periods align.
            out += (exact - (sync if self.retier_interval % every == 0 else 0)) / self.retier_interval
        return out

    @property
    def hier_grpo(self) -> float:
        """GRPO hierarchical, average over the tiers' schedules."""
        return sum(self.per_step(t) for t in ("core", "dynamic", "stable"))

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
    default_bucket = bucket_size or default_bucket_elements(dp)
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
                if grpo.stable_compressed else None)
    local = grpo.stable_local and inst > 1
    if local:  # deltas through the stable compressor at each sync
        stable_c = build_compressor(grpo.stable_compressor, grpo.compress_chunk)
    stable_b = [exact(n) if stable_c is None else compressed(n, stable_c) for n in units]
    exact_b = [exact(n) for n in units]
    shares = {"core": grpo.core_share, "dynamic": grpo.dynamic_share, "stable": grpo.stable_share}
    tier_list = parse_tiers(tiers, len(units)) if tiers is not None else None

    def total(tier: str, per_unit) -> int:
        if tier_list is not None:
            return sum(b for b, t in zip(per_unit, tier_list) if t == tier)
        return round(shares[tier] * sum(per_unit))

    core, dynamic, stable = total("core", core_b), total("dynamic", dyn_b), total("stable", stable_b)
    intervals = {t: (grpo.sync_interval(t) if inst > 1 else 1) for t in ("core", "dynamic")}
    periodic = [t for t, h in intervals.items() if h > 1] + (["stable"] if local else [])
    return InterNodeTraffic(inst, flat, hier, core, dynamic, stable,
                            1 if stable_c is not None and not local else grpo.stable_interval,
                            core_interval=intervals["core"], dynamic_interval=intervals["dynamic"],
                            exact={t: total(t, exact_b) for t in periodic} or None,
                            retier_interval=grpo.retier_interval if periodic else 0)


def format_internode(t: InterNodeTraffic, flat_grpo: Optional[float] = None) -> str:
    """A few lines for launch/plan.py."""
    mb = lambda b: f"{b / 1e6:,.1f} MB"  # noqa: E731
    lines = [f"inter-node bytes per rank per step ({t.instances} distributed-optimizer instances):",
             f"  megatron flat          {mb(t.flat_baseline)}"]
    if flat_grpo is not None:
        lines.append(f"  GRPO flat              {mb(flat_grpo)}")
    lines += [f"  megatron hierarchical  {mb(t.hier_baseline)}",
              f"  GRPO hierarchical      {mb(t.hier_grpo)} ({t.ratio:.3f}x megatron hierarchical; "
              f"core {mb(t.hier_core)} every {t.core_interval}, dynamic {mb(t.hier_dynamic)} every "
              f"{t.dynamic_interval}, stable {mb(t.hier_stable_update)} every {t.stable_interval or 'never'}"
              + (f"; exact sync of the periodic tiers every {t.retier_interval} (re-tier)"
                 if t.retier_interval else "") + ")"]
    return "\n".join(lines)
