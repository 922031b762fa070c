"""The compressed inter-instance all-reduce of megatron's partial distributed optimizer.

With ``num_distributed_optimizer_instances = I > 1`` megatron reduce-scatters a bucket's
gradient inside an instance (one node: the fast link) and then all-reduces each rank's shard
across the I instances (the slow link), over the group of ranks that hold the same shard index
in every instance. GRPO leaves the first collective exact and compresses only the second, for
the tiers that compress (dynamic; core with --grpo-core-compressor). ``InterInstanceAllReduce``
is that second collective, as a compressed reduce-scatter followed by a compressed all-gather,
so each rank sends 2 (I-1)/I of its shard in compressed form whatever I is (an all-gather of
whole compressed shards would send I-1 of them):

1. every member adds its error-feedback residual to its shard (c = g + r), compresses it as I
   equal rows and sends row j to member j (one ``all_to_all_single``);
2. member j sums the I decoded rows it received for its row in fp32 (s_j), compresses s_j
   once and all-gathers it; every member, j included, writes the I decoded rows into its shard.

Every member decodes the same payloads in the same order, so the shard ends bit-identical on
every instance, and so do the optimizer steps that read it. Two losses are fed back: each
member's own quantisation of c (r' = c - D(q), as in the flat tier) and, at the owner of row j
only, that of the all-gather (s_j - D(C(s_j)), added to its residual's row j, so it is sent
again next step, once). The new residual is staged in ``ErrorFeedback`` and takes effect only
when the step is applied. A shard whose length I does not divide is padded with zeros in a
scratch copy (zeros quantise exactly); the residual then has the padded length.

With tensor parallelism the shard may hold replicated elements (layernorms, row-parallel biases:
every TP rank has a copy that must stay bit-identical). A chunk's scale depends on its TP-split
neighbours, which differ between TP ranks, so those elements (``exact_offsets``, their offsets
in the shard) are taken out of the payload and all-reduced exactly across the instances beside
it, as comm/replicated.py does for the flat sync.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

import torch
import torch.distributed as dist

from megatron_grpo.comm.compress import Compressor
from megatron_grpo.comm.dynamic import _used_on_current_stream
from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.comm.streams import CommOrder


class InterInstanceAllReduce:
    """One in-flight compressed all-reduce of ``shard`` (a 1-D fp32 view of this rank's shard
    of a bucket, after the exact intra-instance reduce-scatter) over ``group`` (the
    inter-instance group); ``wait()`` finishes it and leaves the reduced sum in ``shard``.

    ``stats(applied, owed)``, when given, receives this rank's delivered values D(q) and what it
    owed (c), both flat, before anything is sent (monitoring steps only).

    ``order`` (``streams.CommOrder``, GPU): the second phase (decode-and-sum, re-compress, the
    all-gather and its decode) is issued on the stream the first exchange was issued on, and
    the caller's stream only waits on its "decoded" event; without one it runs on the caller's
    stream."""

    def __init__(self, key: Hashable, shard: torch.Tensor, ef: ErrorFeedback, compressor: Compressor,
                 group, async_op: bool,
                 stats: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
                 exact_offsets: Optional[torch.Tensor] = None,
                 order: Optional[CommOrder] = None) -> None:
        self.order = order
        self.key, self.shard, self.ef, self.compressor, self.group = key, shard, ef, compressor, group
        self.members = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        n = shard.numel()
        self.row = -(-n // self.members)
        padded = self.row * self.members
        if padded == n:
            self.work = shard
        else:
            self.work = torch.zeros(padded, dtype=shard.dtype, device=shard.device)
            self.work[:n].copy_(shard)
        self.exact_offsets, self.exact, self.exact_handle = exact_offsets, None, None
        if exact_offsets is not None:
            self.exact = self.work.index_select(0, exact_offsets)
            self.work.index_fill_(0, exact_offsets, 0.0)
            self.exact_handle = dist.all_reduce(self.exact, group=group, async_op=async_op)
        owed = ef.owed(key, self.work).view(self.members, self.row)
        self.send = compressor.compress_rows(owed)
        delivered = compressor.decompress_rows(self.send, self.row)
        if stats is not None:
            stats(delivered.view(-1), owed.view(-1))
        # r' = c - D(q) for every row, taken now: the all-gather below overwrites c.
        self.residual = owed.to(torch.float32, copy=True).sub_(delivered)
        self.recv = torch.empty_like(self.send)
        self.handle = dist.all_to_all_single(self.recv.view(-1), self.send.view(-1), group=group,
                                             async_op=async_op)
        self.done = False
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.done:
            return
        if self.order is not None:
            # shard (and work, when it is shard) lies in megatron's gradient buffer, made on the
            # main stream; every other buffer here was made on the comm stream itself.
            self.order.finish(self._second_phase, self.shard, self.work)
        else:
            _used_on_current_stream(self.send, self.recv, self.residual, self.work, self.exact)
            self._second_phase()
        self.done = True

    def _second_phase(self) -> None:
        if self.handle is not None:
            self.handle.wait()  # NCCL: the current stream waits, the host does not; gloo: the host
        rows = self.work.view(self.members, self.row)
        own = rows[self.me]
        self.compressor.decompress_rows_sum(self.recv, self.row, out=own)
        payload = self.compressor.compress_rows(own.view(1, self.row))
        # The all-gather's loss at the owner, re-sent by the owner next step.
        self.residual[self.me].add_(own).sub_(self.compressor.decompress_rows(payload, self.row).view(-1))
        self.ef.stage_residual(self.key, self.residual.view(-1))
        gathered = torch.empty((self.members, payload.shape[1]), dtype=torch.uint8, device=payload.device)
        # Synchronous: with NCCL the current stream waits for it, not the host.
        dist.all_gather_into_tensor(gathered.view(-1), payload.view(-1), group=self.group)
        rows.copy_(self.compressor.decompress_rows(gathered, self.row))
        if self.exact is not None:
            if self.exact_handle is not None:
                self.exact_handle.wait()
            self.work.index_copy_(0, self.exact_offsets, self.exact)
        if self.work is not self.shard:
            self.shard.copy_(self.work[:self.shard.numel()])
