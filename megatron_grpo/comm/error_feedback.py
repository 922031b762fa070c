"""Error feedback of the dynamic tier, with residual updates that take effect only on a good step.

Each step a dynamic bucket sends q = C(g + r) and keeps r' = (g + r) - D(q), so over T steps the
receivers get sum D(q_t) = sum g_t - r_T (up to fp32 rounding): nothing is lost, only delayed.

Why the update is staged rather than applied at once: a step can be skipped after the
gradients were sent (a non-finite gradient anywhere in the replica, found by the optimizer).
On a skipped step nothing was applied, so the residual must stay what it was; writing r' in
place and undoing it later would need a second copy of every residual or fp32 round trips
that do not give back the same bits. So ``owed`` adds r into the gradient buffer (which becomes
c = g + r, the buffer megatron reduces anyway), the payloads are computed from it, and
``commit`` (after the optimizer step succeeded) writes r' = c - D(q) from the buffer and the
kept payload; ``discard`` keeps r. Between ``owed`` and ``commit`` nothing but the bucket's own
shard may change in the gradient buffer: the reduce-scatter overwrites that shard with the
reduced sum, so its c is kept aside (``stage(c_own=...)``, 1/dp of the bucket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional

import torch

from megatron_grpo.comm import streams


@dataclass
class _Staged:
    grad: torch.Tensor
    """The bucket's gradient buffer holding c = g + r (own shard overwritten later)."""
    c_own: torch.Tensor
    """c of this rank's own shard, kept before the reduce-scatter overwrote it."""
    payload: torch.Tensor
    """uint8 [dp, payload bytes]: what was sent for every shard."""
    rank: int
    compressor: object
    zero_index: Optional[torch.Tensor]
    """Elements sent exactly (replicated parameters): their residual stays 0."""


@dataclass
class _StagedResidual:
    residual: torch.Tensor
    """The new residual, computed by the compressor (becomes the residual on commit)."""
    zero_index: Optional[torch.Tensor]


class ErrorFeedback:
    """Per-bucket residuals of error feedback (keys: (unit, bucket index in its group)).

    Residuals live in a mapping: a dict by default, or the memory tier's OffloadedResiduals
    (``use_store``), which keeps them in host memory or on SSD between their read in ``owed``
    and their write in ``commit``; its ``release`` and ``buffer`` hooks are called when present."""

    def __init__(self) -> None:
        self._residuals = {}
        self._staged: Dict[Hashable, _Staged] = {}

    def use_store(self, store) -> None:
        """Keep residuals in ``store`` (a mapping with release/buffer, see above); the current
        ones move into it."""
        for key, value in list(self._residuals.items()):
            store[key] = value
        self._residuals = store

    # ------------------------------------------------------------------ one step
    def owed(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """Add the residual of ``key`` into ``grad`` in place (grad becomes c = g + r); returns it."""
        if not isinstance(grad, torch.Tensor) or grad.dim() != 1 or grad.dtype != torch.float32:
            raise ValueError(f"ErrorFeedback.owed: grad must be a 1-D torch.float32 tensor, got "
                             f"{getattr(grad, 'dtype', type(grad))} with shape "
                             f"{tuple(getattr(grad, 'shape', ()))}")
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.numel() != grad.numel():
                raise ValueError(f"ErrorFeedback.owed: residual for key {key!r} has {residual.numel()} "
                                 f"elements but grad has {grad.numel()}; drop(key) when a bucket changes")
            if residual.device != grad.device:  # loaded from a checkpoint onto the CPU
                residual = residual.to(grad.device)
                self._residuals[key] = residual
            grad.add_(residual)
            # On GPU this add is queued on GRPO's side stream, and an offloading store frees the
            # residual's memory right below; a residual it fetched on the main stream would go
            # back to the main stream's pool with the add still pending (comm/streams.py).
            streams.used_on_current_stream(residual)
            release = getattr(self._residuals, "release", None)
            if release is not None:  # read once per step; commit writes a new one
                release(key)
        return grad

    def stage(self, key: Hashable, grad: torch.Tensor, payload: torch.Tensor, rank: int,
              compressor, zero_index: Optional[torch.Tensor] = None) -> None:
        """Remember what ``commit`` needs to turn c (in ``grad``) into the new residual.
        Call right after compressing, before the reduce-scatter writes this rank's shard."""
        dp = payload.shape[0]
        shard = grad.numel() // dp
        c_own = grad[rank * shard:(rank + 1) * shard].clone()
        self._staged[key] = _Staged(grad, c_own, payload, rank, compressor, zero_index)

    def stage_residual(self, key: Hashable, residual: torch.Tensor,
                       zero_index: Optional[torch.Tensor] = None) -> None:
        """Stage the new residual itself, for compressors whose loss is not c - D(own payload)
        (PowerSGD: c - P_hat Q_i^T, known only after the first all-reduce)."""
        self._staged[key] = _StagedResidual(residual, zero_index)

    def commit(self) -> None:
        """The step was applied: every staged bucket's residual becomes c - D(q)."""
        for key, s in self._staged.items():
            if isinstance(s, _StagedResidual):
                if s.zero_index is not None and s.zero_index.numel():
                    s.residual.index_fill_(0, s.zero_index, 0.0)
                self._residuals[key] = s.residual
                continue
            dp = s.payload.shape[0]
            shard = s.grad.numel() // dp
            buffer = getattr(self._residuals, "buffer", None)
            residual = buffer(key, s.grad) if buffer is not None else self._residuals.get(key)
            if residual is None or residual.device != s.grad.device:
                residual = torch.empty_like(s.grad)
            residual.copy_(s.grad)
            rows = residual.view(dp, shard)
            rows[s.rank].copy_(s.c_own)
            rows.sub_(s.compressor.decompress_rows(s.payload, shard))
            if s.zero_index is not None and s.zero_index.numel():
                residual.index_fill_(0, s.zero_index, 0.0)
            self._residuals[key] = residual  # an offloading store sends it out now
        self._staged.clear()

    def discard(self) -> None:
        """The step was skipped: residuals stay as they were before it."""
        self._staged.clear()

    @property
    def pending(self) -> bool:
        return bool(self._staged)

    def references_grad(self, key: Hashable) -> bool:
        """Does the staged step of ``key`` still read the bucket's gradient buffer at commit?
        While it does, the megatron glue keeps that buffer (gradient release waits for the
        step's end instead of the sync's)."""
        return isinstance(self._staged.get(key), _Staged)

    # ------------------------------------------------------------------ bookkeeping
    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """The committed residual of ``key`` (None before its first commit)."""
        return self._residuals.get(key)

    def reset(self, key: Hashable) -> None:
        """Zero the residual of ``key``; keeps the buffer."""
        residual = self._residuals.get(key)
        if residual is not None:
            residual.zero_()
            self._residuals[key] = residual  # changed: an offloading store writes it again

    def drop(self, key: Hashable) -> None:
        """Free the residual of ``key`` (bucket left the dynamic tier); an offloading store
        forgets it without reading it back."""
        if key in self._residuals:
            del self._residuals[key]

    def keys(self) -> List[Hashable]:
        return list(self._residuals)

    def nbytes(self) -> int:
        """Memory held by the residuals, in bytes (resident ones only, with an offloading store)."""
        own = getattr(self._residuals, "nbytes", None)
        if own is not None:
            return own()
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def state_dict(self) -> Dict[str, Dict[Hashable, torch.Tensor]]:
        """Residuals copied to the CPU, for checkpoints (taken between steps: nothing staged)."""
        if self._staged:
            raise RuntimeError("ErrorFeedback.state_dict: a step is staged (commit or discard first)")
        return {"residuals": {k: r.detach().to("cpu", copy=True) for k, r in self._residuals.items()}}

    def load_state_dict(self, state: Dict[str, Dict[Hashable, torch.Tensor]]) -> None:
        """Replace all residuals; they stay on the CPU until the next ``owed`` moves them."""
        if not isinstance(state, dict) or "residuals" not in state:
            raise ValueError("ErrorFeedback.load_state_dict: state must be a dict from state_dict() "
                             "with key 'residuals'")
        self._residuals.clear()
        for k, v in state["residuals"].items():
            self._residuals[k] = v.detach().clone()
        self._staged.clear()
