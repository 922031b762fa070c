"""PowerSGD-style rank-r compression of a dynamic bucket's reduce-scatter, with error feedback.

A peer for the evidence suite (``--grpo-compressor powersgd``), after Vogels et al. 2019 and
torch's PowerSGD DDP hook: every parameter of two or more dimensions in the bucket is a matrix
M (rows = dim 0, cols = the rest) whose owed gradient c = g + r gets one power-iteration step
towards a rank-r approximation of the *sum* over the data-parallel group:

    P = M Q            all_reduce(P)  -> P_hat = orthonormal(sum P)
    Q_i = M^T P_hat    all_reduce(Q)  -> Q = sum Q_i
    approx = P_hat Q^T = P_hat P_hat^T sum_i M_i

Each rank keeps r' = M_i - P_hat Q_i^T (what its own contribution lost) and writes its shard of
the reduced bucket. One-dimensional parameters (norms, biases) are all-reduced exactly, inside
the P all-reduce. Q is warm-started from the previous applied step; the first Q comes from a
generator seeded by the bucket key, the same on every rank. Sizes depend only on the bucket's
parameter shapes, so every rank issues the same collectives whatever its data.

The parameter all-gather of a PowerSGD bucket uses the int4 quantiser (PowerSGD compresses
gradients only).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_grpo.comm.dynamic import InFlightReduceScatter
from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.comm.replicated import ReplicatedElements, bucket_ranges
from megatron_grpo.comm.streams import CommOrder


@dataclass
class BucketLayout:
    """Where a bucket's matrices and exactly-sent elements lie in its flat gradient."""

    matrices: List[Tuple[int, int, int]]
    """(start, rows, cols) of every parameter with two or more dimensions."""
    exact_index: torch.Tensor
    """int64 flat indices of the elements of 1-D parameters (sent exactly)."""
    numel: int
    """Elements of the bucket (padding included)."""

    @classmethod
    def for_bucket(cls, bucket, device) -> "BucketLayout":
        mats, exact = [], []
        for param, (start, end) in sorted(bucket_ranges(bucket).items(), key=lambda kv: kv[1]):
            if param.dim() >= 2:
                mats.append((start, param.shape[0], param.numel() // param.shape[0]))
            else:
                exact.append(torch.arange(start, end, dtype=torch.int64))
        index = torch.cat(exact) if exact else torch.zeros(0, dtype=torch.int64)
        return cls(mats, index.to(device), bucket.grad_data.numel())

    def ranks(self, rank: int) -> List[int]:
        return [min(rank, rows, cols) for _, rows, cols in self.matrices]

    def wire_elements(self, rank: int) -> Tuple[int, int]:
        """fp32 elements of the two all-reduces: (P factors + exact elements, Q factors)."""
        rs = self.ranks(rank)
        p = sum(rows * r for (_, rows, _), r in zip(self.matrices, rs)) + self.exact_index.numel()
        return p, sum(cols * r for (_, _, cols), r in zip(self.matrices, rs))


class PowerSGDState:
    """Warm-start Q factors per bucket key (identical on every rank of the bucket's group)."""

    def __init__(self, rank: int, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"--grpo-powersgd-rank must be >= 1, got {rank}")
        self.rank = rank
        self.seed = seed
        self._q: Dict[Hashable, torch.Tensor] = {}
        self._pending: Dict[Hashable, torch.Tensor] = {}

    def q(self, key: Hashable, numel: int, device) -> torch.Tensor:
        """Flat Q factors of bucket ``key`` (all its matrices, concatenated)."""
        q = self._q.get(key)
        if q is None or q.numel() != numel:
            # Seeded from the key (crc32: stable across processes, unlike hash()), not a global
            # RNG: every rank draws the same Q and the training RNG streams are untouched.
            gen = torch.Generator(device="cpu").manual_seed(
                self.seed * 1_000_003 + zlib.crc32(repr(key).encode()))
            q = torch.randn(numel, generator=gen, dtype=torch.float32)
        return q.to(device)

    def stage(self, key: Hashable, q: torch.Tensor) -> None:
        """Next step's warm start, taken on ``commit`` (a skipped step leaves Q as it was, like
        the residuals, so a run with a skipped step continues as if the step never happened)."""
        self._pending[key] = q

    def commit(self) -> None:
        self._q.update(self._pending)
        self._pending.clear()

    def discard(self) -> None:
        self._pending.clear()

    def drop(self, key: Hashable) -> None:
        self._q.pop(key, None)

    def state_dict(self) -> Dict:
        if self._pending:
            raise RuntimeError("PowerSGDState.state_dict: a step is staged (commit or discard first)")
        return {"rank": self.rank, "q": {k: v.detach().to("cpu", copy=True) for k, v in self._q.items()}}

    def load_state_dict(self, state: Dict) -> None:
        self._q = {k: v.clone() for k, v in state.get("q", {}).items()}
        self._pending.clear()


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning p (reduced QR). Every rank holds the same all-reduced p, so
    every rank computes the same result."""
    return torch.linalg.qr(p, mode="reduced").Q


class PowerSGDReduceScatter(InFlightReduceScatter):
    """One in-flight PowerSGD reduce of one bucket; ``wait()`` finishes it (the Q all-reduce runs
    there, inside ``tag()`` so its bytes are attributed to the dynamic tier; with an ``order``,
    on the P all-reduce's stream, like the int4/int8 decode: InFlightReduceScatter)."""

    def __init__(self, key, grad: torch.Tensor, shard_out: torch.Tensor, ef: ErrorFeedback,
                 state: PowerSGDState, layout: BucketLayout, group, async_op: bool,
                 tag: Callable[[], ContextManager],
                 replicated: Optional[ReplicatedElements] = None,
                 stats: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
                 order: Optional[CommOrder] = None) -> None:
        if layout.numel != grad.numel():
            raise ValueError(f"PowerSGD: layout of bucket {key!r} has {layout.numel} elements, "
                             f"its gradient {grad.numel()}")
        self.key, self.grad, self.shard_out, self.ef, self.state = key, grad, shard_out, ef, state
        self.layout, self.group, self.tag = layout, group, tag
        self.replicated, self.stats, self.order = replicated, stats, order
        self.dp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.rs = layout.ranks(state.rank)
        self.exact = replicated.take(grad) if replicated is not None else None
        c = ef.owed(key, grad)
        p_len, q_len = layout.wire_elements(state.rank)
        self.q_in = state.q(key, q_len, grad.device)
        self.p = torch.empty(p_len, dtype=torch.float32, device=grad.device)
        po = qo = 0
        for (start, rows, cols), r in zip(layout.matrices, self.rs):
            m = c[start:start + rows * cols].view(rows, cols)
            torch.matmul(m, self.q_in[qo:qo + cols * r].view(cols, r),
                         out=self.p[po:po + rows * r].view(rows, r))
            po, qo = po + rows * r, qo + cols * r
        self.p[po:].copy_(c.index_select(0, layout.exact_index))
        self.work = dist.all_reduce(self.p, group=group, async_op=async_op)
        self.exact_work = (replicated.start_reduce(self.exact, group, async_op)
                           if replicated is not None else None)
        self.done = False
        if not async_op:
            self.wait()

    def _side_stream_buffers(self) -> tuple:
        return self.p, self.q_in  # made on the side stream (GPU)

    def _finish(self) -> None:
        c, layout = self.grad, self.layout
        applied = torch.zeros_like(c)   # this rank's own delivered values (monitoring, residual)
        reduced = torch.zeros_like(c)   # the group's sum, of which this rank keeps its shard
        q = torch.empty_like(self.q_in)
        hats, po, qo = [], 0, 0
        for (start, rows, cols), r in zip(layout.matrices, self.rs):
            p_hat = _orthonormal(self.p[po:po + rows * r].view(rows, r))
            m = c[start:start + rows * cols].view(rows, cols)
            q_i = q[qo:qo + cols * r].view(cols, r)
            torch.matmul(m.t(), p_hat, out=q_i)
            applied[start:start + rows * cols].view(rows, cols).copy_(p_hat @ q_i.t())
            hats.append(p_hat)
            po, qo = po + rows * r, qo + cols * r
        own_exact = c.index_select(0, layout.exact_index)
        applied.index_copy_(0, layout.exact_index, own_exact)
        if self.stats is not None:  # before the shard is overwritten: grad still holds c
            self.stats(applied, c)
        self.ef.stage_residual(self.key, c - applied,
                               self.replicated.index if self.replicated is not None else None)
        with self.tag():
            dist.all_reduce(q, group=self.group)
        self.state.stage(self.key, q)
        qo = 0
        for (start, rows, cols), r, p_hat in zip(layout.matrices, self.rs, hats):
            reduced[start:start + rows * cols].view(rows, cols).copy_(
                p_hat @ q[qo:qo + cols * r].view(cols, r).t())
            qo += cols * r
        reduced.index_copy_(0, layout.exact_index, self.p[po:])
        shard = c.numel() // self.dp
        self.shard_out.copy_(reduced[self.rank * shard:(self.rank + 1) * shard])
