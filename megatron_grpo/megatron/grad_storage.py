"""Gradient memory per tier unit (--grpo-release-grads): megatron's gradient buffer cut into
storage of its own per bucket, allocated when backward reaches the bucket and released once its
sync has finished.

megatron-core (0.16.1) allocates one gradient buffer (``_ParamAndGradBuffer.grad_data``) for all
parameters of a dtype and keeps it for the whole run; every bucket's ``grad_data`` and every
parameter's ``main_grad`` are views into it. Here each bucket gets its own tensor, and the
views are re-pointed into it, so a bucket's memory can come and go on its own:

* **empty** (from the start, and after ``zero_grad_buffer``): the storage has zero bytes. The tensor objects stay
  (megatron, its hooks and GRPO hold the same ``grad_data`` and ``main_grad``), as in megatron's
  own ``offload_grad_buffers``: ``untyped_storage().resize_``.
* **full**: allocated (and zeroed) just before the first gradient of the step is written into
  it: by DDP's gradient-accumulation hook, or, with ``gradient_accumulation_fusion`` (the wgrad
  GEMM writes ``main_grad`` itself), by a hook on the owning module's output gradient, which
  runs before that module's backward. Gradient accumulation over micro-batches keeps it full
  until the last micro-batch's sync.
* **shard**: once the bucket's sync has finished, this rank's shard (the part its distributed
  optimizer owns) is copied out and the full storage freed. The optimizer reads the shard
  (``param_grad``); after the step it is dropped too. With the memory tier the shard of a unit
  the optimizer step streams is written to host memory or SSD at once and read back just before
  its unit's update (megatron/grad_shards.py): ``away`` until then, its storage zero bytes.

Parameters megatron reads *after* the data-parallel sync (``finalize_model_grads``: layernorm
grads all-reduced over tensor-parallel ranks with sequence parallelism, the word embedding
shared between the first and last pipeline stage, position or conditional embedders) keep a
full copy of their own gradient, ``main_grad`` pointing at it, until the step ends.

On CUDA a storage is freed only after the stream that freed it has waited for the collective
(the handle's ``wait``), and buffers used on GRPO's side stream are recorded on the current
stream first (``comm.streams``), so the caching allocator never hands out memory a kernel
still reads.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

from megatron_grpo.comm import streams

EMPTY, FULL, SHARD = "empty", "full", "shard"


def reads_after_sync(param, config, tp_size: int, pp_size: int, name: str = "") -> bool:
    """Does megatron's ``finalize_model_grads`` (0.16.1 through 0.19) read ``param.main_grad``
    after the data-parallel sync? Erring towards yes only costs the parameter's own gradient
    bytes."""
    if tp_size > 1:
        if getattr(param, "average_gradients_across_tp_domain", False):
            return True
        if getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False):
            return True
        if getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name):
            return True
    if pp_size > 1:
        if getattr(param, "shared_embedding", False) or getattr(param, "shared", False):
            return True
        if getattr(config, "flextron", False) and getattr(param, "flextron_router_pp_sync", False):
            return True  # megatron 0.19: the router's gradients all-reduced over PP stages
        if getattr(param, "pipeline_parallel", False) or name.endswith("position_embeddings.weight"):
            return True
    return False


class BucketGrads:
    """One megatron bucket's gradient storage: state, shard, late copies, bytes."""

    def __init__(self, bucket, rank: int, size: int, late: List) -> None:
        self.bucket = bucket
        self.grad = bucket.grad_data
        self.numel = self.grad.numel()
        self.nbytes = self.numel * self.grad.element_size()
        self.rank, self.size = rank, size
        self.shard_len = self.numel // size
        self.shard: Optional[torch.Tensor] = None
        self.late = late                      # params with a copy of their own after the sync
        self.views = {p: p.main_grad for p in late}
        self.copies: Dict[torch.nn.Parameter, torch.Tensor] = {}
        # Empty from the start (cut_buffer): allocated when backward first writes to it.
        self.state = FULL if self.grad.untyped_storage().nbytes() else EMPTY
        self.on_drop = None                   # set while the shard is placed (grad_shards.py)
        self.peak_bytes = self.resident_bytes()

    # -- states ----------------------------------------------------------------------------------
    def ensure(self) -> None:
        """Full storage before a gradient is written (no-op once full)."""
        if self.state == FULL:
            return
        if self.state == SHARD:
            raise RuntimeError(
                f"GRPO gradient release: a gradient arrived for a bucket of {self.numel} elements "
                f"after its sync had finished (rank {self.rank} of its group); run with "
                f"--no-grpo-release-grads and report the model layout")
        self.grad.untyped_storage().resize_(self.nbytes)
        self.grad.zero_()
        self.state = FULL

    def release(self, into: Optional[torch.Tensor] = None) -> None:
        """After the sync: keep this rank's shard (and the late params' copies), free the rest.
        ``into``: the tensor the shard is copied to (the memory tier's registered buffer), else
        a new one."""
        if self.state != FULL:
            return
        own = self.grad[self.rank * self.shard_len:(self.rank + 1) * self.shard_len]
        self.shard = own.clone() if into is None else into.copy_(own)
        for p in self.late:
            copy = p.main_grad.clone()
            self.copies[p] = copy
            p.main_grad = copy
        self._free()
        self.state = SHARD

    def vacate(self) -> None:
        """A micro-batch's gradient went to the host (--grpo-grad-accumulation host): free the
        full storage; the next write allocates it again, zeroed (``ensure``)."""
        if self.state == FULL:
            self._free()
            self.state = EMPTY

    def drop(self) -> None:
        """The step is over (or a new one starts): nothing stays; main_grad views restored."""
        if self.state == FULL:
            self._free()
        if self.on_drop is not None:
            self.on_drop()  # the memory tier frees its copy on the device, if any
            self.on_drop = None
        self.shard = None
        for p, view in self.views.items():
            p.main_grad = view
        self.copies.clear()
        self.state = EMPTY

    def _free(self) -> None:
        # Work queued on GRPO's side stream may still read it (CUDA): the caching allocator
        # must not reuse the block before the current stream has passed that point.
        streams.used_on_current_stream(self.grad)
        self.grad.untyped_storage().resize_(0)

    # -- reads -----------------------------------------------------------------------------------
    def placed(self, param=None) -> bool:
        """Is the shard (``param``'s part of it) the memory tier's this step? Then it is read
        only through the tier (megatron/grad_shards.py), even while still resident with its
        write in flight: the tier may read the file's bytes back into it at any time. A late
        param's own copy never leaves."""
        if param is not None and param in self.copies:
            return False
        return self.shard is not None and self.on_drop is not None

    def param_grad(self, param, param_range, world_range) -> torch.Tensor:
        """The gradient of the part of ``param`` this rank owns: ``param_range`` in the
        parameter, ``world_range`` in the bucket (megatron's range map)."""
        copy = self.copies.get(param)
        if copy is not None:
            return copy.view(-1)[param_range.start:param_range.end]
        if self.state == FULL:
            return self.grad[world_range.start:world_range.end]
        if self.state == SHARD:
            if self.shard.untyped_storage().nbytes() == 0:
                # Away: its storage is zero bytes, a read would be undefined, not just stale.
                raise RuntimeError(f"GRPO memory tier: a gradient shard was read while it is on "
                                   f"host memory or SSD (rank {self.rank} of its group); it is "
                                   f"read back for its unit's update only")
            start = world_range.start - self.rank * self.shard_len
            return self.shard[start:start + world_range.size]
        raise RuntimeError(f"GRPO gradient release: the optimizer asked for a gradient of a bucket "
                           f"that had none this step (rank {self.rank} of its group)")

    def scale(self, factor: float) -> None:
        if self.state == FULL:
            self.grad.mul_(factor)
        elif self.state == SHARD:
            if self.placed():
                # build_placement refuses per-token loss with --grpo-offload-grads before
                # step 1 (options.check_grad_shards); a guard for a placement built otherwise:
                # scaling the shard here would be lost when the tier reads its bytes back.
                raise RuntimeError(f"rank {self.rank} of its group: GRPO memory tier: gradients "
                                   f"are scaled after their sync (per-token loss, "
                                   f"--calculate-per-token-loss) while a shard is away; run "
                                   f"with --no-grpo-offload-grads")
            self.shard.mul_(factor)
            for copy in self.copies.values():
                copy.mul_(factor)

    def shard_bytes(self) -> int:
        """Bytes of its shard on the device (zero while the memory tier holds it away)."""
        return self.shard.untyped_storage().nbytes() if self.shard is not None else 0

    def resident_bytes(self) -> int:
        out = self.nbytes if self.state == FULL else 0
        out += self.shard_bytes()
        out += sum(c.numel() * c.element_size() for c in self.copies.values())
        return out


class GradStorage:
    """Every managed bucket of one rank (all DDP chunks), the in-flight window, and metrics."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.buckets: List[BucketGrads] = []
        self.of_param: Dict[torch.nn.Parameter, BucketGrads] = {}
        self.outstanding: List = []           # bucket groups with a sync in flight, oldest first
        self.peak = 0
        self.resident = 0
        self.peak_by_bucket: List[int] = []  # each bucket's bytes when the step's peak was reached
        self.shards = None                   # GradShards of the memory tier (grad_shards.py), if on
        self.shard_peak = 0                  # most shard bytes resident at once this step
        self.setup_buffer_bytes = 0          # megatron's whole buffer as allocated (0: on meta, ddp.py)
        self.host_accum = None               # HostAccumulator (grad_accum.py), if on

    def add(self, grads: BucketGrads) -> None:
        self.buckets.append(grads)
        for p in grads.bucket.params_list:
            self.of_param[p] = grads
        self._account()

    def ensure_param(self, param) -> None:
        grads = self.of_param.get(param)
        if grads is not None and grads.state != FULL:
            grads.ensure()
            self._account()

    def reset(self, buckets) -> None:
        """zero_grad_buffer (per megatron buffer): these buckets empty, the step's peak restarts."""
        self.outstanding.clear()
        for b in buckets:
            b.grpo_grads.drop()
        if self.host_accum is not None:
            self.host_accum.clear()
        self.peak = self.shard_peak = 0
        self._account()

    def released(self) -> None:
        self._account()

    def after_step(self) -> None:
        """The optimizer step has consumed the shards: free everything."""
        self.outstanding.clear()
        for g in self.buckets:
            g.drop()
        self._account()

    def _account(self) -> None:
        each = [g.resident_bytes() for g in self.buckets]
        self.resident = sum(each)
        self.shard_peak = max(self.shard_peak, sum(g.shard_bytes() for g in self.buckets))
        if self.resident >= self.peak:
            self.peak, self.peak_by_bucket = self.resident, each

    def metrics(self) -> Dict[str, float]:
        full = sum(1 for g in self.buckets if g.state == FULL)
        extra = self.host_accum.metrics() if self.host_accum is not None else {}
        return {**extra, "grad_bytes_peak": float(self.peak), "grad_bytes_resident": float(self.resident),
                "grad_shard_bytes_peak": float(self.shard_peak),
                "grad_bytes_setup_buffer": float(self.setup_buffer_bytes),
                "grad_units_full": float(full),
                # For comparison: megatron's one buffer, and the largest single bucket.
                "grad_bytes_whole_buffer": float(sum(g.nbytes for g in self.buckets)),
                "grad_bytes_largest_bucket": float(max((g.nbytes for g in self.buckets), default=0))}


def cut_buffer(ddp, storage: GradStorage) -> None:
    """Give every bucket of ``ddp`` (megatron DDP, distributed optimizer) storage of its own
    and free megatron's whole-buffer gradient tensor. Call right after DDP is built, before the
    optimizer (which keeps no gradient views of its own) and before any backward."""
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    names = {p: n for n, p in ddp.module.named_parameters()}
    group_of = {}
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for b in group.buckets:
            group_of[id(b)] = group
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        if buffer.grad_data is not None and not buffer.grad_data.is_meta:
            storage.setup_buffer_bytes += buffer.grad_data.numel() * buffer.grad_data.element_size()
        for bucket in buffer.buckets:
            old = bucket.grad_data  # a view of megatron's buffer: on the meta device (ddp.py)
            # Zero bytes until backward first writes to it (BucketGrads.ensure allocates and
            # zeroes it): allocating every bucket here would hold the model's gradients at
            # setup, the run's peak under the memory tier (measured: bench memcap's larger
            # sizes were killed before step 1).
            device = bucket.param_data.device if bucket.param_data is not None else old.device
            own = torch.empty(old.numel(), dtype=old.dtype, device=device)
            for p in bucket.params_list:
                start = p.main_grad.storage_offset() - old.storage_offset()
                p.main_grad = own[start:start + p.numel()].view(p.shape)
            own.untyped_storage().resize_(0)  # after the views: a view is checked against it
            bucket.grad_data = own
            group = group_of[id(bucket)].intra_distributed_optimizer_instance_group
            late = [p for p in bucket.params_list
                    if reads_after_sync(p, ddp.config, tp, pp, names.get(p, ""))]
            grads = BucketGrads(bucket, group.rank(), group.size(), late)
            bucket.grpo_grads = grads
            storage.add(grads)
        buffer.grad_data = None  # megatron's whole-model tensor: its last reference
        buffer.__class__ = GRPOGradBuffer
        buffer.grpo_storage = storage


class GRPOGradBuffer(_ParamAndGradBuffer):
    """megatron's ``_ParamAndGradBuffer`` (0.16.1) whose gradients live per bucket
    (``cut_buffer`` swaps ``__class__``): its two methods that touch the whole-model gradient
    tensor act on the buckets instead."""

    grpo_storage: GradStorage = None

    # -- replaces _ParamAndGradBuffer.reset (zero_grad_buffer at the start of an iteration) -------
    def reset(self):
        self.grpo_storage.reset(self.buckets)

    # -- replaces _ParamAndGradBuffer.scale_gradients (per-token loss scaling, after the sync) ------
    def scale_gradients(self, scaling_factor: float) -> None:
        for b in self.buckets:
            b.grpo_grads.scale(scaling_factor)
