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

Rows are drawn by systematic sampling (Madow's pi-ps design): one uniform offset u, the points
u, u+1, ..., u+K-1 laid over the cumulative probabilities, K = ceil(keep N) rows. Each row is
kept with exactly its p_i (an interval of length p_i <= 1 holds one point with probability p_i),
so the 1/p_i weights stay unbiased, and the count is K, known before the draw. Everything here
stays on the device: no ``nonzero``, ``item`` or data-dependent shape, so on a GPU the host never
waits for the backward's kernels (an index tensor whose length depends on the draw needs the
count on the host, a synchronisation per draw). Where the probabilities sum to less than K (fewer
non-zero rows than K) the rest of the points land on a phantom row past the end: those draws
take row N-1 with weight 0, computed and counted but adding nothing.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def row_norms_sq(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each row of a [rows, features] tensor, in fp32 (bf16 sums of
    thousands of squares lose the small rows the estimator's variance depends on)."""
    return t.float().pow(2).sum(dim=1)


def _sorted_sums(a: torch.Tensor):
    """All a_i in descending order (the zeros last) with their suffix sums S_k = sum_{i>=k} a_i
    and Q_k = sum_{i>=k} a_i^2 (k clipped rows: the k largest kept with probability 1). The
    zeros stay in (a fixed shape, no host synchronisation); where S_k = 0 no scale exists."""
    desc = torch.sort(a.float(), descending=True).values
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
    k = torch.arange(a.numel(), device=a.device, dtype=a.dtype)
    c = (target - k).clamp(min=0) / s
    ok = _consistent(desc, c) & (target - k > 0) & (s > 0)
    first = torch.argmax(ok.to(torch.uint8))  # the first consistent k (0 if none)
    scaled = torch.clamp(c.gather(0, first.view(1)) * a, max=1.0)
    every_live_row = (a > 0).to(a.dtype)
    return torch.where((a > 0).sum() <= target, every_live_row, scaled)


def added_variance(a: torch.Tensor, p: torch.Tensor) -> float:
    """V(p) = sum (1/p_i - 1) a_i^2; a row with a_i > 0 and p_i = 0 makes the estimate biased,
    which no variance covers: refused. (A report, not on the backward's path.)"""
    a, p = a.float(), p.float()
    live = p > 0
    if bool((a[~live] > 0).any()):
        raise ValueError("a row with non-zero leverage has probability 0: the estimate is biased")
    return float(((1.0 / p[live] - 1.0) * a[live].pow(2)).sum())


def keep_ratio_for_budget(a: torch.Tensor, budget: float) -> torch.Tensor:
    """The smallest keep ratio whose optimal probabilities add at most ``budget`` * sum a_i^2 of
    variance (callers clamp it to their floor and ceiling), as a 0-d tensor on ``a``'s device.
    Closed form: with the k largest rows clipped, V = S_k / c - Q_k, so the least scale is
    c_k = S_k / (budget Q_0 + Q_k) and the expected row count k + c_k S_k; the consistent k gives
    the answer. 0 rows: 0."""
    a = a.float()
    desc, s, q = _sorted_sums(a)
    k = torch.arange(a.numel(), device=a.device, dtype=torch.float32)
    c = s / (budget * q[0] + q)
    ok = _consistent(desc, c) & (s > 0)
    count = torch.where(ok, k + c * s, torch.full_like(k, float("inf"))).min()
    live = (a > 0).sum().to(torch.float32)
    best = torch.where(ok.any(), count, live)
    return (best / a.numel()).clamp(max=1.0)


def keep_for_budget(a: torch.Tensor, budget: float) -> float:
    """``keep_ratio_for_budget`` as a Python float (reports and tests; it synchronises)."""
    return float(keep_ratio_for_budget(a, budget))


def draw_count(rows: int, keep: float) -> int:
    """How many rows a draw at ``keep`` takes: ceil(keep N), at most N (known on the host)."""
    return min(rows, max(1, math.ceil(keep * rows - 1e-9)))


def draw(p: torch.Tensor, generator: Optional[torch.Generator],
         count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Systematic sampling of ``count`` rows with inclusion probabilities ``p`` (sum p <= count):
    (row indices, weights 1/p_i; 0 for a draw on the phantom row). The same generator state
    gives the same rows on every rank that calls it (tensor-parallel ranks sample identical
    rows from identical probabilities). See the module docstring."""
    n = p.numel()
    # In a random order: in the rows' own order the points would be periodic in it (keep 0.5 over
    # [sequence, batch] rows would take every token of one sequence and none of the other).
    order = torch.randperm(n, generator=generator, device=p.device)
    p = p.float()
    cum = torch.cumsum(p.index_select(0, order).double(), 0)  # fp64: points fall where they should
    u = torch.rand(1, generator=generator, device=p.device, dtype=torch.float64)
    points = u + torch.arange(count, device=p.device, dtype=torch.float64)
    at = torch.searchsorted(cum, points, right=True)  # the first position with cum > point
    real = at < n
    rows = order.index_select(0, at.clamp(max=n - 1))
    weights = torch.where(real, 1.0 / p.index_select(0, rows), torch.zeros((), device=p.device))
    return rows, weights


def uniform_probabilities(a: torch.Tensor, keep: float) -> torch.Tensor:
    """The ablation: every row with the same probability ``keep`` (importance ignored)."""
    return torch.full_like(a.float(), min(1.0, max(keep, 0.0)))
