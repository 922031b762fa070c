"""Compressed collectives of the dynamic tier, with the semantics of megatron's exact ones.

* ``CompressedReduceScatter``: reduce-scatter of a bucket's gradient. Each rank compresses its
  (already 1/dp-scaled) gradient plus error-feedback residual as dp equal shards, all at once
  on the ``[dp, shard]`` view (a constant number of kernels whatever dp is: the hot path runs
  inside the autograd hook, and a Python loop over dp ranks cost 260 ms per bucket at dp=512),
  exchanges the payloads with one ``all_to_all_single`` of uint8, and sums the dp payloads it
  receives for its own shard in fp32.
* ``compressed_param_gather``: the all-gather of updated parameters. The owner of a shard sends
  q = C(master - model_copy); every rank, the owner included, adds D(q) to its model copy of
  every shard. Every rank applies the same bytes, so all model copies stay bit-identical, and
  the difference to the exact master is re-sent next step (error feedback without a residual).

Both take an optional ``ReplicatedElements`` (tensor-parallel replicated parameters): those
elements go exactly, beside the payload (see megatron_grpo.comm.replicated). Both issue the
same collectives with the same sizes on every rank of the group, whatever the data: the sizes
depend only on the bucket layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_grpo.comm import fused_codec, streams
from megatron_grpo.comm.compress import Compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.comm.replicated import ReplicatedElements


def _used_on_current_stream(*tensors) -> None:
    """On GPU the buffers of a bucket's sync are allocated on GRPO's side stream (start_grad_sync
    runs there) but read on the main stream (wait(), the residual commit at end of step). Without
    telling the caching allocator, their memory could be handed to a new side-stream tensor while
    the main stream's kernels still read it (the rule: comm/streams.py)."""
    streams.used_on_current_stream(*tensors)


STATS_BLOCK_ELEMENTS = 1 << 22
"""Most elements of D(q) decoded at once when the new error-feedback residual is staged (and,
on a monitoring step, handed to the health sums from the same decode): 16 MiB of fp32; a block
holds whole shards, at least one. So neither ever holds a bucket-sized decoded copy (128 MB of
fp32 per 128 MB bucket, cached in the side stream's pool on GPU)."""


class InFlightReduceScatter:
    """What every in-flight dynamic-tier reduce-scatter shares: ``wait()`` waits for the payload
    exchange, lets the subclass write this rank's shard (``_finish``), then puts the
    exactly-reduced replicated elements back. Subclasses set ``work``, ``grad``, ``shard_out``,
    ``replicated``, ``exact``, ``exact_work``, ``order`` and ``done``.

    With an ``order`` (``streams.CommOrder``: GPU, GRPO's side stream) all of that is issued on
    the stream the exchange was issued on and the caller's stream waits on its "decoded"
    event; without one (CPU, or a caller with no side stream) it runs on the caller's stream,
    which first marks the buffers made on the issuing stream as used there."""

    work = exact_work = exact = replicated = order = None
    done = False

    def _side_stream_buffers(self) -> tuple:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        if self.done:
            return
        if self.order is not None:
            # The gradient buffer (megatron's, made on the main stream) is what the comm stream
            # writes; the buffers _side_stream_buffers names are its own allocations.
            self.order.finish(self._settle, self.grad, self.shard_out)
        else:
            _used_on_current_stream(*self._side_stream_buffers(), self.exact)
            self._settle()
        self.done = True

    def _settle(self) -> None:
        if self.work is not None:
            self.work.wait()  # NCCL: the current stream waits, the host does not; gloo: the host
        self._finish()
        if self.replicated is not None:
            if self.exact_work is not None:
                self.exact_work.wait()
            self.replicated.put(self.grad, self.exact)


class CompressedReduceScatter(InFlightReduceScatter):
    """One in-flight compressed reduce-scatter of one bucket; ``wait()`` finishes it (on the
    exchange's own stream when given an ``order``: the decode-and-sum never runs on the main
    stream).

    ``stats(applied, owed)``, when given, receives this rank's delivered values D(q) and what it
    owed (c = g + r), a block of shards at a time, before anything is sent (monitoring steps
    only).
    """

    def __init__(self, key, grad: torch.Tensor, shard_out: torch.Tensor, ef: ErrorFeedback,
                 compressor: Compressor, group, async_op: bool,
                 replicated: Optional[ReplicatedElements] = None,
                 stats: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
                 order: Optional[streams.CommOrder] = None) -> None:
        self.order = order
        self.dp = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.shard_len = grad.numel() // self.dp
        self.shard_out = shard_out
        self.compressor = compressor
        self.grad = grad
        self.replicated = replicated
        exact = replicated.take(grad) if replicated is not None else None
        # ef.owed, compress_rows and ef.stage (one fused kernel on CUDA where it fits). The new
        # residual is computed now, while grad still holds every shard's c: after the
        # exchange the megatron glue may free the bucket's gradient.
        self.send = fused_codec.compress_with_feedback(
            key, grad, self.dp, ef, compressor, rank,
            replicated.index if replicated is not None else None,
            stats=stats, block_elements=STATS_BLOCK_ELEMENTS)
        self.recv = torch.empty_like(self.send)
        self.work = dist.all_to_all_single(self.recv.view(-1), self.send.view(-1), group=group,
                                           async_op=async_op)
        self.exact = exact
        self.exact_work = (replicated.start_reduce(exact, group, async_op)
                           if replicated is not None else None)
        self.done = False
        if not async_op:
            self.wait()

    def _side_stream_buffers(self) -> tuple:
        return self.send, self.recv

    def _finish(self) -> None:
        # The local shard view held this rank's own gradient; it is replaced by the sum of what
        # every rank (this one included) delivered for it.
        fused_codec.sum_rows(self.compressor, self.recv, self.shard_len, out=self.shard_out)


@dataclass
class PreparedDelta:
    """This rank's quantised parameter update of one bucket, ready to gather: the compressed
    payload of (new master shard - current model copy) and the replicated elements' exact
    values. Kept instead of the fp32 master shard between the optimizer step and the gather
    (1/8 of its bytes with int4, 1/4 with int8)."""
    payload: torch.Tensor
    exact: Optional[torch.Tensor]


def prepare_param_delta(param_flat: torch.Tensor, staged_master: torch.Tensor, compressor: Compressor,
                        dp: int, rank: int, replicated: Optional[ReplicatedElements] = None) -> PreparedDelta:
    """Quantise this rank's update as soon as its shard is staged. The model copy's own row
    does not change before the gather (compressed buckets are written only by it), so the
    delta is the one the gather would compute."""
    shard_len = param_flat.numel() // dp
    rows = param_flat.view(dp, shard_len)
    if replicated is None:  # C(master - copy); one fused kernel on CUDA where it fits
        return PreparedDelta(fused_codec.compress_delta(compressor, staged_master, rows[rank]), None)
    delta = staged_master.to(torch.float32) - rows[rank].to(torch.float32)
    exact = replicated.split_update(delta, staged_master) if replicated is not None else None
    return PreparedDelta(compressor.compress_rows(delta.view(1, shard_len)), exact)


def gather_param_delta(param_flat: torch.Tensor, prepared: PreparedDelta, compressor: Compressor,
                       group, replicated: Optional[ReplicatedElements] = None) -> None:
    """Every rank's copy of ``param_flat`` gets every owner's quantised update."""
    dp = dist.get_world_size(group)
    shard_len = param_flat.numel() // dp
    rows = param_flat.view(dp, shard_len)
    payload, exact = prepared.payload, prepared.exact
    gathered = torch.empty((dp, payload.shape[1]), dtype=torch.uint8, device=payload.device)
    dist.all_gather_into_tensor(gathered.view(-1), payload.view(-1), group=group)
    if exact is not None:
        dist.all_reduce(exact, group=group)
    fused_codec.add_decoded(compressor, gathered, rows)  # rows += D(q) in rows' dtype
    if exact is not None:
        replicated.apply_values(param_flat, exact)


def compressed_param_gather(param_flat: torch.Tensor, staged_master: torch.Tensor,
                            compressor: Compressor, group,
                            replicated: Optional[ReplicatedElements] = None) -> None:
    """Update every rank's copy of ``param_flat`` (one bucket's param buffer) from the owners'
    exact master shards (``staged_master`` is this rank's shard, length param_flat/dp)."""
    prepared = prepare_param_delta(param_flat, staged_master, compressor, dist.get_world_size(group),
                                   dist.get_rank(group), replicated)
    gather_param_delta(param_flat, prepared, compressor, group, replicated)
