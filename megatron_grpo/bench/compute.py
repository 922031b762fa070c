"""Compute: GRPO's rotating frozen stable tier against a static freeze of the same parameter
share (Egeria/AutoFreeze-style: the least important 20 % chosen once, after the warm-up, and
never trained again), beside the megatron baseline, on the tiny model.

A frozen unit computes no weight gradient and does no optimizer work, so the saving shows in
the forward+backward and optimizer times; the quality cost shows in validation loss. The two
freeze contenders keep every other unit exact, so only the freezing differs between them.
"""

from __future__ import annotations

import os

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.comm import FORMER_FROZEN
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_all
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")
NEVER = "1000000"  # iterations: longer than any run
# Measured with the frozen stable mode and an exact core (the defaults of the time).
FREEZE_20 = ["--grpo", "--grpo-core-share", "0.8", "--grpo-dynamic-share", "0",
             "--grpo-stable-share", "0.2", "--grpo-stable-mode", "frozen", "--grpo-core-compressor", "none"]

CONTENDERS = [
    Contender("baseline", [], "megatron-core, every parameter trained every step"),
    Contender("grpo", ["--grpo", *FORMER_FROZEN], "GRPO, former defaults: stable 20 % frozen "
              "between updates every 10 steps, re-tiered every --grpo-retier-interval, dynamic int4"),
    Contender("rotating-freeze", FREEZE_20, "GRPO's stable tier alone: 20 % frozen between "
              "updates every 10 steps, re-tiered; everything else exact"),
    Contender("static-freeze", [*FREEZE_20, "--grpo-retier-interval", NEVER,
                                "--grpo-stable-interval", "0"],
              "static freeze: the least important 20 % chosen after warm-up, never trained again; "
              "everything else exact"),
]


def run(args, command: str) -> SuiteResult:
    spec, records, summaries, cmp, warmup, load = run_all("compute", args, DEFAULT_CONFIG, CONTENDERS)
    res = SuiteResult("compute", "Compute: rotating stable tier vs static freeze", command,
                      ["contender", "frozen share", "val loss", "vs baseline",
                       "fwd+bwd ms", "ratio", "optimizer ms", "ratio", "step ratio"])
    for c in CONTENDERS:
        s, k = summaries[c.name], cmp[c.name]
        share = s.get("mean_shares", {}).get("stable")
        res.rows.append([c.name, F.fmt(share and 100 * share, ".1f", " %"),
                         F.fmt(s["val_loss"], ".4f"), F.fmt(k["val_loss_diff_pct"], "+.2f", " %"),
                         F.fmt(1e3 * s["steady_fwd_bwd_time_s"], ".1f"),
                         F.fmt(k["steady_fwd_bwd_time_ratio"], ".3f"),
                         F.fmt(1e3 * s["steady_optimizer_time_s"], ".1f"),
                         F.fmt(k["steady_optimizer_time_ratio"], ".3f"),
                         F.fmt(k["steady_step_time_ratio"], ".3f")])
    res.notes += [f"{c.name}: {c.about}" for c in CONTENDERS]
    res.notes.append(f"times and frozen share: medians / means over iterations > {warmup} (every "
                     "GRPO run tiered), the same iterations for every run")
    res.notes.append(load)
    res.data = {"summaries": summaries, "compare": cmp}
    res.plots["validation loss"] = plots.loss_curves(records, plot_path(spec, "loss.png"), "compute")
    res.plots["step time breakdown"] = plots.step_breakdown(summaries, plot_path(spec, "steps.png"),
                                                            "median step time")
    res.plots["static freeze tier map"] = plots.tier_map(
        records["static-freeze"], plot_path(spec, "tier_map_static.png"), "static freeze")
    return res
