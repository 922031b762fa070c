"""Figures of a run and of one run against another, from the per-iteration metrics records.

Only the trainer's own records are used: bytes are the counted torch.distributed volume of each
step (megatron_grpo/comm/wire.py), times the step's host wall time, validation the trainer's
evaluation on held-out documents. The first iteration is left out of timings (warm-up).
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence

from megatron_grpo.grpo.config import TIERS  # noqa: E402 - the one definition

LATE_LOSS_NOTE = ("late loss: mean training loss over the second half of the run, against the "
                  "baseline of the same seed (the same batches in the same order). These runs see "
                  "under one epoch, so every batch is unseen when its loss is taken: a held-out "
                  "figure over hundreds of batches, steadier than the final evaluation's few")


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def val_curve(records: List[Dict]) -> List[List[float]]:
    """[[iteration, validation loss], ...] in iteration order."""
    return [[r["iteration"], r["val_loss"]] for r in records if "val_loss" in r]


def window(records: List[Dict], first_iter: int) -> List[Dict]:
    """Records of iterations after ``first_iter`` (the same iterations for every contender)."""
    return [r for r in records if r["iteration"] > first_iter]


def steady_start(runs: Sequence[List[Dict]], default: int) -> int:
    """Last exact iteration before every GRPO run is tiered: the steady window (iterations after
    it) is then the same for every contender and holds no GRPO warm-up step."""
    firsts = [next((r["iteration"] for r in recs if r.get("grpo_tiered")), None) for recs in runs
              if any("grpo_tiered" in r for r in recs)]
    firsts = [f for f in firsts if f is not None]
    return max(firsts) - 1 if firsts else default


def summarize(records: List[Dict], steady_from: int = 0) -> Dict:
    """One run's figures; ``steady_from``: iterations after it form the steady window (e.g. after
    GRPO's exact warm-up) for the bytes and time figures that exclude warm-up."""
    if not records:
        raise ValueError("no records: the run logged nothing")
    timed = records[1:] or records
    steady = window(records, steady_from) or timed
    vals = val_curve(records)
    out = {
        "iterations": records[-1]["iteration"],
        "loss_start": records[0]["loss"],
        "loss_end": statistics.mean(r["loss"] for r in records[-10:]),
        "val_loss": vals[-1][1] if vals else None,
        # Mean training loss over the second half of the run. Each batch's loss is measured
        # before the step that trains on it, and these runs see under one epoch, so this is a
        # held-out measurement too -- over hundreds of batches instead of one evaluation's few,
        # paired batch for batch with the baseline of the same seed (the same data order).
        "late_loss": statistics.mean(r["loss"] for r in records
                                     if r["iteration"] > records[-1]["iteration"] // 2),
        "val_curve": vals,
        "step_time_s": _median([r["step_time_s"] for r in timed]),
        "optimizer_time_s": _median([r.get("optimizer_time_s", 0.0) for r in timed]),
        "tokens_per_s": _median([r["tokens_per_s"] for r in timed]),
        "wire_bytes_per_step": statistics.mean(r["wire_bytes"] for r in timed),
        "steady_from": steady_from,
        "steady_wire_bytes_per_step": statistics.mean(r["wire_bytes"] for r in steady),
        "steady_step_time_s": _median([r["step_time_s"] for r in steady]),
        "steady_optimizer_time_s": _median([r.get("optimizer_time_s", 0.0) for r in steady]),
        "steady_fwd_bwd_time_s": _median([r["step_time_s"] - r.get("optimizer_time_s", 0.0)
                                          for r in steady]),
        "importance_time_s": statistics.mean(r.get("grpo_importance_time_s", 0.0) for r in timed),
        "peak_rss_mb": max(r["peak_rss_bytes"] for r in records) / 2**20,
        "skipped_steps": sum(1 for r in records if r.get("skipped")),
    }
    if any("wire_bytes_inter_node" in r for r in records):  # the counter's link classes
        out["steady_inter_node_bytes_per_step"] = statistics.mean(r.get("wire_bytes_inter_node", 0)
                                                                  for r in steady)
    out["fwd_bwd_time_s"] = (out["step_time_s"] - out["optimizer_time_s"]
                             if out["step_time_s"] is not None else None)
    if any("wire_bytes_core" in r for r in records):
        out["steady_wire_bytes_by_tier"] = {
            t: statistics.mean(r.get(f"wire_bytes_{t}", 0) for r in steady) for t in TIERS}
        shares = [r for r in steady if "grpo_share_core" in r]
        if shares:
            out["mean_shares"] = {t: statistics.mean(r[f"grpo_share_{t}"] for r in shares)
                                  for t in TIERS}
    health = [r for r in records if "grpo_rel_error_dynamic" in r]
    if health:
        out["health"] = {
            "checks": len(health),
            "rel_error": [min(r["grpo_rel_error_dynamic"] for r in health),
                          max(r["grpo_rel_error_dynamic"] for r in health)],
            "cosine_min": min(r["grpo_cosine_dynamic"] for r in health),
            "gvr": [min(r["grpo_gvr_dynamic"] for r in health),
                    max(r["grpo_gvr_dynamic"] for r in health)],
        }
    mem = sorted({k for r in steady for k in r if k.startswith("mem_")})
    if mem:  # device bytes by kind and tier (megatron/resident.py): the steady window's most
        out["steady_device_mb_by_kind"] = {k[4:]: max(r.get(k, 0) for r in steady) / 2**20
                                           for k in mem}
    # The steady window's peak: memory the memory tier frees after warm-up shows here, while
    # the whole-run peak also holds the warm-up's (every unit core, all state resident).
    if any("step_peak_rss_bytes" in r for r in steady):
        out["steady_peak_rss_mb"] = max(r.get("step_peak_rss_bytes", 0) for r in steady) / 2**20
    if any("grad_bytes_peak" in r for r in steady):  # --grpo-release-grads: gradient storage
        out["steady_grad_peak_mb"] = max(r.get("grad_bytes_peak", 0) for r in steady) / 2**20
        out["grad_whole_buffer_mb"] = steady[-1].get("grad_bytes_whole_buffer", 0) / 2**20
    if any("step_peak_device_bytes" in r for r in steady):
        out["steady_peak_device_mb"] = max(r.get("step_peak_device_bytes", 0) for r in steady) / 2**20
    if any("offload_bytes_written" in r for r in steady):
        moved = [r["offload_bytes_written"] + r["offload_bytes_read"] for r in steady]
        busy = sum(r["offload_io_busy_s"] for r in steady)
        stall = sum(r["offload_stall_s"] for r in steady)
        out["offload"] = {
            "moved_mb_per_step": statistics.mean(moved) / 2**20,
            "busy_s": busy, "stall_s": stall,
            "hidden_share": (1 - stall / busy) if busy > 0 else None,
            "stable_away_mb": max(r.get("offload_bytes_stable_ssd", 0) + r.get("offload_bytes_stable_cpu", 0)
                                  for r in steady) / 2**20,
            # Everything the memory tier placed away after a step: every tier and the residuals.
            "away_mb": max(sum(v for k, v in r.items() if k.startswith("offload_bytes_")
                               and k.endswith(("_ssd", "_cpu"))) for r in steady) / 2**20,
        }
    if any("peak_device_bytes" in r for r in records):
        out["peak_device_mb"] = max(r.get("peak_device_bytes", 0) for r in records) / 2**20
    if any("grpo_ef_bytes" in r for r in records):
        out["grpo_ef_mb"] = max(r.get("grpo_ef_bytes", 0) for r in records) / 2**20
    return out


def val_at(curve: List[List[float]], iteration: int) -> Optional[float]:
    for it, v in curve:
        if it == iteration:
            return v
    return None


def compare(run: Dict, base: Dict) -> Dict:
    """``run`` against ``base`` (same seed, data, iterations): ratios and relative differences."""
    def ratio(key):
        a, b = run.get(key), base.get(key)
        return a / b if a is not None and b else None

    out = {
        "val_loss_diff_pct": (100 * (run["val_loss"] / base["val_loss"] - 1)
                              if run.get("val_loss") and base.get("val_loss") else None),
        "late_loss_diff_pct": (100 * (run["late_loss"] / base["late_loss"] - 1)
                               if run.get("late_loss") and base.get("late_loss") else None),
        "wire_ratio": ratio("wire_bytes_per_step"),
        "steady_wire_ratio": ratio("steady_wire_bytes_per_step"),
        "steady_inter_node_ratio": ratio("steady_inter_node_bytes_per_step"),
        "step_time_ratio": ratio("step_time_s"),
        "steady_step_time_ratio": ratio("steady_step_time_s"),
        "fwd_bwd_time_ratio": ratio("fwd_bwd_time_s"),
        "steady_fwd_bwd_time_ratio": ratio("steady_fwd_bwd_time_s"),
        "steady_optimizer_time_ratio": ratio("steady_optimizer_time_s"),
        "optimizer_time_ratio": ratio("optimizer_time_s"),
        "peak_rss_ratio": ratio("peak_rss_mb"),
        "steady_peak_rss_ratio": ratio("steady_peak_rss_mb"),
        "steady_peak_device_ratio": ratio("steady_peak_device_mb"),
    }
    # Validation difference along the run, at the iterations both evaluated.
    base_vals = dict((int(i), v) for i, v in base.get("val_curve", []))
    out["val_diff_curve"] = [[int(i), 100 * (v / base_vals[int(i)] - 1)]
                             for i, v in run.get("val_curve", []) if base_vals.get(int(i))]
    return out


def fmt(x: Optional[float], spec: str = ".3f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def paired_step_ratios(pairs: Sequence[tuple]) -> Dict:
    """Step time of runs made in turn, (baseline, contender) pair by pair: each run's median step
    over the contender's steady window (after its exact warm-up, the same iterations in both),
    each pair's ratio, and the median of those ratios. On a shared machine whose speed drifts
    between runs, the ratio of neighbouring runs is the figure to quote, not one pair's."""
    rows = []
    for base, other in pairs:
        start = steady_start([other], 0)
        b = _median([r["step_time_s"] for r in window(base, start) if "step_time_s" in r])
        o = _median([r["step_time_s"] for r in window(other, start) if "step_time_s" in r])
        if b is None or o is None:
            raise ValueError(f"a timing pair has no steps after iteration {start}: run more iterations")
        rows.append({"baseline_s": b, "contender_s": o, "ratio": o / b})
    return {"pairs": rows, "median_ratio": _median([r["ratio"] for r in rows]),
            "spread": (min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)) if rows else None}
