"""Slow-link benchmark: baseline vs GRPO across a rate-limited link between two SLURM nodes.

For each --rate, a local 2-node SLURM cluster (megatron_grpo/bench/slurm_cluster.py: network namespaces,
a tc token-bucket limit on each node's side of the link) runs the project's real sbatch script
twice, in CPU/gloo mode with one rank per node (data parallel 2): the megatron baseline, then
--grpo, with the same config, seed and iterations. It prints, over the iterations after GRPO's
exact warm-up (both runs, same iterations):
  * step time, mean and median, and GRPO / baseline (project goals: <= 0.45 on a limited link,
    <= 1.03 on an unlimited one, where GRPO must not cost time);
  * the wire-time floor: counted bytes sent per rank per step / link rate, i.e. the time the
    link alone needs for a step's traffic, whatever the compute;
  * bytes the node's link really carried per iteration over those iterations (headers and
    gloo's algorithms included: gloo's reduce-scatter sends twice the ring volume), and the
    floor those bytes imply.

With --internode each node runs --nproc-per-node ranks (default 2 then) and the
contenders are megatron's partial distributed optimizer with one instance per node (the
baseline), GRPO flat (one instance), GRPO per-step between nodes, and GRPO with local updates
(core int8 deltas every 10 steps, dynamic int4 every 50);
the table adds the counted inter-node bytes per step.

Needs root (network namespaces). Example (docs/launch.md has the figures):
    .venv/bin/python -m megatron_grpo.bench.slowlink_run --rate 200mbit --rate 50mbit --train-iters 80
    .venv/bin/python -m megatron_grpo.bench.slowlink_run --internode --rate none --rate 1gbit --rate 200mbit
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Dict, List, Optional

from megatron_grpo.bench.runner import REPO
from megatron_grpo.training.metrics_log import read_metrics

# The measured path is the user's: the real sbatch script, submitted to the local cluster.
SBATCH = os.path.join(REPO, "launch", "slurm", "pretrain_gpt_grpo.sbatch")
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def rate_bits(rate: str) -> Optional[float]:
    """'200mbit' -> 2e8 bits/s (tc's units); 'none' -> None (no limit)."""
    if rate == "none":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit|bit)", rate)
    if not m:
        raise SystemExit(f"--rate {rate!r}: give a tc rate such as 200mbit, 1gbit, or none")
    return float(m.group(1)) * UNITS[m.group(2)]


def _lines(path: str) -> int:
    """Iterations logged so far (the file's headers are not counted)."""
    try:
        return len(read_metrics(path))
    except OSError:
        return 0


# Today's defaults, as a user turns GRPO on: --grpo-compress auto decides per link whether the
# formats pay (measured at start, confirmed by the step-time A/B, whose exact half is in the
# means). The former three-tier settings are in the dated study of 2026-11-30.
GRPO_FLAGS = ["--grpo"]


# Inter-node contenders: one distributed-optimizer instance per node (0: resolved from the ranks per node).
PER_NODE = ["--num-distributed-optimizer-instances", "0"]
INTERNODE = [("baseline", PER_NODE), ("grpo-flat", ["--grpo"]), ("grpo-hier", ["--grpo", *PER_NODE]),
             ("grpo-local", ["--grpo", *PER_NODE, "--grpo-core-sync-interval", "10",
                             "--grpo-dynamic-sync-interval", "50", "--grpo-retier-interval", "200"])]


def contenders(args):
    """(name, flags) of each job per rate; the first is the baseline."""
    if args.internode:
        chosen = [c for c in INTERNODE if c[0] == "baseline" or not args.contenders
                  or c[0] in args.contenders]
        unknown = set(args.contenders or []) - {c[0] for c in INTERNODE}
        if unknown:
            raise SystemExit(f"--contenders: no contender {', '.join(sorted(unknown))}; "
                             f"--internode has {', '.join(c[0] for c in INTERNODE)}")
        return chosen
    return [("baseline", []), ("grpo", GRPO_FLAGS)]


def run_pair(cluster, rate: str, args, out: str, first_iter: int) -> Dict[str, Dict]:
    results = {}
    for name, extra in contenders(args):
        metrics = os.path.join(out, f"{rate}_{name}.jsonl")
        flags = ["--config", args.config, "--data-path", args.data_path, "--train-iters",
                 str(args.train_iters), "--seed", str(args.seed), "--metrics-file", metrics,
                 "--run-name", f"{name}@{rate}", *extra]
        env = dict(GRPO_ROOT=REPO, PYTHON=sys.executable, GRPO_DEVICE="cpu", SHARED_FS="1",
                   NODE_LOCAL_DIR=os.path.join(out, "local"), PYTHONWARNINGS="ignore",
                   LOG_DIR=os.path.join(out, f"{rate}_{name}.ranks"),
                   NPROC_PER_NODE=str(args.nproc_per_node))
        if os.path.exists(metrics):  # a previous run's file would look like progress
            os.remove(metrics)
        t0 = time.monotonic()
        job_id = cluster.submit(SBATCH, flags, env=env, chdir=REPO,
                                output=os.path.join(out, f"{rate}_{name}.out"))
        # Sample the links' byte counters when the compared iterations begin, so the measured
        # bytes per iteration leave out start-up traffic (warm-up steps, initial broadcast).
        mark = None
        while mark is None and time.monotonic() - t0 < args.timeout:
            done = _lines(metrics)
            if done >= first_iter:
                mark = (done, {n: cluster.link_tx_bytes(n) for n in cluster.nodes})
            elif cluster.job_info(job_id).get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING"):
                break
            time.sleep(0.05)
        job = cluster.wait(job_id, args.timeout)
        if job.state != "COMPLETED" or mark is None:
            raise SystemExit(f"error: {name} at {rate}: job {job.job_id} {job.state}; see "
                             f"{out}/{rate}_{name}.out\n{job.output[-2000:]}")
        records = read_metrics(metrics)
        link = max(cluster.link_tx_bytes(n) - mark[1][n] for n in cluster.nodes)
        results[name] = dict(records=records, job_s=time.monotonic() - t0,
                             link_bytes_per_iter=link / (len(records) - mark[0]))
    return results


def summarize(rate: str, pair: Dict[str, Dict], first_iter: int) -> Dict:
    bits = rate_bits(rate)
    row = {"rate": rate}
    for name, res in pair.items():
        recs = [r for r in res["records"] if r["iteration"] > first_iter]
        times = [r["step_time_s"] for r in recs]
        sent = statistics.fmean(r["wire_bytes"] for r in recs)
        row[name] = {
            "iterations": f"{recs[0]['iteration']}-{recs[-1]['iteration']}",
            "step_mean_s": statistics.fmean(times), "step_median_s": statistics.median(times),
            "counted_bytes_per_step": sent,
            "inter_node_bytes_per_step": statistics.fmean(r.get("wire_bytes_inter_node", 0) for r in recs),
            "wire_floor_s": sent * 8 / bits if bits else 0.0,
            "link_bytes_per_iter": res["link_bytes_per_iter"],
            "link_floor_s": res["link_bytes_per_iter"] * 8 / bits if bits else 0.0,
            "val_loss": res["records"][-1].get("val_loss"), "job_s": res["job_s"],
        }
    names = list(pair)
    b = row[names[0]]
    row["ratios"] = {n: row[n]["step_mean_s"] / b["step_mean_s"] for n in names[1:]}
    g = row[names[-1]]  # the headline contender (grpo; grpo-local with --internode)
    row["ratio_mean"] = g["step_mean_s"] / b["step_mean_s"]
    row["ratio_median"] = g["step_median_s"] / b["step_median_s"]
    return row


def goal_for(rate: str, args) -> float:
    """The step-time ratio GRPO must reach on ``rate``: --goal where the link is limited,
    --goal-unlimited (GRPO must not cost time) where it is not."""
    return args.goal_unlimited if rate == "none" else args.goal


def print_row(row: Dict, goal: float) -> None:
    print(f"\n=== link {row['rate']} (each node's egress) ===")
    print(f"{'':14} {'iters':>8} {'step mean':>10} {'median':>8} {'counted B':>11} {'floor':>7} "
          f"{'inter-node B':>12} {'link B/iter':>11} {'floor':>7} {'val loss':>8}")
    for name in [k for k in row if isinstance(row[k], dict) and "step_mean_s" in row[k]]:
        r = row[name]
        floor = (lambda s: f"{s:>6.3f}s") if rate_bits(row["rate"]) else (lambda s: f"{'-':>7}")
        print(f"{name:14} {r['iterations']:>8} {r['step_mean_s']:>9.3f}s {r['step_median_s']:>7.3f}s "
              f"{r['counted_bytes_per_step']:>11,.0f} {floor(r['wire_floor_s'])} "
              f"{r['inter_node_bytes_per_step']:>12,.0f} "
              f"{r['link_bytes_per_iter']:>11,.0f} {floor(r['link_floor_s'])} "
              f"{r['val_loss'] or float('nan'):>8.4f}")
    for name, ratio in row["ratios"].items():
        print(f"{name} / baseline step time: mean {ratio:.3f}")
    print("(counted B: bytes per rank per step from the byte counter (ring volume); link B: what the "
          "node's link carried per iteration, headers and gloo's own algorithms included; floor = "
          "bytes / link rate)")
    verdict = "met" if row["ratio_mean"] <= goal else "MISSED"
    print(f"{[k for k in row['ratios']][-1]} / baseline step time: mean {row['ratio_mean']:.3f}, median {row['ratio_median']:.3f} "
          f"(goal <= {goal}: {verdict})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", action="append", help="tc rate of each node's link, e.g. 200mbit "
                   "(repeatable; 'none' = unlimited); default 200mbit and 50mbit")
    p.add_argument("--config", default=os.path.join(REPO, "launch", "configs", "tiny.yaml"))
    p.add_argument("--data-path", default=os.path.join(REPO, "data", "stdlib"),
                   help="dataset prefix; built (default corpus) if missing")
    p.add_argument("--train-iters", type=int, default=80)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmup-iters", type=int, default=None, help="iterations left out of the "
                   "comparison; default the config's grpo-warmup-iters")
    p.add_argument("--goal", type=float, default=0.45, help="GRPO / baseline step time to reach on a "
                   "rate-limited link")
    p.add_argument("--goal-unlimited", type=float, default=1.03, help="the same on --rate none: at "
                   "most this much slower where the link is not the bottleneck")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "slow_link"))
    p.add_argument("--internode", action="store_true", help="the inter-node contenders: megatron with one "
                   "distributed-optimizer instance per node, GRPO per-step and periodic between nodes")
    p.add_argument("--contenders", nargs="+", default=None,
                   help="with --internode: the baseline and these only (default all)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per node (default 1; 2 with --internode)")
    args = p.parse_args(argv)
    if args.nproc_per_node is None:
        args.nproc_per_node = 2 if args.internode else 1
    contenders(args)  # refuses an unknown --contenders name before any cluster is built
    rates = args.rate or ["200mbit", "50mbit"]
    for rate in rates:
        rate_bits(rate)
    from megatron_grpo.bench.slurm_cluster import (LocalCluster, down_on_signals, install_packages,
                                                   unavailable_reason)

    reason = unavailable_reason()
    if reason:
        print(f"error: cannot build the local cluster: {reason}", file=sys.stderr)
        return 2
    install_packages()
    os.makedirs(args.out, exist_ok=True)
    args.out, args.config = os.path.abspath(args.out), os.path.abspath(args.config)
    args.data_path = os.path.abspath(args.data_path)
    if not os.path.exists(args.data_path + ".bin"):
        from megatron_grpo.data import build_default_dataset

        build_default_dataset(args.data_path, verbose=False)
    first = args.warmup_iters
    if first is None:
        import yaml

        with open(args.config) as fh:
            first = int(yaml.safe_load(fh).get("grpo-warmup-iters", 0))
    rows: List[Dict] = []
    for rate in rates:
        cluster = LocalCluster(os.path.join(args.out, f"cluster_{rate}"),
                               rate=None if rate == "none" else rate)
        with down_on_signals(cluster):  # a killed benchmark leaves no daemons either
            cluster.up()
            try:
                rows.append(summarize(rate, run_pair(cluster, rate, args, args.out, first), first))
            finally:
                left = cluster.down()
                if left:
                    print(f"warning: cluster teardown left {left}", file=sys.stderr)
        print_row(rows[-1], goal_for(rate, args))
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump({"command": " ".join(sys.argv), "rows": rows}, fh, indent=1)
    print(f"\nsummary: {args.out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
