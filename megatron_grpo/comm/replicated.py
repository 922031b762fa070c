"""Exact sync for the elements of a compressed bucket that other model-parallel ranks also hold.

With tensor parallelism a bucket mixes TP-split parameters (each TP rank holds its own slice)
with replicated ones (layernorm weights, row-parallel biases: every TP rank holds a copy, and
megatron relies on the copies staying bit-identical). A compression chunk of the dynamic tier
can straddle both kinds, so its scale (int4/int8) or its top-k selection depends on the TP-split
values and differs between TP ranks: the copies of a replicated parameter would receive
different updates and drift apart (measured: 10 of 15 replicated parameters differed after 14
iterations at TP2 x DP2). So replicated elements leave the compressed payload (they are sent
as zeros: int4, int8 and top-k encode them exactly; int2 has no zero level and decodes them to
+-0.45 of the chunk's RMS, which ``put`` / ``apply_values`` then overwrite) and travel in one
small exact collective of their own: an all-reduce of their gradients, and an all-reduce of their new
values in which each owner contributes its own elements and every other rank contributes 0
(x + 0 is exact, so every rank gets the owner's bytes). They are a tiny share of a bucket
(about 6 * hidden per layer against 12 * hidden**2 / TP), so the exact path costs little.

Every rank of the data-parallel group has the same bucket layout, so every rank issues the
same collectives of the same size whatever its data.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def bucket_ranges(bucket) -> dict:
    """param -> (start, end) of its gradient inside ``bucket.grad_data``.

    Read from where ``param.main_grad`` (megatron's view into the grad buffer) starts, not from
    ``bucket.param_to_index``: in megatron-core 0.16.1 that map packs parameters back to back
    and ignores the padding the distributed optimizer puts before parameter starts (64-element
    alignment), so it is off by the padding for every parameter after the first.
    """
    base = bucket.grad_data.data_ptr()
    size = bucket.grad_data.element_size()
    out = {}
    for param in bucket.params_list:
        start = (param.main_grad.data_ptr() - base) // size
        if not 0 <= start <= bucket.grad_data.numel() - param.numel():
            raise RuntimeError(f"GRPO: a parameter's main_grad does not lie in its bucket "
                               f"(offset {start}, {param.numel()} elements, bucket "
                               f"{bucket.grad_data.numel()})")
        out[param] = (start, start + param.numel())
    return out


class ReplicatedElements:
    """The replicated elements of one bucket (flat indices into its gradient/param buffer)."""

    def __init__(self, index: torch.Tensor, shard_len: int, rank: int) -> None:
        self.index = index
        """int64 indices of replicated elements in the bucket, ascending, on the bucket's device."""
        start, end = rank * shard_len, (rank + 1) * shard_len
        own = (index >= start) & (index < end)
        self.own_slot = torch.nonzero(own).view(-1)
        """Positions in ``index`` of the elements this rank owns (its shard)."""
        self.own_offset = index[own] - start
        """Those elements' offsets inside this rank's shard."""

    @classmethod
    def for_bucket(cls, bucket, shard_len: int, rank: int, device) -> Optional["ReplicatedElements"]:
        """The replicated elements of a megatron bucket, or None when it has none."""
        pieces = []
        for param, (start, end) in bucket_ranges(bucket).items():
            if not getattr(param, "tensor_model_parallel", False):
                pieces.append(torch.arange(start, end, dtype=torch.int64))
        if not pieces:
            return None
        index = torch.sort(torch.cat(pieces)).values.to(device)
        return cls(index, shard_len, rank)

    @property
    def numel(self) -> int:
        return self.index.numel()

    # ------------------------------------------------------------------ gradients
    def take(self, grad: torch.Tensor) -> torch.Tensor:
        """Return the replicated elements of ``grad`` and zero them in place (so the compressed
        payload carries exact zeros there)."""
        values = grad.index_select(0, self.index)
        grad.index_fill_(0, self.index, 0.0)
        return values

    def start_reduce(self, values: torch.Tensor, group, async_op: bool):
        """Exact sum over the data-parallel group (gradients are pre-scaled by megatron's 1/dp)."""
        return dist.all_reduce(values, group=group, async_op=async_op)

    def put(self, grad: torch.Tensor, values: torch.Tensor) -> None:
        """Write the reduced values back (this rank's own shard is what the optimizer reads)."""
        grad.index_copy_(0, self.index, values)

    # ------------------------------------------------------------------ parameters
    def split_update(self, delta: torch.Tensor, master_shard: torch.Tensor) -> torch.Tensor:
        """Zero the replicated elements of this rank's shard ``delta`` (compressed path) and
        return a vector holding their exact new values at their slots, 0 elsewhere."""
        values = torch.zeros(self.numel, dtype=torch.float32, device=delta.device)
        values.index_copy_(0, self.own_slot, master_shard.float().index_select(0, self.own_offset))
        delta.index_fill_(0, self.own_offset, 0.0)
        return values

    def apply_values(self, param_flat: torch.Tensor, values: torch.Tensor) -> None:
        """Every rank writes the owners' exact values (cast like megatron's own param copy)."""
        param_flat.index_copy_(0, self.index, values.to(param_flat.dtype))
