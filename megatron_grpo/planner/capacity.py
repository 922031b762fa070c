"""The largest model a node holds: the planner's per-rank peak, searched over the layer count.

A Megatron user sizing a job asks "how many layers of this width fit on these GPUs, with and
without GRPO's memory tier?". The answer keeps every other setting of the config (hidden size,
heads, sequence, micro-batch, parallel layout, GRPO and offload flags) and grows only
``num_layers``: the peak per rank is then monotone in the layer count, so the largest fit is a
plain search. What the planner does not model -- the runtime (CUDA context and NCCL buffers on a
GPU, the Python process on CPU) and anything else a job holds outside model state and
activations -- is the caller's ``reserve_bytes``; ``python -m megatron_grpo.bench memcap``
measures it and holds the prediction against the largest model that really trains under a
memory cap. Beside them, megatron-core's own memory options (CPU optimizer offload,
Megatron-FSDP: ``megatron_grpo/planner/peers.py``, predictions with their formulas) are searched
the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_grpo.planner.peers import PEERS, peer_memory
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec, plan, stage_param_numels

WHICH = ("baseline", "grpo", *PEERS)
"""Which memory a search sizes: megatron's baseline (DistributedOptimizer), GRPO with the
offload given, or one of megatron-core's own memory options (planner/peers.py)."""


@dataclass
class Capacity:
    """The largest layer count that fits one rank's budget, and what it holds."""

    which: str
    """One of ``WHICH``: "baseline", "grpo" (with the OffloadConfig the search was given) or a
    megatron-core memory option (a prediction: planner/peers.py)."""
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
    if which in PEERS:
        return reserve_bytes + peer_memory(model, cluster, grpo, which, bucket_size).total
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


PEER_LABELS = {"megatron-cpu-offload": "optimizer_cpu_offload",
               "megatron-fsdp": "Megatron-FSDP"}
"""How --largest-model names megatron-core's options: the setting a user turns on."""


def format_capacity(caps, budget_gb: float, reserve_gb: float) -> str:
    """Lines for launch/plan.py --largest-model: baseline and GRPO, then megatron-core's own
    memory options (predictions) when searched, each with its ratio to the baseline."""
    lines = [f"largest model per rank under {budget_gb:g} GB ({reserve_gb:g} GB reserved for the "
             f"runtime), other settings as given:"]
    ours = [c for c in caps if c.which not in PEERS]
    peers = [c for c in caps if c.which in PEERS]
    base = next((c for c in caps if c.which == "baseline" and c.params), None)

    def row(c, label: str, width: int) -> str:
        if not c.layers:
            return (f"  {label:{width}s} not even one layer fits (one layer: "
                    f"{c.next_peak_bytes / 1e9:.2f} GB)")
        # Our rows keep their own ratio line below (the format users and tests read).
        ratio = f", {c.params / base.params:.2f}x the baseline" if base and c.which in PEERS else ""
        return (f"  {label:{width}s} {c.layers:5d} layers  {c.params / 1e9:8.3f} B parameters  "
                f"peak {c.peak_bytes / 1e9:.2f} GB (one layer more: "
                f"{c.next_peak_bytes / 1e9:.2f} GB){ratio}")

    lines += [row(c, c.which, 9) for c in ours]
    grpo = next((c for c in ours if c.which == "grpo"), None)
    if base and grpo:
        lines.append(f"  ratio     {grpo.params / base.params:.2f}x the baseline's parameters")
    if peers:
        lines.append("megatron-core's own memory options, predicted (formulas: "
                     "megatron_grpo/planner/peers.py; not checked against a run):")
        width = max(len(PEER_LABELS[c.which]) for c in peers)
        lines += [row(c, PEER_LABELS[c.which], width) for c in peers]
    return "\n".join(lines)
