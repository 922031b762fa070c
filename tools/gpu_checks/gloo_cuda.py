"""Two ranks on one CUDA device: gloo with CUDA tensors (phases d and e).

NCCL refuses two ranks on one device, so these runs use gloo, whose collectives take CUDA
tensors (it stages them through pinned host memory). Both ranks use device 0 (LOCAL_RANK=0).
Two things the training entry does not do on its own, installed by tools/gpu_checks/train_entry.py
in the rank processes only (the package is untouched):

* ``install_platform()``: ``megatron_grpo.training.loop`` picks NCCL whenever CUDA is usable; here
  it gets ``Platform(cuda:0, "gloo")`` instead.
* ``install_coalescing_shim()``: megatron-core issues a bucket group's collectives inside
  ``torch.distributed._coalescing_manager``, which hands them to the backend's *coalesced*
  entry points. gloo's coalesced all-gather has no CUDA path (it reads the flattened CUDA tensor
  as host memory), so the shim records the collectives as torch does and then issues each one
  on its own through the process group (``_allgather_base``, ``_reduce_scatter_base``,
  ``allreduce``, all of which gloo runs on CUDA tensors), returning a handle whose ``wait()``
  waits for all of them. Same collectives, same sizes, same order: the byte counter (which
  counts at the call, before the coalescing manager sees it) and the results are unchanged.
  The CPU dry run installs it too, so it cannot rot between device loans.
"""

from __future__ import annotations

import contextlib
from typing import List


class _Handles:
    """What megatron keeps as the bucket group's communication handle (it calls ``wait()``)."""

    def __init__(self) -> None:
        self.works: List = []

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait()


def _issue(group, op):
    import torch.distributed as dist

    name = getattr(op.op, "__name__", str(op.op))
    if name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        return group._allgather_base(op.dst_tensor, op.tensor)
    if name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = op.redop
        return group._reduce_scatter_base(op.dst_tensor, op.tensor, opts)
    if name == "all_reduce":
        opts = dist.AllreduceOptions()
        opts.reduceOp = op.redop
        return group.allreduce([op.tensor], opts)
    raise RuntimeError(f"gpu_check coalescing shim: collective {name!r} inside "
                       f"_coalescing_manager is not handled; add it to tools/gpu_checks/gloo_cuda.py")


@contextlib.contextmanager
def one_by_one(group=None, device=None, async_ops: bool = False):
    """Drop-in for ``torch.distributed._coalescing_manager`` that issues the recorded
    collectives one by one (see the module docstring)."""
    import torch.distributed.distributed_c10d as c10d

    group = group or c10d._get_default_group()
    state = c10d._world.pg_coalesce_state
    if state.get(group):
        raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
    state[group] = []
    handles = _Handles()
    try:
        yield handles
    finally:
        ops = state.pop(group, [])
    handles.works = [_issue(group, op) for op in ops]
    if not async_ops:
        handles.wait()


def install_coalescing_shim() -> None:
    import megatron.core.distributed.param_and_grad_buffer as buffers

    if not hasattr(buffers, "_coalescing_manager"):
        raise RuntimeError("gpu_check: megatron.core.distributed.param_and_grad_buffer has no "
                           "_coalescing_manager any more; update tools/gpu_checks/gloo_cuda.py")
    buffers._coalescing_manager = one_by_one


def check_platform_hook() -> None:
    """Fail now (CPU dry run included) if the training loop no longer selects its platform
    through ``select_platform`` (what ``install_platform`` replaces)."""
    import megatron_grpo.training.loop as loop

    if not callable(getattr(loop, "select_platform", None)):
        raise RuntimeError("gpu_check: megatron_grpo.training.loop.select_platform is gone; "
                           "update tools/gpu_checks/gloo_cuda.install_platform")


def install_platform() -> None:
    """The training loop's platform: CUDA device 0 with gloo (every rank of the job)."""
    import torch

    import megatron_grpo.training.loop as loop
    from megatron_grpo.platform import Platform

    check_platform_hook()

    def select_platform(force_cpu: bool = False, local_rank: int = 0) -> Platform:
        if force_cpu or not torch.cuda.is_available():
            raise RuntimeError("gpu_check: GPU_CHECK_GLOO_CUDA=1 needs a CUDA device (and no --cpu)")
        torch.cuda.set_device(0)
        return Platform(torch.device("cuda", 0), "gloo", False)

    loop.select_platform = select_platform
