"""Quality at realistic length: the ~10 M-parameter GPT (launch/configs/small.yaml) trained
2,000 steps by the megatron baseline and by GRPO with its defaults, same seed, data and steps,
for each seed; validation loss on held-out documents along the run.

Goal: validation loss <= +1 % of the baseline's at <= 0.15x its wire bytes.
"""

from __future__ import annotations

import os
from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.comm import FORMER_FROZEN
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import run_grid
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "small.yaml")
DEFAULT_SEEDS = [1234, 4321]
VAL_GOAL_PCT = 1.0
BYTES_GOAL = 0.15

CONTENDERS = [
    Contender("baseline", [], "megatron-core DDP + distributed optimizer, exact"),
    Contender("grpo", ["--grpo", *FORMER_FROZEN], "GRPO, former defaults: 15/65/20 tiers, exact "
              "core, int4 dynamic, frozen stable"),
]


def run(args, command: str) -> SuiteResult:
    grid = run_grid("quality", args, DEFAULT_CONFIG, CONTENDERS, DEFAULT_SEEDS)
    seeds, spec, records, warmup = grid.seeds, grid.spec, grid.records, grid.steady_from
    res = SuiteResult(
        "quality", "Quality at realistic length (~10 M parameters, baseline vs GRPO)", command,
        ["seed", "iterations", "baseline val", "GRPO val", "GRPO vs baseline",
         "diff at 25/50/75 % of the run", "late loss vs baseline", "bytes after warm-up", "bytes whole run",
         "step time ratio"])
    diffs, ratios = [], []
    for seed in seeds:
        b, g = grid.summaries["baseline"][seed], grid.summaries["grpo"][seed]
        cmp = grid.compare["grpo"][seed]
        res.data[f"seed{seed}"] = {"baseline": b, "grpo": g, "compare": cmp}
        n = b["iterations"]
        marks = [m for m in (n // 4, n // 2, 3 * n // 4)]
        at = [F.fmt(dict((int(i), d) for i, d in cmp["val_diff_curve"]).get(m), "+.2f", " %")
              for m in marks]
        res.rows.append([seed, n, F.fmt(b["val_loss"], ".4f"), F.fmt(g["val_loss"], ".4f"),
                         F.fmt(cmp["val_loss_diff_pct"], "+.2f", " %"), " / ".join(at),
                         F.fmt(cmp.get("late_loss_diff_pct"), "+.2f", " %"),
                         F.fmt(cmp["steady_wire_ratio"], ".3f", "x"),
                         F.fmt(cmp["wire_ratio"], ".3f", "x"),
                         F.fmt(cmp["step_time_ratio"], ".3f")])
        diffs.append(cmp["val_loss_diff_pct"])
        ratios.append(cmp["steady_wire_ratio"])
        res.plots[f"loss curves, seed {seed}"] = plots.loss_curves(
            {"baseline": records["baseline"][seed], "grpo": records["grpo"][seed]},
            os.path.join(spec.out, f"loss_s{seed}.png"), f"seed {seed}")
    res.plots["validation loss vs baseline"] = plots.val_diff(
        {f"GRPO seed {s}": res.data[f"seed{s}"]["compare"]["val_diff_curve"] for s in seeds},
        os.path.join(spec.out, "val_diff.png"), "GRPO validation loss relative to the baseline",
        VAL_GOAL_PCT)
    first = seeds[0]
    res.plots[f"wire bytes per step, seed {first}"] = plots.wire_per_step(
        {"baseline": records["baseline"][first], "grpo": records["grpo"][first]},
        os.path.join(spec.out, "wire.png"), "counted bytes per rank per step")
    res.plots[f"GRPO tier map, seed {first}"] = plots.tier_map(
        records["grpo"][first], os.path.join(spec.out, "tier_map.png"), "GRPO tier of each unit")
    worst = max(d for d in diffs if d is not None) if any(d is not None for d in diffs) else None
    bytes_ = max(r for r in ratios if r is not None) if any(r is not None for r in ratios) else None
    met = worst is not None and bytes_ is not None and worst <= VAL_GOAL_PCT and bytes_ <= BYTES_GOAL
    res.notes.append(
        f"goal: validation <= +{VAL_GOAL_PCT:g} % at <= {BYTES_GOAL}x bytes (after warm-up): "
        f"worst seed {F.fmt(worst, '+.2f', ' %')} at {F.fmt(bytes_, '.3f', 'x')}: "
        f"{'MET' if met else 'MISSED'}")
    res.notes.append(F.LATE_LOSS_NOTE)
    res.notes.append(f"config {os.path.basename(spec.config)}; bytes after warm-up = iterations "
                     f"> {warmup} (GRPO's exact warm-up steps left out), the same iterations for "
                     f"both runs")
    res.notes.append(grid.load_note)
    return res
