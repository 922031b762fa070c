"""Across nodes: megatron's hierarchical baseline (partial distributed optimizer, one
instance per node) beside megatron flat, GRPO flat and GRPO hierarchical, on 4 gloo ranks that
emulate 2 nodes of 2 (MEGATRON_GRPO_RANKS_PER_NODE: the wire counter's link classes).

Bytes are counted per rank and split by link class: a collective over a group whose ranks sit
on two nodes is inter-node. The hierarchical megatron run is the baseline every other is
compared with (the best megatron layout for such a cluster). Step times on one machine say
nothing about a slow inter-node link and are not reported here (the slow-link suite runs on
the 2-node SLURM cluster with tc).
"""

from __future__ import annotations

import os

from megatron_grpo.bench import figures as F
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import run_grid
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")
DEFAULT_SEEDS = [1234]
NODES = 2
HIER = ["--num-distributed-optimizer-instances", str(NODES)]
PERIODIC = ["--grpo-dynamic-sync-interval", "50", "--grpo-retier-interval", "200"]


def _core_int4(dynamic_interval: int, *extra: str):
    """Core int4 every step, the dynamic tier local with deltas every ``dynamic_interval``
    (flag order kept: it is part of each run's reuse key)."""
    return ["--grpo", *HIER, *PERIODIC, "--grpo-dynamic-sync-interval", str(dynamic_interval),
            "--grpo-core-compressor", "int4", *extra]


CONTENDERS = [
    Contender("baseline", HIER, "megatron, partial distributed optimizer, one instance per node: "
              "reduce-scatter and all-gather inside the node, all-reduce of the shards between nodes"),
    Contender("megatron-flat", [], "megatron, one distributed-optimizer instance over both nodes"),
    Contender("grpo-flat", ["--grpo"], "GRPO defaults, one instance: every tier's traffic crosses nodes"),
    Contender("grpo-hier", ["--grpo", *HIER],
              "GRPO defaults, one instance per node: exact inside the node, compressed between nodes"),
    Contender("grpo-periodic", ["--grpo", *HIER, *PERIODIC],
              "GRPO, one instance per node, dynamic tier trained locally in each node and its "
              "parameter deltas averaged (int4, error feedback) every 50 steps; int8 core every "
              "step; re-tier (with an exact sync) every 200"),
    Contender("grpo-periodic-h10", ["--grpo", *HIER, *PERIODIC, "--grpo-dynamic-sync-interval", "10"],
              "as grpo-periodic with the dynamic deltas every 10 steps"),
    Contender("grpo-periodic-nesterov", ["--grpo", *HIER, *PERIODIC, "--grpo-outer-lr", "0.7",
                                         "--grpo-outer-momentum", "0.9"],
              "as grpo-periodic with DiLoCo's outer optimizer (lr 0.7, Nesterov momentum 0.9)"),
    Contender("grpo-periodic-core10", ["--grpo", *HIER, *PERIODIC, "--grpo-core-sync-interval", "10"],
              "as grpo-periodic with the core tier trained locally too, its int8 deltas every 10 steps"),
    Contender("grpo-periodic-c4h10", ["--grpo", *HIER, *PERIODIC, "--grpo-core-sync-interval", "4",
                                      "--grpo-dynamic-sync-interval", "10"],
              "core int8 deltas every 4 steps, dynamic int4 deltas every 10"),
    Contender("grpo-periodic-i4h10", _core_int4(10),
              "core int4 every step (error feedback), dynamic int4 deltas every 10: the core stays "
              "synchronous at half grpo-periodic-h10's core bytes"),
    Contender("grpo-periodic-i4h4", _core_int4(4),
              "as grpo-periodic-i4h10 with the dynamic deltas every 4 steps: how much of the "
              "local-update gap the period decides, near the 0.05x byte budget"),
    Contender("grpo-periodic-i4h10-d8", _core_int4(10, "--grpo-compressor", "int8"),
              "as grpo-periodic-i4h10 with int8 deltas: how much of the gap the deltas' "
              "quantisation decides"),
    Contender("grpo-periodic-i4h10-lr14", _core_int4(10, "--grpo-outer-lr", "1.41"),
              "as grpo-periodic-i4h10 with outer lr sqrt(2): does the mean of two half-batch "
              "Adam steps move too little?"),
    Contender("grpo-source", ["--grpo", *HIER, "--grpo-internode-preset", "source"],
              "the source's 100/50/200 preset: core exact every 100, dynamic int4 every 50, "
              "stable (20 %, local) every 200, re-tier every 200"),
]


def run(args, command: str) -> SuiteResult:
    # 2 nodes of at least 2 ranks: a 1-rank instance would have no traffic inside the node.
    nproc = max(int(args.nproc), 2 * NODES)
    if nproc % NODES:
        raise ValueError(f"--nproc ({nproc}) must be a multiple of {NODES} (ranks per emulated node)")
    args = type(args)(**{**vars(args), "nproc": nproc})
    grid = run_grid("internode", args, DEFAULT_CONFIG, CONTENDERS, DEFAULT_SEEDS,
                    env={"MEGATRON_GRPO_RANKS_PER_NODE": str(nproc // NODES)})
    res = SuiteResult(grid.section, "Across nodes: inter-node bytes, flat and hierarchical", command,
                      ["contender", "inter-node MB/step after warm-up", "vs hierarchical megatron",
                       "all bytes MB/step", "late loss vs baseline", "final val vs baseline"])
    for name in grid.names:
        per = lambda key, spec, suffix="": ", ".join(  # noqa: E731
            F.fmt(grid.compare[name][s].get(key), spec, suffix) for s in grid.seeds)
        inter = ", ".join(F.fmt(grid.summaries[name][s].get("steady_inter_node_bytes_per_step", 0) / 1e6,
                                ".3f") for s in grid.seeds)
        total = ", ".join(F.fmt(grid.summaries[name][s]["steady_wire_bytes_per_step"] / 1e6, ".3f")
                          for s in grid.seeds)
        res.rows.append([name, inter, per("steady_inter_node_ratio", ".3f"), total,
                         per("late_loss_diff_pct", "+.2f", " %") if name != "baseline" else "",
                         per("val_loss_diff_pct", "+.2f", " %") if name != "baseline" else ""])
    res.notes += [f"{c.name}: {c.about}" for c in CONTENDERS if c.name in grid.names]
    res.notes.append(f"{nproc} gloo ranks as {NODES} nodes of {nproc // NODES}; config "
                     f"{os.path.basename(grid.spec.config)}; seeds {', '.join(map(str, grid.seeds))}; "
                     f"after warm-up = iterations > {grid.steady_from}")
    res.notes.append(F.LATE_LOSS_NOTE)
    res.notes.append(grid.load_note)
    res.data = {"summaries": grid.summaries, "compare": grid.compare}
    return res
