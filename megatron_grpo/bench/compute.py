"""Compute: GRPO's sampled backward against the megatron baseline, measured by the time each
run takes to reach the baseline's final validation loss ("No Train No Gain": savings per step
vanish against a baseline whose learning rate fully decays at the same budget, so the baseline
here decays to --min-lr at --train-iters, as every contender does).

Model: launch/configs/compute.yaml, a GEMM-bound GPT (hidden 512, sequences of 256 tokens) on
2 gloo ranks. Contenders, same seeds, data and steps:
* baseline: megatron-core, exact;
* grpo: today's defaults (int8 core, int4 dynamic), exact backward;
* sampled-w0.25: --grpo-sampled-backward at variance budget 0.25, weight gradients only;
* sampled-b0.25 / sampled-b1: at budgets 0.25 and 1.0 with the data gradients below core
  sampled too (--grpo-sample-dgrad below-core);
* uniform-b0.25: the same with every row equally likely (does importance matter?);
* frozen: the stable tier (20 %) frozen between updates every 10 steps.

Figures: FLOPs per step against the exact step (counted from shapes and kept rows), forward+
backward and step time, validation loss at equal steps, and wall-clock of training steps to the
baseline's final validation loss (interpolated between evaluations; "never" when a run does not
reach it).
"""

from __future__ import annotations

import os
import statistics
from typing import Dict, List, Optional

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import run_grid
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "compute.yaml")
DEFAULT_SEEDS = [1234, 4321]
SAMPLED = ["--grpo", "--grpo-sampled-backward", "--grpo-sample-dgrad", "below-core"]
GOALS = {"flops": 0.75, "fwd_bwd": 0.80, "val_pct": 0.5, "time_to_quality": 0.85}

CONTENDERS = [
    Contender("baseline", [], "megatron-core, exact; learning rate decays to --min-lr at --train-iters"),
    Contender("grpo", ["--grpo"], "GRPO's defaults: int8 core, int4 dynamic, exact backward"),
    Contender("sampled-w0.25", ["--grpo", "--grpo-sampled-backward", "--grpo-sample-variance-budget", "0.25"],
              "GRPO + sampled backward, variance budget 0.25, weight gradients only"),
    Contender("sampled-b0.25", [*SAMPLED, "--grpo-sample-variance-budget", "0.25"],
              "GRPO + sampled backward, variance budget 0.25, weight and data gradients below core"),
    Contender("sampled-b1", [*SAMPLED, "--grpo-sample-variance-budget", "1.0"],
              "GRPO + sampled backward, variance budget 1.0"),
    Contender("uniform-b0.25", [*SAMPLED, "--grpo-sample-variance-budget", "0.25",
                                "--grpo-sample-policy", "uniform"],
              "the ablation: budget 0.25's keep ratios, every row equally likely"),
    Contender("frozen", ["--grpo", "--grpo-dynamic-share", "0.65", "--grpo-stable-share", "0.2",
                         "--grpo-stable-mode", "frozen"],
              "GRPO with a 20 % stable tier frozen between updates every 10 steps"),
]


WINDOW = 50
"""Iterations whose median step time stands for each of them in the wall-clock (see below)."""


def wallclock_curve(records: List[Dict]) -> List[List[float]]:
    """[seconds of training steps so far, validation loss] at each evaluation. Each step counts
    as the median step time of its window of ``WINDOW`` iterations: on a shared 2-core machine a
    few steps slowed by another process would otherwise decide the race, while the windows keep
    what changes along a run (GRPO's exact warm-up, then its tiers)."""
    times = [r["step_time_s"] for r in records]
    smooth = []
    for i in range(0, len(times), WINDOW):
        part = times[i:i + WINDOW]
        smooth += [statistics.median(part)] * len(part)
    out, elapsed = [], 0.0
    for r, t in zip(records, smooth):
        elapsed += t
        if "val_loss" in r:
            out.append([elapsed, r["val_loss"]])
    return out


def time_to(curve: List[List[float]], target: float) -> Optional[float]:
    """Seconds until the validation loss first reaches ``target``, interpolated linearly between
    the evaluation before and the one at it; None if it never does."""
    prev = None
    for t, v in curve:
        if v <= target:
            if prev is None or prev[1] == v:
                return t
            frac = (prev[1] - target) / (prev[1] - v)
            return prev[0] + frac * (t - prev[0])
        prev = (t, v)
    return None


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def _steady(records: List[Dict], key: str, start: int) -> Optional[float]:
    return _mean(r.get(key) for r in records if r["iteration"] > start)


def predicted_flops(records: List[Dict], start: int) -> Optional[float]:
    """The planner's FLOPs ratio (megatron_grpo.planner.compute) for the run's tier map (its
    forward FLOPs below core), its mean keep ratio and whether it sampled data gradients (its
    counted data-gradient FLOPs below core under its forward's); the run's own count also sees
    the zero rows that sampled data gradients pass down, which the planner leaves out."""
    from megatron_grpo.planner.compute import predict
    from megatron_grpo.planner.plan import ModelSpec

    steady = [r for r in records if r["iteration"] > start and "sample_keep_dynamic" in r]
    if not steady:
        return None
    fwd = lambda r, t: r.get(f"flops_{t}_fwd", 0.0)  # noqa: E731
    below = statistics.mean((fwd(r, "dynamic") + fwd(r, "stable")) /
                            (fwd(r, "core") + fwd(r, "dynamic") + fwd(r, "stable")) for r in steady)
    keep = statistics.mean(r["sample_keep_dynamic"] for r in steady)
    sample_dgrad = any(r.get("flops_dynamic_dgrad", 0.0) + r.get("flops_stable_dgrad", 0.0)
                       < fwd(r, "dynamic") + fwd(r, "stable") for r in steady)
    # launch/configs/compute.yaml on 2 ranks: 2 samples of 256 tokens per rank and step.
    model = ModelSpec(num_layers=2, hidden=512, heads=8, vocab=258, seq_length=256, micro_batch_size=2)
    return predict(model, tokens=512, below_core_share=below, keep=keep,
                   sample_dgrad=sample_dgrad)["ratio"]


def run(args, command: str) -> SuiteResult:
    grid = run_grid("compute", args, DEFAULT_CONFIG, CONTENDERS, DEFAULT_SEEDS)
    seeds, spec, start = grid.seeds, grid.spec, grid.steady_from
    res = SuiteResult("compute", "Compute: the sampled backward, time to the baseline's quality",
                      command, ["contender", "FLOPs/step", "planner", "keep (dynamic)", "fwd+bwd ratio",
                                "step ratio", "val loss", "vs baseline", "time to baseline's val"])
    curves = {}
    for c in CONTENDERS:
        if c.name not in grid.names:
            continue
        recs = grid.records[c.name]
        flops = [1.0 if c.name == "baseline" else _steady(recs[s], "flops_ratio", start) for s in seeds]
        keep = _mean(_steady(recs[s], "sample_keep_dynamic", start) for s in seeds)
        times = []
        for s in seeds:
            target = grid.summaries["baseline"][s]["val_loss"]
            mine = time_to(wallclock_curve(recs[s]), target)
            base = time_to(wallclock_curve(grid.records["baseline"][s]), target)
            times.append(mine / base if mine is not None and base else None)
            curves[f"{c.name} s{s}"] = wallclock_curve(recs[s])
        reached = [t for t in times if t is not None]
        res.rows.append([
            c.name, F.fmt(_mean(flops), ".3f", "x"),
            F.fmt(_mean(predicted_flops(recs[s], start) for s in seeds), ".3f", "x"), F.fmt(keep, ".2f"),
            F.fmt(grid.mean(c.name, "steady_fwd_bwd_time_ratio"), ".3f"),
            F.fmt(grid.mean(c.name, "steady_step_time_ratio"), ".3f"),
            F.fmt(_mean(grid.summaries[c.name][s]["val_loss"] for s in seeds), ".4f"),
            F.fmt(grid.mean(c.name, "val_loss_diff_pct"), "+.2f", " %"),
            (F.fmt(statistics.mean(reached), ".3f", "x") if len(reached) == len(times)
             else f"never on {len(times) - len(reached)} of {len(times)} seeds"
             + (f" (others {F.fmt(statistics.mean(reached), '.3f', 'x')})" if reached else ""))])
        res.data[c.name] = {"flops_ratio": flops, "time_to_baseline_val": times,
                            "val_loss": [grid.summaries[c.name][s]["val_loss"] for s in seeds],
                            "compare": grid.compare[c.name]}
    res.notes += [f"{c.name}: {c.about}" for c in CONTENDERS if c.name in grid.names]
    res.notes.append(f"seeds {', '.join(map(str, seeds))} (figures are their means); times, "
                     f"FLOPs and keep ratios over iterations > {start} (after GRPO's warm-up), "
                     f"val loss at the last evaluation; time to the baseline's val: wall-clock of "
                     f"training steps (each window of {WINDOW} steps at its median step time) against "
                     f"the baseline's own, seed by seed")
    res.notes.append("goals: FLOPs <= {flops}x, fwd+bwd <= {fwd_bwd}x, val within +{val_pct} %, "
                     "time to the baseline's val <= {time_to_quality}x".format(**GOALS))
    res.notes.append(grid.load_note)
    res.plots["validation loss against wall-clock"] = plots.val_vs_time(
        curves, os.path.join(spec.out, "val_vs_time.png"), "compute")
    res.plots["validation loss"] = plots.loss_curves(
        {n: grid.records[n][seeds[0]] for n in grid.names},
        os.path.join(spec.out, "loss.png"), f"compute, seed {seeds[0]}")
    return res
