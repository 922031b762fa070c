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

Where GRPO frees or reuses memory a kernel on the other stream used (the stream audit):

* ``ErrorFeedback.owed`` then an offloading store's ``release`` (``resize_(0)`` right after the
  side-stream add; the residual may have been fetched on the main stream): recorded there.
* the buffers of the compressed collectives (comm/dynamic.py, powersgd.py, hierarchical.py:
  payloads, the exact elements, PowerSGD's factors, the inter-instance residual): allocated on
  the side stream and, with a ``CommOrder``, decoded there too (their own stream: nothing to
  record); the gradient buffer that decode writes was made on the main stream: recorded on the
  side stream, and the main stream waits on the decode's event before it reads or frees it.
  Without a ``CommOrder`` ``wait()`` decodes on the caller's stream and records the buffers
  there.
* everything else is freed or rewritten by the main stream after it joined the side stream
  (``finish_grad_sync``, ``GRPOController.end_step``): staged ``c_own`` shards, carries,
  accumulators, replaced residuals and PowerSGD factors, the offloading store's other frees
  (``settle``, ``__delitem__``); and every side-stream section begins by waiting for the main
  stream, so a side-stream allocation cannot run ahead of the main stream's last use of a block.
  The offload store's copy threads are waited on through their futures (offload/store.py).

On CPU (and for CPU tensors) kernels run in issue order and this is a no-op; tests replace this
function with a recording double (tests/stream_double.py) that fails when a storage with
unprotected pending work on another stream is freed.

Where a compressed sync finishes (``CommOrder``): the decode of what the collective delivered
(and the hierarchical all-reduce's second phase) is issued on the stream the collective was
issued on, GRPO's side stream, never on the stream that calls ``wait()``. That stream (the main
one, in ``finish_grad_sync`` or the in-flight window) then only waits on a "decoded" event, on
the device: the host is not held, and the backward kernels queued before that wait are not
serialised behind the communication and the decode.
"""

from __future__ import annotations

import torch


def used_on_current_stream(*tensors) -> None:
    """Tell the caching allocator that kernels just issued on the current stream use these
    tensors, so freeing them defers the block's reuse until that work is done (None skipped)."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


class CommOrder:
    """How an in-flight compressed sync finishes on a device with GRPO's side stream.

    ``comm`` is the stream its collective was issued on (the side stream: its buffers were
    allocated there, so decoding there reads them on their own stream and needs no
    ``record_stream`` for them); ``enter(stream)`` makes a stream current (``torch.cuda.stream``)
    and ``current()`` returns the current one. The controller supplies all three, so the test
    double (tests/stream_double.py) can stand in for CUDA's.
    """

    def __init__(self, comm, enter, current) -> None:
        self.comm, self.enter, self.current = comm, enter, current

    def finish(self, body, *foreign) -> None:
        """Run ``body`` with the comm stream current, then make the calling stream wait for it.

        ``body`` starts with the collective's ``work.wait()``: with NCCL that makes the *current*
        stream (here the comm stream) wait for the collective's completion event and returns at
        once; with gloo (CPU) it blocks the host until the data is there, as before. Every
        kernel ``body`` issues (decode, sum, the second phase's collective) is queued behind
        that wait on the comm stream. ``foreign``: tensors ``body`` uses that another stream
        allocated (the bucket's gradient buffer): recorded on the comm stream, so a free
        before the calling stream's wait below cannot hand their block out under the decode.
        The calling stream's one dependency is the "decoded" event, recorded after the last
        kernel of ``body``; a caller that is itself the comm stream (a synchronous sync issued
        inside the side stream's section) needs none."""
        caller = self.current()
        with self.enter(self.comm):
            body()
            used_on_current_stream(*foreign)
            decoded = self.comm.record_event()
        if caller != self.comm:
            caller.wait_event(decoded)
