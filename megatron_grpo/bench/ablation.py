"""Ablation: does ranking by gradient importance matter? GRPO with its defaults beside the same
tier shares drawn at random or inverted, and beside the other importance scores, 2 seeds each,
every run against the megatron baseline of its seed (tiny model by default; ``--config
launch/configs/small.yaml`` for the ~10 M-parameter one).

Same shares give the same bytes up to unit sizes; the table prints each contender's bytes so
"equal bytes" is checked, not assumed.
"""

from __future__ import annotations

import os
import statistics
from typing import Dict, Optional

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.comm import THREE_TIERS
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_grid
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")
DEFAULT_SEEDS = [1234, 4321]


# The ablation freezes the stable tier: that is where the choice of units shows most (the
# measured runs used frozen, then the default; named explicitly now that delayed is), with the
# three tiers and exact core of the time (named since the defaults moved).
FROZEN = ["--grpo", *THREE_TIERS, "--grpo-stable-mode", "frozen"]

# The same command as the front's core-int8-no-stable, so the two suites share the runs.
_NO_STABLE = ["--grpo", "--grpo-core-compressor", "int8", "--grpo-dynamic-share", "0.85",
              "--grpo-stable-share", "0", "--grpo-max-dynamic-share", "0.85"]

_STABLE_INT2 = ["--grpo", "--grpo-core-compressor", "int8", "--grpo-dynamic-share", "0.65",
                "--grpo-stable-share", "0.2", "--grpo-max-dynamic-share", "0.65",
                "--grpo-stable-mode", "compressed", "--grpo-stable-compressor", "int2"]

CONTENDERS = [
    Contender("baseline", [], "megatron-core, exact"),
    Contender("importance", FROZEN, "ranked by sum |g|*|w| per element (the default score)"),
    Contender("random", [*FROZEN, "--grpo-tier-policy", "random"],
              "same shares, a fresh random draw at every re-tier"),
    Contender("inverse", [*FROZEN, "--grpo-tier-policy", "inverse"],
              "same shares, most important units stable, least important core"),
    Contender("score-grad", [*FROZEN, "--grpo-importance-score", "grad"], "ranked by sum |g|"),
    Contender("score-fisher", [*FROZEN, "--grpo-importance-score", "fisher"], "ranked by sum g^2"),
    # With an int8 core and a delayed stable tier no unit loses gradients: the ranking then only
    # decides how many bits a unit's sync gets (core int8, dynamic int4, stable exact every 10).
    Contender("importance-core8", ["--grpo", *THREE_TIERS, "--grpo-core-compressor", "int8"],
              "core int8, dynamic int4, stable delayed, ranked by importance"),
    Contender("random-core8", ["--grpo", *THREE_TIERS, "--grpo-core-compressor", "int8",
                               "--grpo-tier-policy", "random"],
              "the same compressors on a fresh random draw at every re-tier"),
    # No stable tier: the ranking only chooses which 15 % get int8 instead of int4.
    Contender("importance-core8-no-stable", [*_NO_STABLE], "core 0.15 int8, dynamic 0.85 int4, no "
              "stable tier, ranked by importance"),
    Contender("random-core8-no-stable", [*_NO_STABLE, "--grpo-tier-policy", "random"],
              "the same two tiers on a fresh random draw at every re-tier"),
    # Three bit widths (core int8, dynamic int4, stable int2 every step): the ranking decides
    # which units get 2 bits. The same command as the front's core-int8-stable-int2.
    Contender("importance-stable-int2", [*_STABLE_INT2], "core 0.15 int8, dynamic 0.65 int4, "
              "stable 0.20 int2 every step, ranked by importance"),
    Contender("random-stable-int2", [*_STABLE_INT2, "--grpo-tier-policy", "random"],
              "the same three bit widths on a fresh random draw at every re-tier"),
]
# (importance, random) pairs whose gap is tested against the seed-to-seed spread.
PAIRS = [("importance", "random"), ("importance-core8", "random-core8"),
         ("importance-core8-no-stable", "random-core8-no-stable"),
         ("importance-stable-int2", "random-stable-int2")]


def ranking_verdict(importance: Dict[int, Optional[float]], random: Dict[int, Optional[float]]) -> str:
    """Does importance beat random by more than the seed-to-seed spread? The spread is that of
    the gap itself (its range over seeds, for either policy): the baseline's own validation loss
    barely moves between seeds, so its spread would make any difference look significant."""
    seeds = [s for s in importance if importance[s] is not None and random.get(s) is not None]
    if not seeds:
        return ""
    gains = {s: random[s] - importance[s] for s in seeds}
    mean_gain = statistics.mean(gains.values())
    spread = max(max(d[s] for s in seeds) - min(d[s] for s in seeds) for d in (importance, random))
    beats = len(seeds) > 1 and mean_gain > spread and all(g > 0 for g in gains.values())
    per_seed = ", ".join(f"seed {s} {g:+.2f}" for s, g in gains.items())
    return (f"importance ranking {'beats' if beats else 'does NOT beat'} random tiers by more than "
            f"the seed-to-seed spread: random - importance = {mean_gain:+.2f} points on average "
            f"({per_seed}); spread of the gap over seeds {spread:.2f} points")


def run(args, command: str) -> SuiteResult:
    grid = run_grid("ablation", args, DEFAULT_CONFIG, CONTENDERS, DEFAULT_SEEDS)
    seeds = grid.seeds
    # A section of its own (--section) names itself: one heading per table, one anchor per link.
    model = (f" ({os.path.basename(grid.spec.config)}, {grid.section})"
             if grid.section != "ablation" else "")
    res = SuiteResult(grid.section, "Ablation: importance-ranked tiers vs random and inverse, "
                      f"score variants{model}", command,
                      ["contender", *[f"late loss vs baseline, seed {s}" for s in seeds], "mean",
                       *[f"final val, seed {s}" for s in seeds], "bytes ratio after warm-up (mean)"])
    pct = lambda n, s, key: F.fmt(grid.compare[n][s].get(key), "+.2f", " %")  # noqa: E731
    ran = [c for c in CONTENDERS[1:] if grid.has(c.name)]
    for c in ran:
        res.rows.append([c.name, *[pct(c.name, s, "late_loss_diff_pct") for s in seeds],
                         F.fmt(grid.mean(c.name, "late_loss_diff_pct"), "+.2f", " %"),
                         *[pct(c.name, s, "val_loss_diff_pct") for s in seeds],
                         F.fmt(grid.mean(c.name, "steady_wire_ratio"), ".3f")])
    spread = grid.baseline_spread_pct()
    for ranked, drawn in PAIRS:
        if not grid.has(ranked, drawn):
            continue
        for key, what in (("late_loss_diff_pct", "late loss"), ("val_loss_diff_pct", "final validation")):
            verdict = ranking_verdict({s: grid.compare[ranked][s].get(key) for s in seeds},
                                      {s: grid.compare[drawn][s].get(key) for s in seeds})
            if verdict:
                res.notes.append(f"{what}, {ranked} vs {drawn}: {verdict}")
    res.notes.append(F.LATE_LOSS_NOTE)
    res.notes += [f"{c.name}: {c.about}" for c in [CONTENDERS[0], *ran]]
    res.notes.append(grid.load_note)
    res.notes.append(f"the baseline's own validation loss differs by {F.fmt(spread, '.2f', ' %')} "
                     f"between the seeds")
    res.data = {"summaries": grid.summaries, "compare": grid.compare, "baseline_spread_pct": spread}
    policies = [n for n in ("importance", "random", "inverse") if grid.has(n)]
    if policies:
        res.plots["validation loss vs baseline"] = plots.val_diff(
            {f"{n} s{s}": grid.compare[n][s]["val_diff_curve"] for n in policies for s in seeds},
            plot_path(grid.spec, "val_diff.png"), "tier policy: validation vs baseline")
    core8 = [n for pair in PAIRS[1:] for n in pair if grid.has(n)]
    if core8:
        res.plots["validation loss vs baseline, int8 core"] = plots.val_diff(
            {f"{n} s{s}": grid.compare[n][s]["val_diff_curve"] for n in core8 for s in seeds},
            plot_path(grid.spec, "val_diff_core8.png"), "int8 core: validation vs baseline")
    res.plots["bytes vs late loss"] = plots.bytes_vs_quality(
        {n: (grid.mean(n, "steady_wire_ratio"), grid.mean(n, "late_loss_diff_pct"))
         for n in grid.compare if n != "baseline"}, plot_path(grid.spec, "front.png"),
        "ablation: late loss vs baseline, mean over seeds",
        ylabel="late loss vs baseline (%)")
    return res
