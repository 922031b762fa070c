"""Phase e: a ~300 M bf16 GPT (24 layers, hidden 1024, seq 1024) for 20 steps, megatron's
baseline against GRPO: step time, peak device memory (torch.cuda.max_memory_allocated, per
step) and a monitoring (health) step.

Two ranks on the one device over gloo (as phase d): at one rank nothing is compressed, so there
would be no monitoring step to measure. The two runs go one after the other, alone on the
device (step times). What must hold:

* GRPO's steady steps are no slower than the baseline's (x1.15: gloo stages every collective
  through host memory, and GRPO sends a fraction of the bytes);
* a monitoring step costs little time (<= 1.5x the steady steps like it + 50 ms: same
  stable-update status, since an update step syncs the stable tier too) and little memory: its
  peak exceeds the steps like it (same stable-update status) by at most two units' fp32 bytes
  plus four health chunks (megatron_grpo/grpo/health.py sums in bounded chunks; bucket-sized fp64
  copies, a former defect, are 8x a unit);
* GRPO's peak over the baseline's is at most the planner's extra state (residuals, delayed
  accumulators: megatron_grpo.planner.plan.plan) plus 10 % of the baseline's peak (512 MiB at least).

The CPU dry run cannot train this model: it runs the same analysis on recorded-shape numbers
(``synthetic``) and checks that it passes them and fails each defect.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Tuple

from . import specs
from .common import Expect, median, table
from .phase_c import check_run
from .runs import TrainRun

MIB = 2**20
HEALTH_CHUNK_BYTES = 4 * (1 << 20)  # megatron_grpo.grpo.health.HEALTH_CHUNK_ELEMENTS fp32 elements
STEP_RATIO_MAX = 1.15
MONITOR_TIME = (1.5, 0.05)


def runs(ctx) -> List[TrainRun]:
    base = specs.big(20)
    return [TrainRun("e_base", "e", base, nproc=2, cap_s=220),
            TrainRun("e_grpo", "e", [*base, *specs.BIG_GRPO], nproc=2, cap_s=220)]


def unit_bytes() -> int:
    return int(16 * MIB)  # --grpo-bucket-mb 16 of BIG_GRPO, fp32


def planned(tiers: str, attention: str) -> Tuple[int, int]:
    """(baseline, GRPO) planned per-rank memory totals for the runs' flags and final tier map."""
    from megatron_grpo.planner.plan import plan

    model, cluster, grpo, bucket = specs.plan_inputs([*specs.big(20), *specs.BIG_GRPO], nodes=1,
                                                     gpus_per_node=2, attention=attention)
    p = plan(model, cluster, grpo, bucket_size=bucket, tiers=tiers)
    return p.baseline_memory.total, p.grpo_memory.total


def _update(r: dict) -> bool:
    return bool(r.get("grpo_stable_update"))


def _peak(r: dict) -> int:
    return int(r.get("step_peak_device_bytes") or 0)


def analyze_records(ex: Expect, base: List[dict], grpo: List[dict], planned_extra: int,
                    unit: int) -> List[list]:
    """The assertions of the module docstring on the two runs' metric records; table rows."""
    warm = sum(1 for r in grpo if set(r.get("grpo_tier_map", "c")) == {"c"})
    tiered = [r for r in grpo if set(r.get("grpo_tier_map", "c")) != {"c"}][1:]  # not the re-tier step
    mon = [r for r in tiered if "grpo_rel_error_dynamic" in r]
    steady = [r for r in tiered if "grpo_rel_error_dynamic" not in r]
    base_steady = [r for r in base if r["iteration"] > warm + 1]
    ex.that(bool(mon), f"GRPO ran monitoring steps: iterations {[r['iteration'] for r in mon]}")
    ex.that(bool(steady) and bool(base_steady), f"steady steps: GRPO {len(steady)}, baseline {len(base_steady)}")
    if not (mon and steady and base_steady):
        return []
    t_base = median([r["step_time_s"] for r in base_steady])
    t_grpo = median([r["step_time_s"] for r in steady])
    t_mon = max(r["step_time_s"] for r in mon)
    ex.that(t_grpo <= STEP_RATIO_MAX * t_base, f"GRPO median steady step {1e3 * t_grpo:.1f} ms <= "
            f"{STEP_RATIO_MAX} x baseline {1e3 * t_base:.1f} ms (x{t_grpo / t_base:.3f})")
    a, b = MONITOR_TIME
    slow = []  # each monitoring step against the steady steps like it (a stable update syncs more)
    for m in mon:
        like = [r["step_time_s"] for r in steady if _update(r) == _update(m)]
        if like and m["step_time_s"] > a * median(like) + b:
            slow.append(f"iteration {m['iteration']} {1e3 * m['step_time_s']:.1f} ms vs "
                        f"{1e3 * median(like):.1f} ms")
    ex.that(not slow, f"slowest monitoring step {1e3 * t_mon:.1f} ms: each within {a} x the median "
            f"of the steady steps like it + {1e3 * b:.0f} ms" + (f"; not {slow}" if slow else ""))
    peak_base = max(_peak(r) for r in base)
    peak_grpo = max(_peak(r) for r in grpo if r not in mon)
    slack = max(0.10 * peak_base, 512 * MIB)
    extra = peak_grpo - peak_base
    ex.that(peak_base > 0 and extra <= planned_extra + slack,
            f"GRPO peak {peak_grpo / MIB:,.0f} MiB - baseline {peak_base / MIB:,.0f} MiB = "
            f"{extra / MIB:,.0f} MiB <= planned extra state {planned_extra / MIB:,.0f} MiB + "
            f"{slack / MIB:,.0f} MiB")
    bound = 2 * unit + 4 * HEALTH_CHUNK_BYTES
    worst: Optional[int] = None
    for m in mon:
        like = [_peak(r) for r in steady if _update(r) == _update(m)]
        if like:
            over = _peak(m) - max(like)
            worst = over if worst is None else max(worst, over)
    ex.that(worst is not None and worst <= bound, f"monitoring step peak over the steps like it: "
            f"{'-' if worst is None else f'{worst / MIB:.1f}'} MiB <= {bound / MIB:.0f} MiB "
            f"(2 units + 4 health chunks)")
    return [["baseline", f"{1e3 * t_base:.1f}", "-", f"{peak_base / MIB:,.0f}", "-"],
            ["GRPO", f"{1e3 * t_grpo:.1f}", f"{1e3 * t_mon:.1f}", f"{peak_grpo / MIB:,.0f}",
             f"{extra / MIB:,.0f} (planned {planned_extra / MIB:,.0f})"]]


HEADERS = ["run", "median step ms", "monitoring step ms", "peak MiB", "extra over baseline MiB"]


def synthetic() -> Tuple[List[dict], List[dict], int]:
    """Records shaped like a passing device run (baseline, GRPO) and the planned extra bytes."""
    base, grpo = [], []
    units = 73  # GRPO units of the ~300M model at --grpo-bucket-mb 16 (the planner's count)
    for i in range(1, 21):
        base.append({"iteration": i, "loss": 6.0 - 0.05 * i, "step_time_s": 0.80,
                     "step_peak_device_bytes": 9000 * MIB})
        tiers = "c" * units if i <= 6 else "c" * 11 + "d" * 48 + "s" * 14
        r = {"iteration": i, "loss": 6.0 - 0.05 * i, "grpo_tier_map": tiers,
             "step_time_s": 0.80 if i <= 6 else 0.45,
             # Released gradients pay for GRPO's masters and residuals (the planner: +0 MiB).
             "step_peak_device_bytes": 9000 * MIB if i <= 6 else 9100 * MIB,
             "grpo_stable_update": i % 5 == 0}
        if i > 6 and i % 4 == 0:
            r.update(grpo_rel_error_dynamic=0.1, step_time_s=0.5,
                     step_peak_device_bytes=9100 * MIB + 20 * MIB)
        grpo.append(r)
    return base, grpo, 0


DEFECTS = {
    "monitoring steps": lambda b, g: [r.pop("grpo_rel_error_dynamic", None) for r in g],
    "median steady step": lambda b, g: [r.update(step_time_s=1.2) for r in g
                                        if "grpo_rel_error_dynamic" not in r and r["iteration"] > 6],
    "slowest monitoring step": lambda b, g: [r.update(step_time_s=2.0) for r in g if "grpo_rel_error_dynamic" in r],
    "GRPO peak": lambda b, g: [r.update(step_peak_device_bytes=r["step_peak_device_bytes"] + 4000 * MIB)
                               for r in g],
    "monitoring step peak": lambda b, g: [r.update(step_peak_device_bytes=r["step_peak_device_bytes"] + 8 * unit_bytes())
                                          for r in g if "grpo_rel_error_dynamic" in r],
}


def dry_run(ex: Expect) -> str:
    """The analysis on ``synthetic`` numbers: passes them, fails each defect of ``DEFECTS``."""
    base, grpo, extra = synthetic()
    inner = Expect(echo=False)
    rows = analyze_records(inner, base, grpo, extra, unit_bytes())
    ex.that(inner.status() == "PASS", f"analysis passes recorded-shape numbers ({inner.asserted} "
            f"assertions{': ' + '; '.join(inner.failures) if inner.failures else ''})")
    for what, damage in DEFECTS.items():
        b, g = copy.deepcopy(base), copy.deepcopy(grpo)
        damage(b, g)
        probe = Expect(echo=False)
        analyze_records(probe, b, g, extra, unit_bytes())
        ex.that(probe.status() == "FAIL" and any(what in f for f in probe.failures),
                f"analysis fails a defect in '{what}': {probe.failures[:1]}")
    return table(HEADERS, rows)


def analyze(ex: Expect, ctx, train_runs: List[TrainRun]) -> str:
    by: Dict[str, TrainRun] = {r.name: r for r in train_runs}
    base, grpo = by["e_base"], by["e_grpo"]
    ok = [check_run(ex, r) for r in (base, grpo)]
    for r in (base, grpo):
        ex.that(r.platform == "gloo/cuda:0", f"{r.name}: platform {r.platform} (gloo/cuda:0)")
    if not all(ok):
        return table(HEADERS, [[r.name, "-", "-", "-", r.describe()] for r in (base, grpo)])
    tiers = grpo.records[-1]["grpo_tier_map"]
    attention = "flash" if grpo.spec == "transformer_engine" else "unfused"
    plan_base, plan_grpo = planned(tiers, attention)
    ex.info(f"planner ({attention} attention, final tiers {tiers}): baseline {plan_base / MIB:,.0f} MiB, "
            f"GRPO {plan_grpo / MIB:,.0f} MiB per rank")
    ex.number("planned_base_bytes", plan_base)
    ex.number("planned_grpo_bytes", plan_grpo)
    rows = analyze_records(ex, base.records, grpo.records, plan_grpo - plan_base, unit_bytes())
    return table(HEADERS, rows)
