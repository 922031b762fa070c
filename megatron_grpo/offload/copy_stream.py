"""CopyStream: the chunk store's device <-> host copies on a CUDA stream of their own.

Why: the store's worker threads used to copy with a blocking ``copy_`` on their current stream,
the legacy default stream, which is also training's stream: every offload copy waited for all
kernels queued before it and held back all kernels queued after it, so the copies serialised
with compute instead of overlapping it.

How (the caching allocator's and CUDA's ordering rules, kept by construction):
* ``mark()`` is called on the thread that asks for a move, when it asks: an event on that
  thread's current stream. The copy waits for it on the copy stream, so it reads bytes the
  optimizer wrote before the request (eviction), and writes memory the caller allocated just
  before (prefetch: ``resize_`` on the caller's stream, maybe a block that stream freed while
  its kernels were still queued) only after that stream got there.
* ``copy()`` enqueues ``dst.copy_(src, non_blocking=True)`` on the copy stream between two
  timing events and returns them; the worker then waits for ``done`` with ``wait()``: an event
  synchronize, which blocks that worker thread only, never the device or another stream.
* A move's Future completes only after that wait, so: the tensors a copy reads or writes stay
  referenced by the worker until the copy has finished (no ``record_stream`` needed); a
  caller that frees a chunk's storage after its eviction's Future (the placement's
  ``resize_(0)``) frees memory no copy reads any more; a caller that waits for a prefetch's
  Future on its own stream's thread reads landed bytes with every kernel it queues after.
* Host buffers are pinned (the store's pool), so the copies are DMA transfers that run beside
  compute kernels.

``cuda`` is ``torch.cuda`` in training; tests pass a double of the same API (Stream, Event,
current_stream, stream) that defers side-stream work until an event after it is waited for.
"""

from __future__ import annotations

import time
from typing import Tuple

import torch


class CopyStream:
    """One store's copy stream on one device, made when the store first moves a chunk there."""

    def __init__(self, device, cuda=None):
        self.cuda = torch.cuda if cuda is None else cuda
        self.device = device
        self.stream = self.cuda.Stream(device=device)

    def mark(self):
        """An event on the calling thread's current stream: what the copy must come after."""
        event = self.cuda.Event()
        event.record(self.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after) -> Tuple[object, object]:
        """Enqueue ``dst.copy_(src)`` on the copy stream behind ``after``; returns the events
        (start, done) around it. Keep both tensors referenced until ``wait(done)``."""
        start, done = self.cuda.Event(enable_timing=True), self.cuda.Event(enable_timing=True)
        with self.cuda.stream(self.stream):
            self.stream.wait_event(after)
            start.record(self.stream)
            self._issue(dst, src)
            done.record(self.stream)
        return start, done

    def _issue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def run(self, dst: torch.Tensor, src: torch.Tensor, after) -> Tuple[float, float]:
        """Copy and wait on this thread: returns (seconds waiting for the copy stream to reach
        the copy -- the producer's kernels, not copy work --, seconds of the copy itself)."""
        start, done = self.copy(dst, src, after)
        t0 = time.perf_counter()
        self.wait(start)
        t1 = time.perf_counter()
        self.wait(done)
        return t1 - t0, time.perf_counter() - t1

    @staticmethod
    def wait(event) -> None:
        """Block this thread until ``event`` completed (not the device, not other streams)."""
        event.synchronize()

    def close(self) -> None:
        """Wait for every copy issued (before the store frees its pinned buffers)."""
        self.stream.synchronize()
