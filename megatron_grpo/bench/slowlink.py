"""Slow link: baseline vs GRPO between two real SLURM nodes over a rate-limited link (network
namespaces + tc), through megatron_grpo/bench/slowlink_run.py. Needs root; skipped with the reason when
the local cluster cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.runner import CONFIGS, REPO, BenchError
from megatron_grpo.bench.suite import SuiteResult

# Its own process (python -m megatron_grpo.bench.slowlink_run): it needs root, builds and tears
# down the local 2-node cluster, and exits 2 where the cluster cannot be built.
RUNNER = "megatron_grpo.bench.slowlink_run"
DEFAULT_RATES = ["100mbit"]
GOAL = 0.45


def run(args, command: str) -> SuiteResult:
    out = os.path.join(args.out, "slowlink")
    rates = args.rates or DEFAULT_RATES
    cmd = [sys.executable, "-m", RUNNER, "--out", out, "--config",
           args.config or os.path.join(CONFIGS, "tiny.yaml"), "--data-path", args.data_path]
    for r in rates:
        cmd += ["--rate", r]
    if args.train_iters:
        cmd += ["--train-iters", str(args.train_iters)]
    if args.seeds:
        cmd += ["--seed", str(args.seeds[0])]
    res = SuiteResult("slowlink", "Slow link: two SLURM nodes, rate-limited, baseline vs GRPO",
                      command, ["link rate", "baseline s/step", "GRPO s/step", "GRPO / baseline",
                                "bytes ratio", "baseline val", "GRPO val"])
    print(f"[bench slowlink] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode == 2:
        res.skipped = "the local 2-node cluster cannot be built here (needs root and network " \
                      "namespaces; the script's message is above)"
        return res
    if proc.returncode != 0:
        raise BenchError(f"bench slowlink: {RUNNER} failed with exit code {proc.returncode}")
    with open(os.path.join(out, "summary.json")) as fh:
        rows = json.load(fh)["rows"]
    for row in rows:
        b, g = row["baseline"], row["grpo"]
        res.rows.append([row["rate"], f"{b['step_mean_s']:.3f}", f"{g['step_mean_s']:.3f}",
                         f"{row['ratio_mean']:.3f}",
                         f"{g['counted_bytes_per_step'] / b['counted_bytes_per_step']:.3f}",
                         F.fmt(b["val_loss"], ".4f"), F.fmt(g["val_loss"], ".4f")])
    res.notes.append(f"goal: GRPO / baseline step time <= {GOAL}; means over the iterations after "
                     f"GRPO's warm-up")
    res.data = {"rows": rows}
    res.plots["step time ratio by link rate"] = plots.ratio_bars(
        {r["rate"]: r["ratio_mean"] for r in rows}, os.path.join(out, "ratio.png"),
        "GRPO / baseline step time", "ratio")
    return res
