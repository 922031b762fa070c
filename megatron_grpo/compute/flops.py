"""What a step computes, counted from the shapes the linear layers see and the rows they keep.

Megatron counts each GEMM three times: the forward, the weight gradient and the data gradient,
2 m n k floating-point operations each. The sampled backward shrinks the last two by the rows it
keeps; the forward never changes. GEMMs outside linear layers (attention's scores and their
weighted sum) are exact and counted from the model's shape by the caller (``attention``).
"""

from __future__ import annotations

from typing import Dict

from megatron_grpo.grpo.config import TIERS

PARTS = ("fwd", "wgrad", "dgrad")


class FlopCount:
    """Floating-point operations of one step, by tier and part, done and exact (every row)."""

    def __init__(self) -> None:
        self.other = 0
        """Exact GEMM work per step outside the linear layers (attention), forward + backward:
        set once from the model's shape (``attention_flops``)."""
        self.reset()

    def reset(self) -> None:
        self.done = {t: dict.fromkeys(PARTS, 0) for t in TIERS}
        self.exact = {t: dict.fromkeys(PARTS, 0) for t in TIERS}

    def linear(self, tier: str, rows: int, fan_in: int, fan_out: int, wgrad_rows: int,
               dgrad_rows: int, wgrad: bool = True) -> None:
        """One linear layer's call over ``rows`` token rows: the forward, then a weight gradient
        over ``wgrad_rows`` rows (none when ``wgrad`` is False: a frozen weight) and a data
        gradient over ``dgrad_rows``."""
        per_row = 2 * fan_in * fan_out
        self.done[tier]["fwd"] += per_row * rows
        self.exact[tier]["fwd"] += per_row * rows
        self.done[tier]["wgrad"] += per_row * wgrad_rows if wgrad else 0
        self.exact[tier]["wgrad"] += per_row * rows
        self.done[tier]["dgrad"] += per_row * dgrad_rows
        self.exact[tier]["dgrad"] += per_row * rows

    def metrics(self) -> Dict[str, float]:
        """flops_<tier>_<part> done, flops_step and flops_exact_step (both with the attention
        work), and flops_ratio = done / exact (1.0: nothing saved)."""
        out: Dict[str, float] = {}
        for t in TIERS:
            for part in PARTS:
                if self.exact[t][part]:
                    out[f"flops_{t}_{part}"] = float(self.done[t][part])
        done = sum(sum(v.values()) for v in self.done.values()) + self.other
        exact = sum(sum(v.values()) for v in self.exact.values()) + self.other
        out["flops_step"] = float(done)
        out["flops_exact_step"] = float(exact)
        out["flops_ratio"] = done / exact if exact else 1.0
        return out


def attention_flops(layers: int, tokens: int, seq: int, hidden: int) -> int:
    """Scores (Q K^T) and their weighted sum (A V) over ``tokens`` rows of sequences of length
    ``seq``: 2 GEMMs of 2 tokens seq hidden each in the forward, twice that in the backward (no
    causal halving: megatron's reference count does not halve either)."""
    return 3 * layers * 2 * (2 * tokens * seq * hidden)
