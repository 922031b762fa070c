"""Communication: the megatron baseline beside GRPO with each dynamic-tier compressor and beside
"everything int4" (one compressed tier, no ranking), on the tiny model, one run each.

Bytes are the counted per-rank volume of every torch.distributed call of a step; "after
warm-up" = the iterations after GRPO's exact warm-up, the same iterations for every run.
"""

from __future__ import annotations

import os

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_all
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")
ALL_DYNAMIC = ["--grpo-core-share", "0", "--grpo-dynamic-share", "1", "--grpo-stable-share", "0",
               "--grpo-max-dynamic-share", "1"]
# GRPO's settings before issue 9's front moved the defaults: three tiers 15/65/20 and an exact
# core. The suites whose documented figures were measured with them name them (with the stable
# mode of the time), so their commands retrain the same runs.
THREE_TIERS = ["--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.65", "--grpo-stable-share", "0.2",
               "--grpo-max-dynamic-share", "0.7", "--grpo-core-compressor", "none"]
FORMER_FROZEN = [*THREE_TIERS, "--grpo-stable-mode", "frozen"]

CONTENDERS = [
    Contender("baseline", [], "megatron-core DDP + distributed optimizer, overlapped, exact fp32"),
    Contender("grpo-int4", ["--grpo", *FORMER_FROZEN],
              "GRPO, former defaults: 15/65/20 tiers, exact core, int4 dynamic tier, frozen stable"),
    Contender("grpo-int8", ["--grpo", *FORMER_FROZEN, "--grpo-compressor", "int8"], "GRPO, int8 dynamic tier"),
    Contender("grpo-topk", ["--grpo", *FORMER_FROZEN, "--grpo-compressor", "topk"],
              "GRPO, top-k 5 % dynamic tier (error feedback)"),
    Contender("grpo-powersgd", ["--grpo", *FORMER_FROZEN, "--grpo-compressor", "powersgd"],
              "GRPO, PowerSGD rank-4 dynamic tier (error feedback)"),
    Contender("all-int4", ["--grpo", *ALL_DYNAMIC],
              "no tiers: every unit int4 with error feedback (pinned units stay exact)"),
]


def run(args, command: str) -> SuiteResult:
    spec, records, summaries, cmp, warmup, load = run_all("comm", args, DEFAULT_CONFIG, CONTENDERS)
    res = SuiteResult("comm", "Communication: baseline, GRPO compressors, everything-int4", command,
                      ["contender", "val loss", "vs baseline", "bytes/step after warm-up",
                       "ratio", "core / dynamic / stable KB", "whole-run ratio",
                       "step time ratio", "dynamic rel. error"])
    for c in CONTENDERS:
        s, k = summaries[c.name], cmp[c.name]
        tiers = s.get("steady_wire_bytes_by_tier")
        split = " / ".join(f"{tiers[t] / 1e3:.0f}" for t in F.TIERS) if tiers else "-"
        h = s.get("health")
        res.rows.append([c.name, F.fmt(s["val_loss"], ".4f"),
                         F.fmt(k["val_loss_diff_pct"], "+.2f", " %"),
                         f"{s['steady_wire_bytes_per_step'] / 1e6:.3f} MB",
                         F.fmt(k["steady_wire_ratio"], ".3f"), split, F.fmt(k["wire_ratio"], ".3f"),
                         F.fmt(k["step_time_ratio"], ".3f"),
                         f"{h['rel_error'][0]:.2f}-{h['rel_error'][1]:.2f}" if h else "-"])
    res.notes += [f"{c.name}: {c.about}" for c in CONTENDERS]
    res.notes.append(f"config {os.path.basename(spec.config)}; after warm-up = iterations > "
                     f"{warmup} (every GRPO run tiered), the same iterations for every run")
    res.notes.append(load)
    res.data = {"summaries": summaries, "compare": cmp}
    res.plots["validation loss"] = plots.loss_curves(records, plot_path(spec, "loss.png"), "comm")
    res.plots["bytes per step"] = plots.wire_per_step(
        {k: records[k] for k in ("baseline", "grpo-int4", "all-int4")},
        plot_path(spec, "wire.png"), "counted bytes per rank per step")
    res.plots["bytes vs validation loss"] = plots.bytes_vs_quality(
        {n: (cmp[n]["steady_wire_ratio"], cmp[n]["val_loss_diff_pct"]) for n in summaries},
        plot_path(spec, "front.png"), "bytes after warm-up vs validation loss")
    res.plots["GRPO tier map"] = plots.tier_map(records["grpo-int4"], plot_path(spec, "tier_map.png"),
                                                "GRPO (int4) tier of each unit")
    return res
