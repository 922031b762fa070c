"""A CPU double of torch.cuda's stream API for the chunk store's copy stream.

``FakeCuda`` has what megatron_grpo/offload/copy_stream.py uses: ``Stream``, ``Event``,
``current_stream``, ``stream`` (a per-thread current stream) and ``synchronize``. Its default
stream runs work at once (the CPU is the "device"); work issued on any other stream is DEFERRED
until something waits for an event recorded after it (``Event.synchronize``, or another stream
that reaches a ``wait_event`` on it): as on a GPU, nothing issued there may be assumed done
before then. A device-wide ``synchronize()`` is refused: the store must wait on its own events.

``DeferringCopyStream`` is the store's real CopyStream on FakeCuda whose copy is enqueued on the
current stream (the copy stream, if CopyStream issued it under ``stream(copy_stream)``).

``log`` keeps (thread name, what, details) of every call, for tests to read.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager

import torch

from megatron_grpo.offload.copy_stream import CopyStream


class FakeEvent:
    def __init__(self, cuda, enable_timing=False):
        self.cuda, self.id, self.stream, self.done = cuda, next(cuda.ids), None, False

    def record(self, stream=None):
        stream = self.cuda.current_stream() if stream is None else stream
        self.stream = stream
        self.cuda.note("record", event=self.id, stream=stream.name,
                       current=self.cuda.current_stream().name)
        stream.push(("event", self))

    def synchronize(self):
        self.cuda.note("event_synchronize", event=self.id, stream=self.stream.name)
        self.stream.run_until(self)

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return 0.0


class FakeStream:
    def __init__(self, cuda, name, eager):
        self.cuda, self.name, self.eager = cuda, name, eager
        self.pending = []  # ("event", ev) | ("wait", ev) | ("work", fn, tensors)

    def push(self, op):
        with self.cuda.lock:
            self.pending.append(op)
            if self.eager:
                self.run_until(None)

    def wait_event(self, event):
        self.cuda.note("wait_event", stream=self.name, event=event.id)
        self.push(("wait", event))

    def enqueue(self, fn, tensors=()):
        self.cuda.note("enqueue", stream=self.name)
        self.push(("work", fn, tensors))

    def run_until(self, target):
        with self.cuda.lock:
            while self.pending:
                op = self.pending.pop(0)
                if op[0] == "event":
                    op[1].done = True
                    if op[1] is target:
                        return
                elif op[0] == "wait":
                    if not op[1].done:
                        op[1].stream.run_until(op[1])
                else:
                    op[1]()

    def pending_storages(self):
        """data_ptr of every storage that queued work here still reads or writes."""
        with self.cuda.lock:
            return {t.untyped_storage().data_ptr() for op in self.pending if op[0] == "work"
                    for t in op[2]}

    def synchronize(self):
        self.cuda.note("stream_synchronize", stream=self.name)
        self.run_until(None)


class FakeCuda:
    def __init__(self):
        self.ids = itertools.count()
        self.lock = threading.RLock()
        self.log = []
        self.default = FakeStream(self, "default", eager=True)
        self.streams = []
        self._tls = threading.local()

    def note(self, what, **details):
        self.log.append((threading.current_thread().name, what, details))

    def Stream(self, device=None, **kwargs):  # noqa: N802 - torch.cuda's name
        stream = FakeStream(self, f"side{len(self.streams)}", eager=False)
        self.streams.append(stream)
        return stream

    def Event(self, enable_timing=False, **kwargs):  # noqa: N802
        return FakeEvent(self, enable_timing)

    def current_stream(self, device=None):
        return getattr(self._tls, "current", self.default)

    @contextmanager
    def stream(self, stream):
        previous = self.current_stream()
        self._tls.current = stream
        try:
            yield
        finally:
            self._tls.current = previous

    def synchronize(self, device=None):
        raise AssertionError("a device-wide synchronize: the store must wait on its copy's event")


class DeferringCopyStream(CopyStream):
    def _issue(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.cuda.current_stream().enqueue(lambda: dst.copy_(src), (dst, src))


def factory(cuda: FakeCuda):
    """ChunkStore(copy_streams=...) argument: every device gets a DeferringCopyStream."""
    return lambda device: DeferringCopyStream(device, cuda=cuda)
