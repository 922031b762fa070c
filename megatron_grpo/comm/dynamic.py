"""Compressed collectives of the dynamic tier, with the semantics of megatron's exact ones.

* ``CompressedReduceScatter``: reduce-scatter of a bucket's gradient. Each rank compresses its
  (already 1/dp-scaled) gradient plus error-feedback residual as dp equal shards, exchanges
  them with one ``all_to_all_single`` of uint8 payloads, and sums the dp payloads it receives
  for its own shard in fp32, in rank order (deterministic).
* ``compressed_param_gather``: the all-gather of updated parameters. The owner of a shard sends
  q = C(master - model_copy); every rank, the owner included, adds D(q) to its model copy of
  that shard. Every rank applies the same bytes, so all model copies stay bit-identical, and
  the difference to the exact master is re-sent next step (error feedback without a residual).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_grpo.comm.compress import Compressor, ErrorFeedback


class CompressedReduceScatter:
    """One in-flight compressed reduce-scatter of one bucket; ``wait()`` finishes it."""

    def __init__(self, key, grad: torch.Tensor, shard_out: torch.Tensor, ef: ErrorFeedback,
                 compressor: Compressor, group, async_op: bool,
                 stats: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None) -> None:
        self.dp = dist.get_world_size(group)
        self.shard_len = grad.numel() // self.dp
        self.shard_out = shard_out
        self.compressor = compressor
        before = None
        if stats is not None:
            previous = ef.residual(key)
            # c = g + r_old is what should be delivered; applied = c - r_new.
            before = grad.clone() if previous is None else grad + previous.to(grad.device)
        payloads = ef.compress(key, grad, compressor, self.dp)
        if stats is not None:
            stats(before - ef.residual(key), before)
        self.send = torch.cat(payloads)
        self.recv = torch.empty_like(self.send)
        self.work = dist.all_to_all_single(self.recv, self.send, group=group, async_op=async_op)
        self.done = False
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        size = self.recv.numel() // self.dp
        # The local shard view held this rank's own (uncompressed) gradient; it is replaced by
        # the sum of what every rank (this one included) delivered for it.
        self.shard_out.zero_()
        for r in range(self.dp):
            self.compressor.decompress(self.recv[r * size:(r + 1) * size], self.shard_len,
                                       out=self.shard_out, accumulate=True)
        self.done = True


def compressed_param_gather(param_flat: torch.Tensor, staged_master: torch.Tensor,
                            compressor: Compressor, group) -> None:
    """Update every rank's copy of ``param_flat`` (one bucket's param buffer) from the owners'
    exact master shards (``staged_master`` is this rank's shard, same length as param_flat/dp)."""
    dp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    shard_len = param_flat.numel() // dp
    mine = param_flat[rank * shard_len:(rank + 1) * shard_len]
    delta = staged_master.to(torch.float32) - mine.to(torch.float32)
    payload = compressor.compress(delta)
    gathered = torch.empty(payload.numel() * dp, dtype=torch.uint8, device=payload.device)
    dist.all_gather_into_tensor(gathered, payload, group=group)
    size = payload.numel()
    for r in range(dp):
        view = param_flat[r * shard_len:(r + 1) * shard_len]
        update = compressor.decompress(gathered[r * size:(r + 1) * size], shard_len)
        view.add_(update.to(view.dtype))

