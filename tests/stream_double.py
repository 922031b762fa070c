"""A CUDA-stream stand-in for CPU tests that fails where the caching allocator could hand out
memory a pending kernel still uses.

On a GPU, kernels queued on a side stream run later and out of order with the main stream. The
caching allocator gives a freed block to the next allocation on the stream that allocated it
(its home) at once, unless the tensor was marked with ``record_stream`` for the other stream
(reuse then waits for that stream's queued work) or the home stream has waited for the other
one since the use. So a storage may be freed only when every use on a stream other than its
home is joined (home waited for it: ``wait_stream`` / ``wait_event``) or recorded.

``StreamDouble`` models exactly that on CPU:

* ``side`` and ``main`` streams with ``wait_stream``, ``record_event`` / ``wait_event``; the
  controller-shaped hooks (``install(ctrl)``: side_stream, current_stream, stream_context) as in
  tests/multiproc/grpo_probe.py;
* a TorchDispatchMode sees every kernel (aten op, views excluded) issued while a stream is
  current, and which storages it reads and writes; a storage first produced by a kernel (or
  allocated by ``UntypedStorage.resize_``) inside a stream's context has that stream as home,
  anything else is the main stream's;
* ``megatron_grpo.comm.streams.used_on_current_stream`` is replaced: it records the current
  stream on the tensors' storages, as ``record_stream`` does;
* ``UntypedStorage.resize_(0)`` (how GRPO frees a storage it keeps the tensor of) raises
  ``StreamHazard`` when the storage has a use on another stream that is neither joined by the
  home stream nor recorded;
* a kernel that writes a storage another stream has a pending (not waited for) use of, or reads
  one another stream has a pending write to, raises ``StreamHazard``: the reuse of a buffer
  while a pending kernel still reads or writes it, a race whatever the allocator does
  (``check_races=False`` turns this off where it over-reports: storages are tracked whole, so
  two streams using different views of one buffer, megatron's buckets of one gradient buffer,
  look like a race).
* ``log`` is the timeline, in issue order: ``enter:S`` / ``exit:S`` (a stream made current and
  left), ``kernel:S:op`` and ``collective:S:op`` (a c10d op, issued while S is current),
  ``A<-B`` (``wait_stream``), ``record:S#n`` (an event recorded), ``A<-event:S#n``
  (``wait_event``), ``A<-collective`` (a collective's ``Work.wait()`` while A is current: with
  NCCL, stream A then waits for the collective and the host does not; with gloo the host
  blocks), ``record_stream:S`` (``used_on_current_stream``) and ``synchronize:...`` (a host
  wait on a stream or an event: what a sync path must not do).
* A ``Work.wait()`` is modelled as NCCL's: the current stream waits for the collectives issued
  so far, up to their issue point on the stream that issued them (the double cannot tell which
  work object belongs to which collective, so it credits them all: an over-approximation).

Only the thread that entered the double is tracked (the offload store's copy threads are not).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_grpo.comm import streams as grpo_streams


class StreamHazard(AssertionError):
    """A free or a kernel that a GPU could run while another stream's kernel uses the memory."""


class FakeEvent:
    def __init__(self, stream: "FakeStream", seq: int, number: int) -> None:
        self.stream, self.seq, self.number = stream, seq, number
        self.name = f"{stream.name}#{number}"

    def synchronize(self) -> None:
        self.stream.double.log.append(f"synchronize:event:{self.name}")


class FakeStream:
    def __init__(self, double: "StreamDouble", name: str) -> None:
        self.double, self.name, self.seq = double, name, 0

    def wait_stream(self, other: "FakeStream") -> None:
        self.double.log.append(f"{self.name}<-{other.name}")
        self.double._seen_up_to(self, other, other.seq)

    def record_event(self, event=None) -> FakeEvent:
        self.double.events += 1
        event = FakeEvent(self, self.seq, self.double.events)
        self.double.log.append(f"record:{event.name}")
        return event

    def wait_event(self, event: FakeEvent) -> None:
        self.double.log.append(f"{self.name}<-event:{event.name}")
        self.double._seen_up_to(self, event.stream, event.seq)

    def synchronize(self) -> None:
        self.double.log.append(f"synchronize:stream:{self.name}")

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Kernels(TorchDispatchMode):
    def __init__(self, double: "StreamDouble") -> None:
        super().__init__()
        self.double = double

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:
            self.double._kernel(func, args, kwargs, out)
        return out


class StreamDouble:
    """See the module docstring. Use as a context manager; ``on(stream)`` makes it current."""

    def __init__(self, check_races: bool = True) -> None:
        self.check_races = check_races
        self.main, self.side = FakeStream(self, "main"), FakeStream(self, "side")
        self.log = []
        self.events = 0  # events recorded so far (their numbers in the log)
        self._collectives: Dict["FakeStream", int] = {}  # stream -> seq of its last collective
        self.cross_stream_frees = 0  # frees that were safe only because of record_stream
        self._current = self.main
        self._thread = None
        self._home: Dict[int, FakeStream] = {}
        # storage -> stream -> (seq of its last use, seq of its last write) on that stream
        self._uses: Dict[int, Dict[FakeStream, Tuple[int, int]]] = {}
        self._recorded: Dict[int, Set[FakeStream]] = {}
        self._seen: Dict[Tuple[FakeStream, FakeStream], int] = {}
        self._stack = contextlib.ExitStack()

    # ---- what production code sees ----------------------------------------------------------
    @contextlib.contextmanager
    def on(self, stream: FakeStream):
        previous, self._current = self._current, stream
        self.log.append(f"enter:{stream.name}")
        try:
            yield
        finally:
            self._current = previous
            self.log.append(f"exit:{stream.name}")

    def install(self, ctrl) -> None:
        """Replace a GRPOController's streams (CPU has none) by this double's."""
        ctrl.side_stream = self.side
        ctrl.current_stream = lambda: self._current
        ctrl.stream_context = self.on

    def record_use(self, *tensors) -> None:
        """Stands in for megatron_grpo.comm.streams.used_on_current_stream (record_stream)."""
        if not self._tracked():
            return
        for t in tensors:
            if t is not None:
                self._recorded.setdefault(_key(t), set()).add(self._current)
                self.log.append(f"record_stream:{self._current.name}")

    def recorded_streams(self, t: torch.Tensor) -> Set[str]:
        """Names of the streams ``record_stream`` marked ``t``'s storage as used on (until freed)."""
        return {s.name for s in self._recorded.get(_key(t), ())}

    def _work_waited(self) -> None:
        """A collective's ``Work.wait()``: see the module docstring."""
        if not self._tracked():
            return
        self.log.append(f"{self._current.name}<-collective")
        for stream, seq in self._collectives.items():
            self._seen_up_to(self._current, stream, seq)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _tracked(self) -> bool:
        return threading.current_thread() is self._thread

    def _seen_up_to(self, waiter: FakeStream, other: FakeStream, seq: int) -> None:
        pair = (waiter, other)
        self._seen[pair] = max(self._seen.get(pair, 0), seq)

    def _pending(self, on: FakeStream, other: FakeStream, seq: int) -> bool:
        """Is work issued on ``other`` at ``seq`` possibly still queued, as seen from ``on``?"""
        return other is not on and seq > self._seen.get((on, other), 0)

    def _kernel(self, func, args, kwargs, out) -> None:
        if not self._tracked():
            return
        stream = self._current
        stream.seq += 1
        collective = func.namespace == "c10d"
        self.log.append(f"{'collective' if collective else 'kernel'}:{stream.name}:{func}")
        if collective:
            self._collectives[stream] = stream.seq
        schema = func._schema.arguments
        inputs: Dict[int, bool] = {}
        for i, arg in enumerate(args):
            written = i < len(schema) and schema[i].alias_info is not None and schema[i].alias_info.is_write
            for t in tree_leaves(arg):
                if isinstance(t, torch.Tensor):
                    inputs[_key(t)] = inputs.get(_key(t), False) or bool(written)
        for name, arg in kwargs.items():
            spec = next((a for a in schema if a.name == name), None)
            written = spec is not None and spec.alias_info is not None and spec.alias_info.is_write
            for t in tree_leaves(arg):
                if isinstance(t, torch.Tensor):
                    inputs[_key(t)] = inputs.get(_key(t), False) or bool(written)
        for key, written in inputs.items():
            for other, (used, wrote) in (self._uses.get(key, {}).items() if self.check_races else ()):
                if (written and self._pending(stream, other, used)) or self._pending(stream, other, wrote):
                    raise StreamHazard(
                        f"{func} on the {stream.name} stream {'writes' if written else 'reads'} a "
                        f"storage the {other.name} stream's queued work still "
                        f"{'writes' if wrote == used else 'uses'}, and {stream.name} has not "
                        f"waited for {other.name} since (wait_stream / wait_event)")
            last_use, last_write = self._uses.setdefault(key, {}).get(stream, (0, 0))
            self._uses[key][stream] = (stream.seq, stream.seq if written else last_write)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) not in inputs:
                key = _key(t)  # a fresh allocation, made by the current stream
                self._home[key] = stream
                self._uses[key] = {stream: (stream.seq, stream.seq)}
                self._recorded.pop(key, None)

    def _resize(self, storage, nbytes: int) -> None:
        if not self._tracked():
            return
        key = storage._cdata
        if nbytes > 0:
            if storage.nbytes() == 0:  # a new block, from the current stream's pool
                self._home[key] = self._current
                self._uses.pop(key, None)
                self._recorded.pop(key, None)
            return
        home = self._home.get(key, self.main)
        recorded = self._recorded.get(key, set())
        for other, (used, _) in self._uses.get(key, {}).items():
            if not self._pending(home, other, used):
                continue
            if other not in recorded:
                raise StreamHazard(
                    f"storage freed (resize_(0)) while work queued on the {other.name} stream "
                    f"still uses it: it was allocated by the {home.name} stream, which has not "
                    f"waited for {other.name} since, and no record_stream ("
                    f"megatron_grpo.comm.streams.used_on_current_stream) covers that use. The "
                    f"caching allocator can hand the block to the next {home.name}-stream "
                    f"allocation before the queued kernel ran.")
            self.cross_stream_frees += 1
        self._uses.pop(key, None)
        self._recorded.pop(key, None)
        self._home.pop(key, None)

    # ---- context manager ------------------------------------------------------------------------
    def __enter__(self) -> "StreamDouble":
        self._thread = threading.current_thread()
        double, original = self, torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            double._resize(storage, int(nbytes))  # checked before the block is given back
            return original(storage, nbytes)

        torch.UntypedStorage.resize_ = resize_
        self._stack.callback(setattr, torch.UntypedStorage, "resize_", original)
        helper = grpo_streams.used_on_current_stream
        grpo_streams.used_on_current_stream = self.record_use
        self._stack.callback(setattr, grpo_streams, "used_on_current_stream", helper)
        work = getattr(getattr(torch, "distributed", None), "distributed_c10d", None)
        work = getattr(work, "Work", None)
        if work is not None:
            wait = work.wait

            def traced_wait(w, *args, **kwargs):
                double._work_waited()
                return wait(w, *args, **kwargs)

            work.wait = traced_wait
            self._stack.callback(setattr, work, "wait", wait)
        self._stack.enter_context(_Kernels(self))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
