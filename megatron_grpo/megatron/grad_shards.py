"""Gradient shards through the memory tier (--grpo-offload-grads).

With gradient release (megatron/grad_storage.py) a unit's full gradient lives from backward
until its sync, then only this rank's shard stays, until the optimizer step has consumed it.
Those shards pile up through backward: at the step, every unit's shard is resident at once.
With the memory tier streaming the optimizer step (--grpo-offload-stream), the shard of every
unit the step streams leaves too: written to host memory or SSD right after its sync (on the
chunk store's worker threads, at most a few writes in flight), and read back, a few units ahead,
just before its unit's update, which frees it. The shards of core units after warm-up stay.

What reads a gradient before the first update, and how it still gets the same numbers:

* megatron's gradient norm (and GRPO's non-finite check) takes one norm per main-grad tensor
  (``torch.norm`` each, on CPU megatron's ``local_multi_tensor_l2_norm``) and then the norm of
  those. Each shard's per-parameter norms are taken at release, from the same values, and
  stand in for the tensors (a one-element tensor whose norm is that norm, exactly): the total
  is bit for bit the one without the tier. On CUDA megatron's fused kernel sums squares of
  elements in its own order, so there the norm agrees to rounding, not bit for bit.
* clipping multiplies each gradient by one coefficient from that norm: an away unit's
  gradients are multiplied when they come back, by megatron's own function with the same
  norm: the same multiplication.

The store is an ``OffloadedResiduals`` (one registered buffer per bucket, rewritten every step),
so writes are bounded (a few in flight; the oldest is waited for and freed) and reads look ahead
in the order this step's optimizer reads them (``expect``). A shard handed to the store is read
only through it, even while still resident with its write in flight (``BucketGrads.placed``):
the store may read the file's bytes back into it at any time, so a write into it (clipping in
place) outside the store would be lost.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Tuple

import torch

from megatron_grpo.megatron.grad_storage import BucketGrads


class GradShards:
    """This rank's gradient shards of streamed units, in ``store``; one per run."""

    def __init__(self, store, placement, ctrl, optimizers) -> None:
        self.store, self.placement, self.ctrl = store, placement, ctrl
        self.wanted: set = set()
        # (unit, bucket index) -> the shard main params read from that bucket's shard
        self.params: Dict[Hashable, List[Tuple[torch.nn.Parameter, torch.Tensor, dict]]] = {}
        for opt in optimizers:
            for model_param, shard in opt._pairs():
                bucket = opt._bucket_of(model_param)
                unit = ctrl.unit_of_bucket[id(bucket)]
                index = next(i for i, b in enumerate(ctrl.units[unit].group.buckets) if b is bucket)
                self.params.setdefault((unit, index), []).append(
                    (model_param, shard, opt._get_model_param_range_map(model_param)))
        self.norms: Dict[int, torch.Tensor] = {}  # id(shard main param) -> its gradient's norm

    def begin_step(self, update_now: bool) -> None:
        """Which units' shards leave this step: those its optimizer step streams."""
        self.store.begin_step(prefetch=False)  # this step's shards are not written yet
        self.wanted = set(self.placement.windows(update_now))
        self.norms.clear()

    def wants(self, unit: int) -> bool:
        return unit in self.wanted

    def release(self, unit: int, index: int, grads: BucketGrads) -> None:
        """The bucket's sync has finished: its shard goes to the store (its norms taken first)."""
        key = (unit, index)
        like = grads.grad[:grads.shard_len]
        buffer = self.store.buffer(key, like)  # the bucket's registered buffer, allocated again
        grads.release(into=buffer)
        for model_param, shard, ranges in self.params.get(key, []):
            if model_param not in grads.copies:  # a late param's own copy stays resident
                grad = grads.param_grad(model_param, ranges["param"], ranges["gbuf_world_in_bucket"])
                self.norms[id(shard)] = torch.norm(grad.float())
        self.store[key] = buffer  # written out in the background; freed once written

        def drop() -> None:
            self.store.release(key)  # read and used (or the step skipped): the file keeps it
        grads.on_drop = drop

    def norm_of(self, shard) -> torch.Tensor:
        return self.norms[id(shard)]

    def expect(self, units) -> None:
        """Backward is over: the step reads the shards of ``units`` in this order. Start reading
        back the first ones; each read then looks ahead in this order (last step's would
        also read back shards of units not placed this step, into memory nobody frees)."""
        keys = [k for u in units for k in self._keys(u)]
        self.store.settle()  # the last writes of backward that have landed: freed now
        self.store.expect(keys)
        self.store.prefetch(keys[:self.store.lookahead])

    def fetch(self, unit: int) -> None:
        """The unit's shards resident again (waiting for the read: stall time)."""
        self.store.settle()  # and those that landed since (else resident until the step ends)
        for key in self._keys(unit):
            self.store.get(key)

    def _keys(self, unit: int) -> List[Hashable]:
        return [(unit, i) for i in range(len(self.ctrl.units[unit].group.buckets))
                if (unit, i) in self.store]
