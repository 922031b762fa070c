"""The sampled-gradient estimator of one linear layer (VCAS-style, Wang et al., ICLR 2024).

A linear layer y = x W^T over N token rows has the weight gradient G = sum_i dy_i^T x_i, a sum of
N rank-one terms with Frobenius norms a_i = |dy_i| |x_i| (the row's *leverage*). Keeping row i with
probability p_i, independently, and scaling it by 1/p_i gives an unbiased estimate of G whose
added variance is exactly

    V(p) = sum_i (1/p_i - 1) a_i^2,

computable from the two row norms alone, without the full GEMM. For a fixed expected number of
rows, p_i = min(1, c a_i) minimises V (the rows that carry most of the gradient are always kept).

The variance budget compares V with the minibatch's own gradient variance, whose estimate from
the same rows is sum_i a_i^2 (the per-token terms are far noisier than their mean in language
modelling, so the cross terms are negligible): a budget tau keeps the fewest rows for which
V <= tau * sum_i a_i^2, i.e. sampling adds at most the noise of a batch 1/(1+tau) the size.

The data gradient dx_i = dy_i W is sampled the same way with a_i = |dy_i| (its rows are
independent outputs, so a kept row is exact and a dropped one is zero); layers below then see
zero rows, which their own leverage never keeps.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

def row_norms_sq(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each row of a [rows, features] tensor, in fp32 (bf16 sums of
    thousands of squares lose the small rows the estimator's variance depends on)."""
    return t.float().pow(2).sum(dim=1)


def _sorted_sums(a: torch.Tensor):
    """The non-zero a_i in descending order with their suffix sums S_k = sum_{i>=k} a_i and
    Q_k = sum_{i>=k} a_i^2 (k clipped rows: the k largest kept with probability 1)."""
    a = a.float()
    desc = torch.sort(a[a > 0], descending=True).values
    s = torch.flip(torch.cumsum(torch.flip(desc, [0]), 0), [0])
    q = torch.flip(torch.cumsum(torch.flip(desc.pow(2), [0]), 0), [0])
    return desc, s, q


def _consistent(desc: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """For each k, whether scale c_k clips exactly the k largest rows: c_k a_k <= 1 (row k is
    below the clip) and c_k a_{k-1} >= 1 (row k-1 is at it)."""
    below = c * desc <= 1.0
    above = torch.ones_like(below)
    above[1:] = c[1:] * desc[:-1] >= 1.0
    return below & above


def probabilities(a: torch.Tensor, keep: float) -> torch.Tensor:
    """Inclusion probabilities p_i = min(1, c a_i) with sum_i p_i = keep * N, the variance-optimal
    ones for that expected row count. Rows with a_i = 0 get 0 (they add nothing to the sum);
    ``keep`` at or above the share of non-zero rows keeps every non-zero row. Closed form: with
    the k largest rows clipped at 1, c = (keep N - k) / S_k; the consistent k is the one."""
    a = a.float()
    target = keep * a.numel()
    desc, s, _ = _sorted_sums(a)
    if desc.numel() == 0:
        return torch.zeros_like(a)
    if target >= desc.numel():
        return (a > 0).to(a.dtype)
    k = torch.arange(desc.numel(), device=a.device, dtype=a.dtype)
    c = (target - k).clamp(min=0) / s
    ok = _consistent(desc, c) & (target - k > 0)
    first = int(torch.nonzero(ok)[0]) if bool(ok.any()) else 0
    return torch.clamp(c[first] * a, max=1.0)


def added_variance(a: torch.Tensor, p: torch.Tensor) -> float:
    """V(p) = sum (1/p_i - 1) a_i^2; a row with a_i > 0 and p_i = 0 makes the estimate biased,
    which no variance covers: refused."""
    a, p = a.float(), p.float()
    live = p > 0
    if bool((a[~live] > 0).any()):
        raise ValueError("a row with non-zero leverage has probability 0: the estimate is biased")
    return float(((1.0 / p[live] - 1.0) * a[live].pow(2)).sum())


def keep_for_budget(a: torch.Tensor, budget: float) -> float:
    """The smallest keep ratio whose optimal probabilities add at most ``budget`` * sum a_i^2 of
    variance (callers clamp it to their floor and ceiling). Closed form: with the k largest rows
    clipped, V = S_k / c - Q_k, so the least scale is c_k = S_k / (budget Q_0 + Q_k) and the
    expected row count k + c_k S_k; the consistent k gives the answer. 0 rows: 0."""
    a = a.float()
    desc, s, q = _sorted_sums(a)
    if desc.numel() == 0:
        return 0.0
    k = torch.arange(desc.numel(), device=a.device, dtype=torch.float32)
    c = s / (budget * q[0] + q)
    ok = _consistent(desc, c)
    count = k + c * s
    best = float(count[ok].min()) if bool(ok.any()) else float(desc.numel())
    return min(1.0, best / a.numel())


def draw(p: torch.Tensor, generator: Optional[torch.Generator]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Independent Bernoulli(p_i) draws: (indices of the kept rows, their weights 1/p_i).
    The same generator state gives the same rows on every rank that calls it (tensor-parallel
    ranks sample identical rows from identical probabilities)."""
    u = torch.rand(p.shape, generator=generator, device=p.device, dtype=torch.float32)
    kept = torch.nonzero(u < p, as_tuple=False).squeeze(1)
    return kept, 1.0 / p.index_select(0, kept)


def uniform_probabilities(a: torch.Tensor, keep: float) -> torch.Tensor:
    """The ablation: every row with the same probability ``keep`` (importance ignored)."""
    return torch.full_like(a.float(), min(1.0, max(keep, 0.0)))
