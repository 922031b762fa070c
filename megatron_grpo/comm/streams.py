"""Tensor lifetimes across CUDA streams: the one rule GRPO's side-stream work follows.

GRPO issues a bucket's importance, error-feedback and compression kernels on a side stream
(``GRPOBucketGroup._side_stream``) so backward keeps running on the main stream. Kernels are
queued, not run: when Python frees a tensor (``del``, ``untyped_storage().resize_(0)``), a
kernel that reads it may still be waiting on another stream. PyTorch's caching allocator hands
a freed block to the next allocation *on the stream that allocated it* at once; it knows of no
other stream's pending kernels unless told. Without that, the block's next owner can overwrite
it before the pending kernel read it: gradients or residuals silently corrupted.

The rule: whoever issues a kernel that uses a tensor on a stream other than the one that
allocated it, and does not make the allocating stream wait for that stream before the tensor
may be freed, calls ``used_on_current_stream(tensor)`` right after issuing it (inside the
stream's context). That is ``Tensor.record_stream``: the allocator then reuses the block only
after the work queued on this stream by the time of the free has completed.

Where GRPO frees or reuses memory a kernel on the other stream used (the audit of issue 27):

* ``ErrorFeedback.owed`` then an offloading store's ``release`` (``resize_(0)`` right after the
  side-stream add; the residual may have been fetched on the main stream): recorded there.
* the buffers of the compressed collectives (comm/dynamic.py, powersgd.py, hierarchical.py:
  payloads, the exact elements, PowerSGD's factors, the inter-instance residual): allocated on
  the side stream, read on the main stream in ``wait()``: recorded there.
* everything else is freed or rewritten by the main stream after it joined the side stream
  (``finish_grad_sync``, ``GRPOController.end_step``): staged ``c_own`` shards, carries,
  accumulators, replaced residuals and PowerSGD factors, the offloading store's other frees
  (``settle``, ``__delitem__``); and every side-stream section begins by waiting for the main
  stream, so a side-stream allocation cannot run ahead of the main stream's last use of a block.
  The offload store's copy threads are waited on through their futures (offload/store.py).

On CPU (and for CPU tensors) kernels run in issue order and this is a no-op; tests replace this
function with a recording double (tests/stream_double.py) that fails when a storage with
unprotected pending work on another stream is freed.
"""

from __future__ import annotations

import torch


def used_on_current_stream(*tensors) -> None:
    """Tell the caching allocator that kernels just issued on the current stream use these
    tensors, so freeing them defers the block's reuse until that work is done (None skipped)."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
