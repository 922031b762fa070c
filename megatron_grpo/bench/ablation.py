"""Ablation: does ranking by gradient importance matter? GRPO with its defaults beside the same
tier shares drawn at random or inverted, and beside the other importance scores, 2 seeds each,
every run against the megatron baseline of its seed (tiny model by default; ``--config
launch/configs/small.yaml`` for the ~10 M-parameter one).

Same shares give the same bytes up to unit sizes; the table prints each contender's bytes so
"equal bytes" is checked, not assumed.
"""

from __future__ import annotations

import os

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_grid
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")
DEFAULT_SEEDS = [1234, 4321]

CONTENDERS = [
    Contender("baseline", [], "megatron-core, exact"),
    Contender("importance", ["--grpo"], "GRPO defaults: ranked by sum |g|*|w| per element"),
    Contender("random", ["--grpo", "--grpo-tier-policy", "random"],
              "same shares, a fresh random draw at every re-tier"),
    Contender("inverse", ["--grpo", "--grpo-tier-policy", "inverse"],
              "same shares, most important units stable, least important core"),
    Contender("score-grad", ["--grpo", "--grpo-importance-score", "grad"], "ranked by sum |g|"),
    Contender("score-fisher", ["--grpo", "--grpo-importance-score", "fisher"], "ranked by sum g^2"),
]


def run(args, command: str) -> SuiteResult:
    grid = run_grid("ablation", args, DEFAULT_CONFIG, CONTENDERS, DEFAULT_SEEDS)
    seeds = grid.seeds
    res = SuiteResult("ablation", "Ablation: importance-ranked tiers vs random and inverse, "
                      "score variants", command,
                      ["contender", *[f"val vs baseline, seed {s}" for s in seeds], "mean",
                       "bytes ratio after warm-up (mean)"])
    for c in CONTENDERS[1:]:
        res.rows.append([c.name, *[F.fmt(grid.compare[c.name][s]["val_loss_diff_pct"], "+.2f", " %")
                                   for s in seeds],
                         F.fmt(grid.mean(c.name, "val_loss_diff_pct"), "+.2f", " %"),
                         F.fmt(grid.mean(c.name, "steady_wire_ratio"), ".3f")])
    spread = grid.baseline_spread_pct()
    imp, rnd = grid.mean("importance", "val_loss_diff_pct"), grid.mean("random", "val_loss_diff_pct")
    if imp is not None and rnd is not None:
        gain = rnd - imp
        verdict = ("beats" if spread is not None and gain > spread else "does NOT beat")
        res.notes.append(f"importance ranking {verdict} random tiers by more than the baseline's "
                         f"seed-to-seed spread: random - importance = {gain:+.2f} points, spread "
                         f"{F.fmt(spread, '.2f', ' %')}")
    res.notes += [f"{c.name}: {c.about}" for c in CONTENDERS]
    res.notes.append(grid.load_note)
    res.data = {"summaries": grid.summaries, "compare": grid.compare, "baseline_spread_pct": spread}
    res.plots["validation loss vs baseline"] = plots.val_diff(
        {f"{n} s{s}": grid.compare[n][s]["val_diff_curve"] for n in ("importance", "random", "inverse")
         for s in seeds}, plot_path(grid.spec, "val_diff.png"), "tier policy: validation vs baseline")
    res.plots["bytes vs validation loss"] = plots.bytes_vs_quality(
        {n: (grid.mean(n, "steady_wire_ratio"), grid.mean(n, "val_loss_diff_pct"))
         for n in grid.compare if n != "baseline"}, plot_path(grid.spec, "front.png"),
        "ablation: mean over seeds")
    return res
