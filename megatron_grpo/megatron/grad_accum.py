"""Gradient accumulation in host memory (--grpo-grad-accumulation host).

With several micro-batches per step, megatron adds each micro-batch's gradient into the unit's
gradient storage, which therefore stays full on the device from the first micro-batch's
backward to the last one's sync: the whole model's gradients at once, the largest term of a
large model's device memory once the optimizer state is offloaded (docs/offload.md). Here a
unit's gradient leaves the device as soon as a micro-batch's backward has produced all of it
(megatron's gradient hooks say when: ``GRPOBucketGroup.register_grad_ready``), before the last
micro-batch:

* **park**: the unit's storage is added into an fp32 accumulator in host memory (copied the
  first time), and the device storage is freed (``BucketGrads.vacate``): the next micro-batch
  allocates it again, zeroed, when its backward first writes to it;
* **fold**: when the last micro-batch has produced the unit's gradient, just before its sync,
  the accumulator is added back into the storage (on CUDA through one temporary device tensor
  of the unit's size), and the accumulator is marked empty.

The sum is the same: megatron computes ((g1 + g2) + g3) in the storage; here the host holds
g1 + g2 and the fold adds it to g3, and fp32 addition commutes, so the bits are equal (on CPU,
where the hook adds ``param.grad`` into ``main_grad``). With a bf16 gradient buffer the host
sum is fp32, not megatron's bf16 one (closer to exact, not bit-equal). On CUDA with
gradient_accumulation_fusion the wgrad GEMM adds into ``main_grad`` with its own rounding, so
there the result agrees to rounding.

On CUDA the copy to the host runs on the memory tier's kind of copy stream (``CopyStream``,
behind an event on the current stream, into a pinned buffer) and this thread waits for it
before freeing the storage, so no kernel reads freed memory; the host add runs on this thread.
That wait is on backward's thread, once per unit and micro-batch: an asynchronous version, with
the free deferred to the copy's completion, is not built.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_grpo.megatron.grad_storage import FULL, BucketGrads


class HostAccumulator:
    """One rank's host accumulators, one per gradient bucket, made at the first park."""

    def __init__(self, copy_stream=None) -> None:
        """``copy_stream``: the CopyStream device copies go through (made on the first CUDA
        park when None; tests pass one on a stream double to take that path on CPU)."""
        self.acc: Dict[int, torch.Tensor] = {}      # id(BucketGrads) -> fp32 host tensor
        self.filled: Dict[int, bool] = {}            # holds a sum not yet folded back
        self.staging = None                          # CUDA: one pinned landing buffer (reused)
        self.copy = copy_stream                      # CopyStream, made on the first CUDA park
        self.parks = 0                               # this step: parks, and bytes moved out
        self.parked_bytes = 0
        self.folds = 0

    def park(self, grads: BucketGrads) -> None:
        """Add a full unit's storage into its host accumulator and free the device storage."""
        if grads.state != FULL:
            return
        key = id(grads)
        src = grads.grad
        acc = self.acc.get(key)
        if acc is None:
            acc = torch.empty(src.numel(), dtype=torch.float32, pin_memory=src.is_cuda)
            self.acc[key] = acc
        if src.is_cuda or self.copy is not None:
            src = self._landed(src)
        if self.filled.get(key):
            acc.add_(src)
        else:
            acc.copy_(src)
        self.filled[key] = True
        self.parks += 1
        self.parked_bytes += grads.nbytes
        grads.vacate()

    def _landed(self, src: torch.Tensor) -> torch.Tensor:
        from megatron_grpo.offload.copy_stream import CopyStream

        if self.copy is None:
            self.copy = CopyStream(src.device)
        # One buffer serves every unit: each copy is waited for and added before the next.
        if self.staging is None or self.staging.numel() < src.numel() or self.staging.dtype != src.dtype:
            self.staging = torch.empty(src.numel(), dtype=src.dtype, pin_memory=src.is_cuda)
        staging = self.staging[:src.numel()]
        self.copy.run(staging, src, self.copy.mark())  # waits: the storage is freed next
        return staging

    def fold(self, grads: BucketGrads) -> None:
        """Before the unit's sync: add what the host holds back into its (full) storage."""
        key = id(grads)
        if not self.filled.get(key):
            return
        grads.ensure()
        acc = self.acc[key]
        # Blocking on CUDA: the next step's park rewrites this host tensor.
        grads.grad.add_(acc.to(grads.grad.device) if grads.grad.is_cuda else acc)
        self.filled[key] = False
        self.folds += 1

    def clear(self) -> None:
        """A new step (zero_grad_buffer): nothing held is owed to it."""
        self.filled.clear()
        self.parks = self.parked_bytes = self.folds = 0

    def host_bytes(self) -> int:
        held = list(self.acc.values()) + ([self.staging] if self.staging is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def metrics(self) -> Dict[str, float]:
        return {"grad_host_accum_bytes": float(self.host_bytes()),
                "grad_host_accum_parks": float(self.parks),
                "grad_host_accum_parked_bytes": float(self.parked_bytes),
                "grad_host_accum_folds": float(self.folds)}


def on_grad_ready(group, param) -> None:
    """A gradient hook fired in a micro-batch before the last: once every parameter of the
    bucket group has fired (as often as megatron's first batch counted, once before it knows),
    park each of its buckets. A hook that fires again after the park writes into storage
    allocated anew; the fold still adds the host's part, so the sum stays whole."""
    storage = group.grpo_storage
    if getattr(storage, "host_accum", None) is None or group.is_last_microbatch:
        return
    ready = group.__dict__.setdefault("_grpo_microbatch_ready", {})
    ready[param] = ready.get(param, 0) + 1
    golden = getattr(group, "golden_per_param_grad_ready_counts", None) or {}
    if len(ready) == len(group.params) and all(n >= golden.get(p, 1) for p, n in ready.items()):
        ready.clear()
        for b in group.buckets:
            storage.host_accum.park(b.grpo_grads)
        storage.released()


def fold_group(group) -> None:
    """The last micro-batch has produced the group's gradient: add the host's part back."""
    storage = group.grpo_storage
    if getattr(storage, "host_accum", None) is None:
        return
    group.__dict__.pop("_grpo_microbatch_ready", None)
    for b in group.buckets:
        storage.host_accum.fold(b.grpo_grads)


def check_installable(storage, ddp_config, config, rank: int) -> None:
    """--grpo-grad-accumulation host needs the per-unit storage and megatron's hooks."""
    if config.grad_accumulation != "host":
        return
    if storage is None:
        raise ValueError(f"rank {rank}: --grpo-grad-accumulation host needs gradient release "
                         f"(--grpo-release-grads) and the distributed optimizer "
                         f"(--use-distributed-optimizer): without them the gradients live in "
                         f"megatron's one buffer, which cannot leave the device per unit")
    if not ddp_config.overlap_grad_reduce:
        raise ValueError(f"rank {rank}: --grpo-grad-accumulation host needs --overlap-grad-reduce: "
                         f"megatron's gradient hooks, which say when a unit's micro-batch gradient "
                         f"is complete, run only with it")
