"""PNG plots of benchmark runs (matplotlib, headless Agg backend).

Each function takes records or summaries already computed by figures.py and writes one PNG;
it returns the path so callers can embed it in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes or CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

TIER_CODES = {"c": 0, "d": 1, "s": 2}
TIER_COLORS = ["#d62728", "#1f77b4", "#2ca02c"]  # core red, dynamic blue, stable green


def _smooth(xs: Sequence[float], k: int) -> List[float]:
    """Trailing moving average over ``k`` points (training loss is noisy per step)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)  # a killed bench never leaves half a PNG
    return path


def loss_curves(runs: Dict[str, List[Dict]], path: str, title: str) -> str:
    """Training loss (moving average) and validation loss of each run."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, recs in runs.items():
        its = [r["iteration"] for r in recs]
        a.plot(its, _smooth([r["loss"] for r in recs], max(1, len(recs) // 50)), label=label, lw=1)
        vals = [(r["iteration"], r["val_loss"]) for r in recs if "val_loss" in r]
        if vals:
            b.plot(*zip(*vals), marker="o", ms=3, label=label, lw=1)
    a.set(title=f"{title}: training loss (moving average)", xlabel="iteration", ylabel="loss")
    b.set(title=f"{title}: validation loss", xlabel="iteration", ylabel="loss")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def run_styles(labels: Sequence[str]) -> Dict[str, Dict]:
    """One colour per contender and one line style per seed, for labels ``"NAME sSEED"``: with
    more runs than the colour cycle has colours, two contenders would otherwise share one."""
    split = {label: (m.group(1), m.group(2)) if (m := re.fullmatch(r"(.*) s(\d+)", label))
             else (label, "") for label in labels}
    names = list(dict.fromkeys(n for n, _ in split.values()))
    seeds = list(dict.fromkeys(sd for _, sd in split.values()))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    dashes = ["-", "--", ":", "-."]
    return {label: {"color": cmap(names.index(n) % cmap.N), "linestyle": dashes[seeds.index(sd) % 4]}
            for label, (n, sd) in split.items()}


def val_vs_time(curves: Dict[str, List[List[float]]], path: str, title: str) -> str:
    """Validation loss against seconds of training steps, one line per run."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = run_styles(list(curves))
    for label, pts in curves.items():
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, lw=1, label=label, **styles[label])
    ax.set(title=f"{title}: validation loss against wall-clock", xlabel="seconds of training steps",
           ylabel="validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def val_diff(curves: Dict[str, List[List[float]]], path: str, title: str,
             target_pct: float = 1.0) -> str:
    """Validation loss of each run relative to its baseline, in percent, along the run."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in curves.items():
        if curve:
            ax.plot(*zip(*curve), marker="o", ms=3, label=label)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.axhline(target_pct, color="r", ls="--", lw=0.8, label=f"+{target_pct:g} % target")
    ax.set(title=title, xlabel="iteration", ylabel="validation loss vs baseline (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def wire_per_step(runs: Dict[str, List[Dict]], path: str, title: str) -> str:
    """Counted bytes per rank per step: each run's total, and the tier split of tiered runs."""
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, recs in runs.items():
        its = [r["iteration"] for r in recs]
        ax.plot(its, [r["wire_bytes"] / 1e6 for r in recs], lw=1.2, label=f"{label} total")
        if any("wire_bytes_core" in r for r in recs):
            for tier, color in zip(("core", "dynamic", "stable"), TIER_COLORS):
                ax.plot(its, [r.get(f"wire_bytes_{tier}", 0) / 1e6 for r in recs], lw=0.6,
                        color=color, alpha=0.6, ls=":", label=f"{label} {tier}")
    ax.set(title=title, xlabel="iteration", ylabel="MB sent per rank per step", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def tier_map(records: List[Dict], path: str, title: str) -> str:
    """Heat map unit x iteration of each tier unit's tier (rows: units in bucket order)."""
    rows = [(r["iteration"], r["grpo_tier_map"]) for r in records if r.get("grpo_tier_map")]
    if not rows:
        raise ValueError("no grpo_tier_map in these records: not a GRPO run")
    units = len(rows[0][1])
    grid = [[TIER_CODES.get(m[u], 1) for _, m in rows] for u in range(units)]
    fig, ax = plt.subplots(figsize=(9, max(2.5, units * 0.12)))
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(TIER_COLORS),
              vmin=0, vmax=2, extent=[rows[0][0], rows[-1][0], units - 0.5, -0.5])
    ax.set(title=f"{title} (red core, blue dynamic, green stable)", xlabel="iteration",
           ylabel="tier unit")
    return _save(fig, path)


def step_breakdown(summaries: Dict[str, Dict], path: str, title: str) -> str:
    """Median step time of each run (steady window) split into forward+backward (with gradient
    communication) and the optimizer step (with the parameter all-gather)."""
    labels = list(summaries)
    fb = [1e3 * (summaries[k].get("steady_fwd_bwd_time_s") or 0.0) for k in labels]
    opt = [1e3 * (summaries[k].get("steady_optimizer_time_s") or 0.0) for k in labels]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(labels)), 4))
    ax.bar(labels, fb, label="forward + backward (+ grad reduce)")
    ax.bar(labels, opt, bottom=fb, label="optimizer (+ param gather)")
    ax.set(title=title, ylabel="median ms per step")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def memory_by_location(rows: Dict[str, Dict[str, float]], path: str, title: str) -> str:
    """Stacked bars of MB per location (host RSS, device, GRPO residuals, ...) per run."""
    labels = list(rows)
    locations = sorted({loc for r in rows.values() for loc in r})
    fig, ax = plt.subplots(figsize=(max(5, 1.5 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    for loc in locations:
        vals = [rows[k].get(loc, 0.0) for k in labels]
        ax.bar(labels, vals, bottom=bottom, label=loc)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(title=title, ylabel="MB per rank")
    ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def ratio_bars(values: Dict[str, float], path: str, title: str, ylabel: str,
               reference: float = 1.0) -> str:
    """One bar per contender (e.g. step time or bytes relative to the baseline)."""
    labels = list(values)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(labels)), 4))
    ax.bar(labels, [values[k] for k in labels], color="#1f77b4")
    ax.axhline(reference, color="k", lw=0.8)
    ax.set(title=title, ylabel=ylabel)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def bytes_vs_quality(points: Dict[str, tuple], path: str, title: str,
                     bytes_goal: float = 0.15, val_goal_pct: float = 1.0,
                     ylabel: str = "validation loss vs baseline (%)") -> str:
    """Each contender at (bytes relative to the baseline, loss vs baseline in %)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (x, y) in points.items():
        if x is None or y is None:
            continue
        ax.scatter([x], [y], s=30)
        ax.annotate(label, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.axvline(bytes_goal, color="g", ls="--", lw=0.8, label=f"{bytes_goal}x bytes goal")
    ax.axhline(val_goal_pct, color="r", ls="--", lw=0.8, label=f"+{val_goal_pct:g} % quality goal")
    ax.set(title=title, xlabel="bytes per step after warm-up / baseline",
           ylabel=ylabel, xscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)
