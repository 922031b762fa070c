"""The bytes-vs-quality front: one-knob-at-a-time sweeps around GRPO's defaults (core share,
stable interval, stable mode, dynamic compressor), each run against the megatron baseline of
its seed; the Pareto-optimal points (fewest bytes for their validation loss) are marked."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.comm import ALL_DYNAMIC, THREE_TIERS
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_grid
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")
DEFAULT_SEEDS = [1234, 4321]
QUALITY = "late_loss_diff_pct"
"""The front's quality axis: the late loss (see LATE_LOSS_NOTE); final validation is shown too."""


def _core(share: float) -> List[str]:
    # The dynamic tier takes what core gives up (stable stays 20 %), within the dynamic guard.
    return ["--grpo-core-share", f"{share:g}", "--grpo-dynamic-share", f"{0.8 - share:g}",
            "--grpo-max-dynamic-share", "0.75"]


# Measured when frozen was the default stable mode; named explicitly so the command retrains the
# same runs now that the default is delayed. T: the three tiers and exact core of the time
# (today's defaults are core 0.15 int8, dynamic 0.85, no stable tier: core-int8-no-stable).
FROZEN = ["--grpo-stable-mode", "frozen"]
T = ["--grpo", *THREE_TIERS]
_NO_CORE = ["--grpo-core-share", "0", "--grpo-dynamic-share", "0.8", "--grpo-max-dynamic-share", "0.8"]

CONTENDERS = [Contender("baseline", [], "megatron-core, exact"),
              Contender("default", [*T, *FROZEN], "GRPO defaults before the quality front (15/65/20, exact "
                        "core, frozen stable)")]
CONTENDERS += [Contender(f"core-{int(100 * s)}", [*T, *_core(s), *FROZEN], f"core share {s:g}")
               for s in (0.05, 0.25)]
CONTENDERS += [Contender(f"stable-every-{n}", [*T, "--grpo-stable-interval", str(n), *FROZEN],
                         f"stable updated every {n}") for n in (5, 50)]
CONTENDERS += [Contender("delayed", [*T, "--grpo-stable-mode", "delayed"],
                         "delayed stable: gradients accumulate locally, synced every 10"),
               Contender("int8", [*T, "--grpo-compressor", "int8", *FROZEN], "int8 dynamic tier"),
               Contender("topk", [*T, "--grpo-compressor", "topk", *FROZEN], "top-k 5 % dynamic tier"),
               Contender("core-5-delayed", [*T, *_core(0.05), "--grpo-stable-mode", "delayed"],
                         "core share 0.05 and delayed stable"),
               Contender("no-core", [*T, *_NO_CORE, *FROZEN], "no exact core: 80 % int4, the 20 % "
                         "least important frozen-stable"),
               Contender("no-core-delayed", [*T, *_NO_CORE, "--grpo-stable-mode", "delayed"],
                         "no exact core: 80 % int4, the 20 % least important delayed-stable"),
               Contender("powersgd", [*T, "--grpo-compressor", "powersgd", *FROZEN],
                         "PowerSGD rank-4 dynamic tier (the comm suite's peer)"),
               Contender("all-int4", ["--grpo", *ALL_DYNAMIC, *FROZEN],
                         "no tiers: every unit int4 with error feedback (the comm suite's peer)"),
               Contender("core-int8", [*T, "--grpo-core-compressor", "int8"],
                         "core int8 with error feedback, dynamic int4, stable delayed"),
               Contender("core-30-int8", [*T, "--grpo-core-compressor", "int8",
                                          "--grpo-core-share", "0.3", "--grpo-dynamic-share", "0.5"],
                         "core share 0.3 int8, dynamic 0.5 int4, stable 0.2 delayed"),
               # The defaults since the quality front (named in full, so the command stays what it ran).
               Contender("core-int8-no-stable", ["--grpo", "--grpo-core-compressor", "int8",
                                                 "--grpo-dynamic-share", "0.85", "--grpo-stable-share", "0",
                                                 "--grpo-max-dynamic-share", "0.85"],
                         "core 0.15 int8, dynamic 0.85 int4, no stable tier (the defaults)"),
               Contender("core-10-int8-no-stable", ["--grpo", "--grpo-core-compressor", "int8",
                                                    "--grpo-core-share", "0.1", "--grpo-dynamic-share", "0.9",
                                                    "--grpo-stable-share", "0", "--grpo-max-dynamic-share", "0.9"],
                         "core 0.10 int8, dynamic 0.90 int4, no stable tier"),
               # The defaults on units half tiny.yaml's size: with 14 units the tiny model's 15 %
               # core holds 21.8 % of the elements (whole units), with ~28 closer to 15 %.
               Contender("core-int8-no-stable-fine", ["--grpo", "--grpo-core-compressor", "int8",
                                                      "--grpo-dynamic-share", "0.85", "--grpo-stable-share", "0",
                                                      "--grpo-max-dynamic-share", "0.85", "--grpo-bucket-mb", "0.08"],
                         "the defaults on 0.08 MB units"),
               # The same with the guard above the share: a guard equal to the dynamic share
               # rounds every plan towards core (a whole unit moves back at each re-tier).
               Contender("core-int8-no-stable-fine-g90", ["--grpo", "--grpo-core-compressor", "int8",
                                                          "--grpo-dynamic-share", "0.85", "--grpo-stable-share", "0",
                                                          "--grpo-max-dynamic-share", "0.9", "--grpo-bucket-mb", "0.08"],
                         "the defaults on 0.08 MB units, dynamic guard 0.9"),
               # The least important 20 % on 2 bits every step (--grpo-stable-mode compressed):
               # the bytes they free pay for a larger int8 core.
               Contender("core-int8-stable-int2", ["--grpo", "--grpo-core-compressor", "int8",
                                                   "--grpo-dynamic-share", "0.65", "--grpo-stable-share", "0.2",
                                                   "--grpo-max-dynamic-share", "0.65",
                                                   "--grpo-stable-mode", "compressed",
                                                   "--grpo-stable-compressor", "int2"],
                         "core 0.15 int8, dynamic 0.65 int4, stable 0.20 int2 every step"),
               Contender("core-20-int8-stable-int2", ["--grpo", "--grpo-core-compressor", "int8",
                                                      "--grpo-core-share", "0.2", "--grpo-dynamic-share", "0.6",
                                                      "--grpo-stable-share", "0.2", "--grpo-max-dynamic-share", "0.6",
                                                      "--grpo-stable-mode", "compressed",
                                                      "--grpo-stable-compressor", "int2"],
                         "core 0.20 int8, dynamic 0.60 int4, stable 0.20 int2 every step")]


def _at_most(value, limit: float) -> bool:
    return value is not None and value <= limit


def pareto(points: Dict[str, Tuple[float, float]]) -> List[str]:
    """Names of points no other point beats on both bytes and validation loss."""
    ok = {n: p for n, p in points.items() if p[0] is not None and p[1] is not None}
    return [n for n, (x, y) in ok.items()
            if not any((x2 <= x and y2 <= y) and (x2, y2) != (x, y) for x2, y2 in ok.values())]


def run(args, command: str) -> SuiteResult:
    grid = run_grid("front", args, DEFAULT_CONFIG, CONTENDERS, DEFAULT_SEEDS)
    # The baseline sits at (1.0, 0 %) by definition: on the axes so every point reads against it.
    points = {"baseline": (1.0, 0.0)}
    points.update({c.name: (grid.mean(c.name, "steady_wire_ratio"),
                            grid.mean(c.name, QUALITY)) for c in CONTENDERS[1:] if grid.has(c.name)})
    front = pareto(points)
    # A section of its own (--section) names itself: one heading per table, one anchor per link.
    model = (f" ({os.path.basename(grid.spec.config)}, {grid.section})"
             if grid.section != "front" else "")
    res = SuiteResult(grid.section, f"Bytes vs quality: sweeps around the defaults{model}", command,
                      ["setting", "bytes ratio after warm-up", "late loss vs baseline (mean)",
                       "late loss per seed", "final val per seed", "on the front"])
    for name, (x, y) in points.items():
        per = (lambda key: ", ".join(F.fmt(grid.compare[name][s][key], "+.2f", " %")  # noqa: E731
                                     for s in grid.seeds) if name != "baseline" else "")
        res.rows.append([name, F.fmt(x, ".3f"), F.fmt(y, "+.2f", " %"), per(QUALITY),
                         per("val_loss_diff_pct"), "yes" if name in front else ""])
    # The goal holds on every seed, not on the mean.
    for key, what in ((QUALITY, "late loss"), ("val_loss_diff_pct", "final validation")):
        goal = [n for n, (x, y) in points.items() if n != "baseline" and x is not None and x <= 0.15
                and all(_at_most(grid.compare[n][s].get(key), 1.0) for s in grid.seeds)]
        res.notes.append(f"points at <= 0.15x bytes and <= +1 % {what} on every seed: "
                         f"{', '.join(goal) or 'none'}")
    res.notes.append(F.LATE_LOSS_NOTE)
    res.notes.append(f"seeds {', '.join(map(str, grid.seeds))}; baseline seed spread "
                     f"{F.fmt(grid.baseline_spread_pct(), '.2f', ' %')}")
    res.notes.append(grid.load_note)
    res.data = {"points": points, "front": front, "summaries": grid.summaries}
    res.plots["bytes vs late loss"] = plots.bytes_vs_quality(
        {(f"{n} *" if n in front else n): p for n, p in points.items()},
        plot_path(grid.spec, "front.png"),
        "bytes vs late loss, mean of seeds (* = Pareto front)",
        ylabel="late loss vs baseline (%)")
    return res
