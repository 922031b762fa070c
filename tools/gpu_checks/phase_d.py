"""Phase d: two ranks on one device, the whole GRPO path at dp = 2.

NCCL refuses two ranks on one device, so both ranks use device 0 with gloo, which takes CUDA
tensors (tools/gpu_checks/gloo_cuda.py); on the CPU the same runs use gloo on the CPU. Three
runs of the small bf16 model with compressed core (int8) and dynamic (int4) tiers and a delayed
stable tier, the weight hash checked after every step:

* flat (one distributed-optimizer instance): compressed reduce-scatter with error feedback over
  the wire, compressed parameter gather, the stable tier's exact update;
* the same with the memory tier (--grpo-offload cpu): the same losses, bit for bit;
* hierarchical (--num-distributed-optimizer-instances 2, each rank its own emulated node):
  GRPO's compressed inter-instance all-reduce (megatron_grpo/comm/hierarchical.py).

Every step's counted bytes must equal the planner's prediction from that step's tier map: per
tier for the flat runs (megatron_grpo.planner.plan.plan), across nodes for the hierarchical one
(megatron_grpo.planner.internode.internode), as tests/multiproc/test_planner_measured.py and
test_hierarchy.py hold CPU runs to them.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from . import specs
from .common import Expect, table
from .phase_c import check_offload, check_run
from .runs import TrainRun

HIER_ENV = {"MEGATRON_GRPO_RANKS_PER_NODE": "1"}


def _args(cpu: bool) -> List[str]:
    return [*specs.model(cpu, specs.iters(cpu)), *specs.grpo(cpu), "--check-weight-hash-interval", "1"]


def runs(ctx) -> List[TrainRun]:
    args = _args(ctx.cpu)
    env = specs.DETERMINISTIC_ENV
    return [TrainRun("d_grpo", "d", args, nproc=2, env=dict(env)),
            TrainRun("d_grpo_offload", "d", [*args, *specs.OFFLOAD], nproc=2, env=dict(env)),
            TrainRun("d_hier", "d", [*args, "--num-distributed-optimizer-instances", "2"], nproc=2,
                     env={**env, **HIER_ENV})]


def flat_predictor(args: List[str]) -> Callable[[str, bool], Dict[str, int]]:
    """tier map, stable update? -> the planner's bytes per tier for one step of the flat run."""
    from megatron_grpo.planner.plan import plan

    model, cluster, grpo, bucket = specs.plan_inputs(args, nodes=1, gpus_per_node=2)
    warm = plan(model, cluster, grpo, bucket_size=bucket).grpo_warmup_bytes

    def predict(tiers: str, stable_update: bool) -> Dict[str, int]:
        if set(tiers) == {"c"}:
            return {"core": warm, "dynamic": 0, "stable": 0}
        t = plan(model, cluster, grpo, bucket_size=bucket, tiers=tiers).grpo_traffic
        return {"core": t.core, "dynamic": t.dynamic, "stable": t.stable_update if stable_update else 0}
    return predict


def hier_predictor(args: List[str]) -> Callable[[str, bool], Optional[int]]:
    """tier map, stable update? -> inter-node bytes of a tiered step (None in the warm-up)."""
    from megatron_grpo.planner.internode import internode

    model, cluster, grpo, bucket = specs.plan_inputs(args, nodes=2, gpus_per_node=1)

    def predict(tiers: str, stable_update: bool) -> Optional[int]:
        if set(tiers) == {"c"}:
            return None
        t = internode(model, cluster, grpo, bucket_size=bucket, tiers=tiers)
        return t.hier_core + t.hier_dynamic + (t.hier_stable_update if stable_update else 0)
    return predict


def check_flat_bytes(ex: Expect, label: str, records: List[dict], predict) -> str:
    """Every step's counted bytes per tier = the planner's for its tier map."""
    bad, checked = [], 0
    for r in records:
        want = predict(r["grpo_tier_map"], bool(r.get("grpo_stable_update")))
        got = {k: r.get(f"wire_bytes_{k}") for k in want}
        checked += 1
        if got != want:
            bad.append(f"iteration {r['iteration']} ({r['grpo_tier_map']}): counted {got}, planned {want}")
    ex.that(checked > 0 and not bad, f"{label}: counted bytes per tier = the planner's on "
            f"{checked - len(bad)}/{checked} steps" + (f"; {bad[0]}" if bad else ""))
    return f"{checked - len(bad)}/{checked}"


def check_hier_bytes(ex: Expect, label: str, records: List[dict], predict) -> str:
    """Tiered steps: inter-node bytes less logging scalars and GRPO's control all-reduces (skip
    flag, importance, health: not the planner's) = the planner's inter-instance bytes."""
    bad, checked = [], 0
    for r in records:
        want = predict(r["grpo_tier_map"], bool(r.get("grpo_stable_update")))
        if want is None:
            continue
        got = r["wire_bytes_inter_node"] - r.get("wire_bytes_logging", 0) - r.get("wire_bytes_grpo_control", 0)
        checked += 1
        if got != want:
            bad.append(f"iteration {r['iteration']} ({r['grpo_tier_map']}): counted {got}, planned {want}")
    ex.that(checked > 0 and not bad, f"{label}: inter-node bytes of the tiered steps = the planner's on "
            f"{checked - len(bad)}/{checked} steps" + (f"; {bad[0]}" if bad else ""))
    return f"{checked - len(bad)}/{checked}"


def check_hashes(ex: Expect, run: TrainRun) -> str:
    flags = [r.get("weight_hash_ok") for r in run.records]
    good = sum(1 for f in flags if f is True)
    ex.that(bool(flags) and good == len(flags), f"{run.name}: weight hash equal on both ranks after "
            f"{good}/{len(flags)} steps (--check-weight-hash-interval 1)")
    return f"{good}/{len(flags)}"


def analyze(ex: Expect, ctx, train_runs: List[TrainRun]) -> str:
    by = {r.name: r for r in train_runs}
    args = _args(ctx.cpu)
    rows = []
    for run in (by["d_grpo"], by["d_grpo_offload"], by["d_hier"]):
        ok = check_run(ex, run)
        if not ctx.cpu:
            ex.that(run.platform == "gloo/cuda:0", f"{run.name}: platform {run.platform} (gloo/cuda:0: "
                    f"two ranks on one device)")
        hashes = bytes_ok = "-"
        if ok:
            hashes = check_hashes(ex, run)
            final = run.records[-1].get("grpo_tier_map", "")
            ex.that({"c", "d", "s"} <= set(final), f"{run.name}: core, dynamic and stable units at the "
                    f"end: {final!r}")
            if run.name == "d_hier":
                bytes_ok = check_hier_bytes(ex, run.name, run.records, hier_predictor(
                    [*args, "--num-distributed-optimizer-instances", "2"]))
            elif run.name == "d_grpo":
                bytes_ok = check_flat_bytes(ex, run.name, run.records, flat_predictor(args))
            else:
                bytes_ok = check_flat_bytes(ex, run.name, run.records, flat_predictor([*args, *specs.OFFLOAD]))
        r = run.records
        rows.append([run.name, f"{len(r)}/{run.train_iters}",
                     f"{r[0]['loss']:.4f} -> {r[-1]['loss']:.4f}" if r else "-", hashes, bytes_ok,
                     sum(x.get("wire_bytes", 0) for x in r), run.platform])
    if by["d_grpo"].ok and by["d_grpo_offload"].ok:
        check_offload(ex, by["d_grpo"].records, by["d_grpo_offload"].records, "2 ranks")
    return table(["run", "iters", "loss first -> last", "hash ok", "bytes = planner", "bytes sent",
                  "platform"], rows)
