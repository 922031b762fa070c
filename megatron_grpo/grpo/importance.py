"""Gradient importance model (GIM): per-parameter importance scores and their EMA.

Importance of one parameter tensor on one step is ``sum(|g| * |w|)`` over its elements: the
first-order estimate of how much the loss would move if the parameter were perturbed in
proportion to itself (|gradient| x parameter sensitivity). The score kept is an exponential
moving average of that number. ``--grpo-importance-score`` swaps in sum |g| or sum g^2
(diagonal empirical Fisher) for the ablation that compares them.

Where it is measured: the megatron glue calls ``observe`` when a DDP bucket becomes ready during
backward (in ``start_grad_sync``, before gradient scaling), with the bucket's local, unreduced
gradients. On GPU that runs on a side stream, so nothing here reads a value back to the host
(no ``.item()``, no Python branch on tensor contents): a host sync there would stall the
backward pass. The caller makes the main stream wait for that side stream before ``commit``.

How ranks agree: scores live in ONE flat fp32 tensor (parameters of bucket 0, then bucket 1,
...), so the glue can all-reduce it in place (or all-reduce a copy and hand the average to
``set_scores``) before each re-tier. Every rank then derives identical bucket densities and
therefore identical tiers; differing tiers would make the ranks issue mismatched collectives
and hang.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Sequence, Union

import torch

Device = Union[str, torch.device, None]
SCORES = ("grad-weight", "grad", "fisher")
"""Per-parameter scores (GRPOConfig.importance_score): sum |g|*|w|, sum |g|, sum g^2."""


class ImportanceTracker:
    """EMA of per-parameter ``sum(|g| * |w|)``, stored flat over all buckets.

    Args:
        num_buckets: number of DDP buckets (tier units).
        param_counts: number of parameter tensors in each bucket, in bucket order; the order of
            parameters inside a bucket is the caller's and must stay the same across calls.
        decay: EMA weight of the previous score, in [0, 1) (``GRPOConfig.importance_decay``).
        device: where the score tensors live; put them with the gradients so ``observe``
            copies nothing across devices.
    """

    def __init__(self, num_buckets: int, param_counts: Sequence[int], decay: float,
                 device: Device = None, score: str = "grad-weight") -> None:
        num_buckets = operator.index(num_buckets)
        if num_buckets < 0:
            raise ValueError(f"num_buckets must be >= 0, got {num_buckets}")
        counts = [operator.index(c) for c in param_counts]
        if len(counts) != num_buckets:
            raise ValueError(f"param_counts must have one entry per bucket (num_buckets="
                             f"{num_buckets}), got {len(counts)} entries")
        if any(c < 0 for c in counts):
            raise ValueError(f"param_counts entries must be >= 0, got {counts}")
        if not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        self.score = score
        self.num_buckets = num_buckets
        self.param_counts: List[int] = counts
        self.decay = float(decay)
        self.offsets: List[int] = [0]
        for c in counts:
            self.offsets.append(self.offsets[-1] + c)
        self.num_params = self.offsets[-1]
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._scores = torch.zeros(self.num_params, dtype=torch.float32, device=self.device)
        # Per parameter, not per bucket: a first measurement that was non-finite (fp16 overflow)
        # must not count as the EMA's start, and deciding that per bucket would need a host sync.
        self._initialized = torch.zeros(self.num_params, dtype=torch.bool, device=self.device)
        self._pending = torch.zeros(self.num_params, dtype=torch.float32, device=self.device)
        self._pending_buckets: set = set()
        self.bucket_observations: List[int] = [0] * num_buckets
        self.observations = 0
        """Number of ``commit`` calls that folded at least one bucket (the step counter)."""

    # ------------------------------------------------------------------ measuring
    def bucket_slice(self, bucket: int) -> slice:
        """The range of ``bucket``'s parameters in the flat score tensor."""
        bucket = operator.index(bucket)
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket must be in [0, {self.num_buckets}), got {bucket}")
        return slice(self.offsets[bucket], self.offsets[bucket + 1])

    def observe(self, bucket: int, grads: Sequence[torch.Tensor],
                weights: Sequence[torch.Tensor]) -> None:
        """Measure ``sum(|g| * |w|)`` for each parameter of ``bucket`` into the pending slot.

        ``grads[i]`` and ``weights[i]`` belong to the i-th parameter of the bucket. Observing the
        same bucket twice before ``commit`` keeps the later measurement (one per step).
        """
        sl = self.bucket_slice(bucket)
        n = sl.stop - sl.start
        if len(grads) != n:
            raise ValueError(f"grads must hold the {n} parameters of bucket {bucket}, "
                             f"got {len(grads)}")
        if len(weights) != n:
            raise ValueError(f"weights must hold the {n} parameters of bucket {bucket}, "
                             f"got {len(weights)}")
        values = []
        for i, (g, w) in enumerate(zip(grads, weights)):
            if g.numel() != w.numel():
                raise ValueError(f"grads[{i}] has {g.numel()} elements but weights[{i}] has "
                                 f"{w.numel()} (bucket {bucket})")
            if g.shape != w.shape:
                g, w = g.reshape(-1), w.reshape(-1)
            values.append(self._measure(g, w))
        if values:
            # One stacked copy instead of n scalar writes; stays on the device, no host sync.
            self._pending[sl].copy_(torch.stack(values), non_blocking=True)
        self._pending_buckets.add(operator.index(bucket))

    def _measure(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Norms are single reduction kernels accumulated in fp32 even for bf16 inputs.
        if self.score == "grad":
            return torch.linalg.vector_norm(g, ord=1, dtype=torch.float32)
        if self.score == "fisher":
            return torch.linalg.vector_norm(g, ord=2, dtype=torch.float32).square()
        # |g|*|w| == |g*w|: one product temporary per parameter.
        return torch.linalg.vector_norm(g * w, ord=1, dtype=torch.float32)

    def commit(self) -> None:
        """Fold this step's measurements into the EMA and clear them.

        A parameter's first finite measurement becomes its score as-is (no bias toward the zero
        the EMA starts from); later ones give ``decay * old + (1 - decay) * new``. A non-finite
        measurement (inf/NaN gradient on an overflowed fp16 step) leaves the score unchanged.
        Buckets not observed this step keep their score: a frozen stable bucket has no gradient
        to measure, and decaying it toward zero would read as "unimportant" when it is unknown.
        """
        if not self._pending_buckets:
            return
        buckets = sorted(self._pending_buckets)
        if len(buckets) == self.num_buckets:
            slices = [slice(0, self.num_params)]  # the common case: one fused update
        else:
            slices = [self.bucket_slice(b) for b in buckets]
        for sl in slices:
            old, new, init = self._scores[sl], self._pending[sl], self._initialized[sl]
            ema = old * self.decay + new * (1.0 - self.decay)
            finite = torch.isfinite(new)
            old.copy_(torch.where(finite, torch.where(init, ema, new), old))
            init.logical_or_(finite)
            new.zero_()
        for b in buckets:
            self.bucket_observations[b] += 1
        self._pending_buckets.clear()
        self.observations += 1

    def discard(self) -> None:
        """Drop this step's measurements without folding them (e.g. the step was skipped)."""
        for b in self._pending_buckets:
            self._pending[self.bucket_slice(b)].zero_()
        self._pending_buckets.clear()

    # ------------------------------------------------------------------ agreement across ranks
    def scores_tensor(self) -> torch.Tensor:
        """The live flat fp32 score tensor; all-reducing it in place updates the tracker."""
        return self._scores

    def set_scores(self, tensor: torch.Tensor) -> None:
        """Replace the scores, e.g. with their average over data-parallel ranks."""
        if tensor.dim() != 1 or tensor.numel() != self.num_params:
            raise ValueError(f"tensor must be 1-D with {self.num_params} elements (one per "
                             f"parameter), got shape {tuple(tensor.shape)}")
        if tensor.data_ptr() != self._scores.data_ptr():
            self._scores.copy_(tensor)

    # ------------------------------------------------------------------ per bucket
    def bucket_scores(self) -> torch.Tensor:
        """Sum of the parameter scores of each bucket (1-D, ``num_buckets``, float64).

        Sums run per slice rather than with ``index_add_``: CUDA's atomic adds would make the
        result depend on scheduling, and tiers are decided from it independently on every rank.
        float64 keeps large buckets' sums from rounding differently from small ones.
        """
        if self.num_buckets == 0:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.stack([self._scores[self.bucket_slice(b)].sum(dtype=torch.float64)
                            for b in range(self.num_buckets)])

    def bucket_density(self, bucket_numels: Sequence[int]) -> torch.Tensor:
        """Bucket score per gradient element (float64); an empty bucket has density 0.

        Density, not the raw sum, is what tiers are ranked by: buckets differ in size, and a big
        bucket should not look important just for holding more elements.
        """
        numels = [operator.index(x) for x in bucket_numels]
        if len(numels) != self.num_buckets:
            raise ValueError(f"bucket_numels must have one entry per bucket ({self.num_buckets}),"
                             f" got {len(numels)}")
        if any(x < 0 for x in numels):
            raise ValueError(f"bucket_numels entries must be >= 0, got {numels}")
        sizes = torch.tensor(numels, dtype=torch.float64, device=self.device)
        scores = self.bucket_scores()
        return torch.where(sizes > 0, scores / sizes.clamp(min=1.0), torch.zeros_like(scores))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict:
        """Scores and counters (on CPU). Pending measurements are not saved: checkpoints are
        taken between steps, when nothing is pending."""
        return {
            "param_counts": list(self.param_counts),
            "decay": self.decay,
            "scores": self._scores.detach().cpu().clone(),
            "initialized": self._initialized.detach().cpu().clone(),
            "bucket_observations": list(self.bucket_observations),
            "observations": self.observations,
        }

    def load_state_dict(self, state_dict: Dict) -> None:
        """Restore from ``state_dict()``. The bucket layout must match; ``decay`` stays this
        tracker's own, so a resumed run may change ``--grpo-importance-decay``."""
        counts = list(state_dict["param_counts"])
        if counts != self.param_counts:
            raise ValueError(f"state_dict['param_counts'] {counts} does not match this tracker's "
                             f"bucket layout {self.param_counts}")
        self._scores.copy_(state_dict["scores"])
        self._initialized.copy_(state_dict["initialized"])
        self.bucket_observations = [int(x) for x in state_dict["bucket_observations"]]
        self.observations = int(state_dict["observations"])
        self.discard()
