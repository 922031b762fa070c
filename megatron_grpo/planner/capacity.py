"""The largest model a node holds: the planner's per-rank peak, searched over the layer count.

A Megatron user sizing a job asks "how many layers of this width fit on these GPUs, with and
without GRPO's memory tier?". The answer keeps every other setting of the config (hidden size,
heads, sequence, micro-batch, parallel layout, GRPO and offload flags) and grows only
``num_layers``: the peak per rank is then monotone in the layer count, so the largest fit is a
plain search. What the planner does not model -- the runtime (CUDA context and NCCL buffers on a
GPU, the Python process on CPU) and anything else a job holds outside model state and
activations -- is the caller's ``reserve_bytes``; ``python -m megatron_grpo.bench memcap``
measures it and holds the prediction against the largest model that really trains under a
memory cap.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_grpo.planner.plan import ClusterSpec, ModelSpec, plan, stage_param_numels

WHICH = ("baseline", "grpo")
"""Which side of the plan a search sizes: megatron's baseline, or GRPO with the offload given."""


@dataclass
class Capacity:
    """The largest layer count that fits one rank's budget, and what it holds."""

    which: str
    """"baseline" or "grpo" (with the OffloadConfig the search was given)."""
    layers: int
    """Largest num_layers whose predicted peak fits; 0 when not even one layer fits."""
    params: int
    """Parameters of the whole model at that layer count (all TP and PP ranks)."""
    peak_bytes: int
    """Predicted peak per rank at that layer count, reserve included (0 when layers is 0)."""
    next_peak_bytes: int
    """Predicted peak per rank with one layer more: what did not fit."""
    budget_bytes: int
    """The per-rank budget searched against."""


def model_params(model: ModelSpec, cluster: ClusterSpec) -> int:
    """Parameters of the whole model (every TP and PP rank's share added up, unpadded)."""
    one = dataclasses.replace(cluster, tp=1, pp=1)
    return sum(stage_param_numels(model, one, 0))


def rank_peak_bytes(model: ModelSpec, cluster: ClusterSpec, grpo, which: str,
                    reserve_bytes: int = 0, bucket_size: Optional[int] = None,
                    offload=None) -> int:
    """The planner's peak per rank (model state and activations of the stage with the most)
    plus ``reserve_bytes``."""
    if which not in WHICH:
        raise ValueError(f"which must be one of {', '.join(WHICH)}, got {which!r}")
    p = plan(model, cluster, grpo, bucket_size=bucket_size,
             offload=offload if which == "grpo" else None)
    # Each side's own busiest stage (with pp > 1 GRPO's and the baseline's may differ).
    return reserve_bytes + (p.baseline_peak if which == "baseline" else p.grpo_memory.total)


def largest_model(model: ModelSpec, cluster: ClusterSpec, grpo, budget_bytes: int,
                  which: str, reserve_bytes: int = 0, bucket_size: Optional[int] = None,
                  offload=None, max_layers: int = 4096) -> Capacity:
    """The largest ``num_layers`` (a multiple of the pipeline size, the rest of ``model`` kept)
    whose predicted peak per rank is at most ``budget_bytes``."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    step = cluster.pp  # megatron splits layers evenly over the pipeline stages

    def peak(layers: int) -> int:
        return rank_peak_bytes(dataclasses.replace(model, num_layers=layers), cluster, grpo,
                               which, reserve_bytes, bucket_size, offload)

    # Exponential then binary search over multiples of the pipeline size: the peak grows with
    # every layer (each adds parameters, gradients, optimizer state and activations).
    lo, hi = 0, step
    while hi <= max_layers and peak(hi) <= budget_bytes:
        lo, hi = hi, hi * 2
    hi = min(hi, max_layers + step)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if peak(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return Capacity(which, 0, 0, 0, peak(step), budget_bytes)
    sized = dataclasses.replace(model, num_layers=lo)
    return Capacity(which, lo, model_params(sized, cluster), peak(lo), peak(lo + step), budget_bytes)


def format_capacity(caps, budget_gb: float, reserve_gb: float) -> str:
    """Lines for launch/plan.py --largest-model."""
    lines = [f"largest model per rank under {budget_gb:g} GB ({reserve_gb:g} GB reserved for the "
             f"runtime), other settings as given:"]
    for c in caps:
        if not c.layers:
            lines.append(f"  {c.which:9s} not even one layer fits (one layer: "
                         f"{c.next_peak_bytes / 1e9:.2f} GB)")
            continue
        lines.append(f"  {c.which:9s} {c.layers:5d} layers  {c.params / 1e9:8.3f} B parameters  "
                     f"peak {c.peak_bytes / 1e9:.2f} GB (one layer more: "
                     f"{c.next_peak_bytes / 1e9:.2f} GB)")
    if len(caps) == 2 and caps[0].params:
        lines.append(f"  ratio     {caps[1].params / caps[0].params:.2f}x the baseline's parameters")
    return "\n".join(lines)
