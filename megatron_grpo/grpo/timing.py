"""Per-step interval timers that measure device time on GPU and host time on CPU.

GRPO reports two times per step: importance computation and time spent waiting for
communication (RU = 1 - wait / step). On GPU both are asynchronous CUDA work: a host
``perf_counter`` around them reads the launch time of the kernels (importance ~0 s) or nothing
(``handle.wait()`` returns as soon as the stream dependency is queued, so RU reads ~1). So on
CUDA each interval records a pair of CUDA events on the stream the work runs on, and the
elapsed times are read once, at the end of the step, when the metrics are written (the only
host sync they cost). On CPU (gloo, CPU mode) the work is synchronous and host time is right.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Optional, Tuple


class IntervalTimer:
    """Sum of the intervals timed since the last ``reset``, in seconds.

    ``event_factory`` (``torch.cuda.Event`` on GPU; any class with ``record()``,
    ``synchronize()`` and ``elapsed_time(other)`` in milliseconds) switches to device timing;
    None times on the host.
    """

    def __init__(self, event_factory: Optional[Callable] = None) -> None:
        self.event_factory = event_factory
        self._host_s = 0.0
        self._pairs: List[Tuple[object, object]] = []

    @property
    def on_device(self) -> bool:
        return self.event_factory is not None

    @contextlib.contextmanager
    def time(self):
        """Time the block: on the current stream (device) or on the host."""
        if self.event_factory is None:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host_s += time.perf_counter() - t0
            return
        start, end = self.event_factory(enable_timing=True), self.event_factory(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._pairs.append((start, end))

    def total_s(self) -> float:
        """Seconds timed so far this step (waits for the recorded device events)."""
        total = self._host_s
        for start, end in self._pairs:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total

    def reset(self) -> None:
        self._host_s = 0.0
        self._pairs = []
