"""Phase f: the sampled backward on the GPU. The ~300 M bf16 GPT of phase e (24 layers, hidden
1024, seq 1024), one rank, 20 steps, megatron's baseline against GRPO with
``--grpo-sampled-backward --grpo-sample-dgrad below-core``, one run after the other (step times).

What must hold:

* after the warm-up, the sampled run keeps fewer rows than it has (``sample_keep_dynamic`` < 1)
  and counts fewer FLOPs than the exact step (``flops_ratio`` <= 0.90; the goal, 0.75, is
  reported);
* its forward+backward is not pathologically slow: the median steady step minus the optimizer
  is at most 1.5x the baseline's (a host sync per layer, or a GEMM on every row, would show);
* its validation loss after 20 steps is within +3 % of the baseline's (a biased or broken
  gradient diverges within a few steps; equal quality is a CPU-bench question, not 20 steps').

The figures (step time ratio, FLOPs ratio, keep ratio, validation loss) go into results.json.
The CPU dry run analyses recorded-shape numbers (``synthetic``) and checks that the analysis
passes them and fails each defect.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

from . import specs
from .common import Expect, median, table
from .phase_c import check_run
from .runs import TrainRun

ITERS = 20
WARMUP = 6
FLOPS_MAX = 0.90
FLOPS_GOAL = 0.75
FWD_BWD_MAX = 1.5
VAL_MAX_PCT = 3.0
SAMPLED = ["--grpo", "--grpo-bucket-mb", "16", "--grpo-warmup-iters", str(WARMUP),
           "--grpo-retier-interval", "100", "--grpo-stable-interval", "1",
           "--grpo-sampled-backward", "--grpo-sample-dgrad", "below-core", "--grpo-sample-interval", "2"]


def runs(ctx) -> List[TrainRun]:
    base = [*specs.BIG, "--bf16", "--train-iters", str(ITERS), "--eval-interval", str(ITERS),
            "--eval-iters", "4"]
    return [TrainRun("f_base", "f", base, nproc=1, cap_s=200),
            TrainRun("f_sampled", "f", [*base, *SAMPLED], nproc=1, cap_s=200)]


def _fwd_bwd(r: dict) -> float:
    return r["step_time_s"] - r.get("optimizer_time_s", 0.0)


def analyze_records(ex: Expect, base: List[dict], sampled: List[dict]) -> List[list]:
    steady = [r for r in sampled if r["iteration"] > WARMUP + 2]
    base_steady = [r for r in base if r["iteration"] > WARMUP + 2]
    kept = [r for r in steady if r.get("sample_keep_dynamic", 1.0) < 1.0]
    ex.that(bool(steady) and len(kept) == len(steady),
            f"sampled steps: {len(kept)} of {len(steady)} steady steps keep < 1 of the rows")
    flops = median([r.get("flops_ratio", 1.0) for r in steady]) if steady else 1.0
    ex.that(flops <= FLOPS_MAX, f"FLOPs per step {flops:.3f}x the exact step <= {FLOPS_MAX} "
            f"(goal {FLOPS_GOAL})")
    if not (steady and base_steady):
        return []
    t_base, t_samp = median([_fwd_bwd(r) for r in base_steady]), median([_fwd_bwd(r) for r in steady])
    ratio = t_samp / t_base if t_base else float("inf")
    ex.that(ratio <= FWD_BWD_MAX, f"fwd+bwd {1e3 * t_samp:.1f} ms vs baseline {1e3 * t_base:.1f} ms: "
            f"x{ratio:.3f} <= {FWD_BWD_MAX}")
    vb, vs = base[-1].get("val_loss"), sampled[-1].get("val_loss")
    diff = 100 * (vs / vb - 1) if vb and vs else float("inf")
    ex.that(diff <= VAL_MAX_PCT, f"validation loss {vs} vs baseline {vb}: {diff:+.2f} % <= +{VAL_MAX_PCT} %")
    ex.number("f_fwd_bwd_ratio", ratio)
    ex.number("f_flops_ratio", flops)
    ex.number("f_val_diff_pct", diff)
    keep = median([r["sample_keep_dynamic"] for r in kept]) if kept else None
    return [["baseline", f"{1e3 * t_base:.1f}", "1.000", "-", f"{vb}"],
            ["sampled", f"{1e3 * t_samp:.1f}", f"{flops:.3f}", f"{keep:.2f}" if keep else "-", f"{vs}"]]


HEADERS = ["run", "median fwd+bwd ms", "FLOPs ratio", "keep (dynamic)", "val loss"]


def synthetic() -> Tuple[List[dict], List[dict]]:
    """Records shaped like a passing device run (baseline, sampled)."""
    base, sampled = [], []
    for i in range(1, ITERS + 1):
        base.append({"iteration": i, "loss": 7.0 - 0.1 * i, "step_time_s": 0.50, "optimizer_time_s": 0.05})
        r = {"iteration": i, "loss": 7.0 - 0.1 * i, "step_time_s": 0.50, "optimizer_time_s": 0.05,
             "flops_ratio": 1.0}
        if i > WARMUP:
            r.update(step_time_s=0.42, flops_ratio=0.72, sample_keep_dynamic=0.45)
        sampled.append(r)
    base[-1]["val_loss"], sampled[-1]["val_loss"] = 5.10, 5.14
    return base, sampled


DEFECTS = {
    "sampled steps": lambda b, s: [r.pop("sample_keep_dynamic", None) for r in s],
    "FLOPs per step": lambda b, s: [r.update(flops_ratio=1.0) for r in s],
    "fwd+bwd": lambda b, s: [r.update(step_time_s=2.0) for r in s if r["iteration"] > WARMUP],
    "validation loss": lambda b, s: s[-1].update(val_loss=6.0),
}


def dry_run(ex: Expect) -> str:
    """The analysis on ``synthetic`` numbers: passes them, fails each defect of ``DEFECTS``."""
    base, sampled = synthetic()
    inner = Expect(echo=False)
    rows = analyze_records(inner, base, sampled)
    ex.that(inner.status() == "PASS", f"analysis passes recorded-shape numbers ({inner.asserted} "
            f"assertions{': ' + '; '.join(inner.failures) if inner.failures else ''})")
    for what, damage in DEFECTS.items():
        b, s = copy.deepcopy(base), copy.deepcopy(sampled)
        damage(b, s)
        probe = Expect(echo=False)
        analyze_records(probe, b, s)
        ex.that(probe.status() == "FAIL" and any(what in f for f in probe.failures),
                f"analysis fails a defect in '{what}': {probe.failures[:1]}")
    return table(HEADERS, rows)


def analyze(ex: Expect, ctx, train_runs: List[TrainRun]) -> str:
    by: Dict[str, TrainRun] = {r.name: r for r in train_runs}
    base, sampled = by["f_base"], by["f_sampled"]
    ok = [check_run(ex, r) for r in (base, sampled)]
    for r in (base, sampled):
        ex.that(r.platform is not None and "cuda" in r.platform, f"{r.name}: platform {r.platform}")
        ex.that(r.spec == "local", f"{r.name}: spec {r.spec} (the sampled backward needs the local spec)")
    if not all(ok):
        return table(HEADERS, [[r.name, "-", "-", "-", r.describe()] for r in (base, sampled)])
    return table(HEADERS, analyze_records(ex, base.records, sampled.records))
