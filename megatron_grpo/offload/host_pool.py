"""HostPool: the host buffers of chunks in the ``cpu`` location, reused.

A chunk evicted to host memory needs a host buffer of its size for as long as it is away; when
it comes back to the device that buffer is free. The store used to allocate a fresh one for
every eviction: on CUDA a fresh pinned buffer (page-locking is slow, and CUDA copies from
pageable memory are not asynchronous). The pool keeps up to ``limit`` free buffers, by exact
size (the chunks of one tensor, and the same-shaped tensors of every layer, share sizes), and
hands them to the next evictions. Buffers beyond the limit are dropped, so idle host memory is
at most ``limit`` chunks; ``close()`` drops all.

A buffer is given back only after the copy that read it has landed (the store's worker waited
for the copy's event first), so a reused buffer is never written while a copy still reads it.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List

import torch


class HostPool:
    """Free host buffers by size, at most ``limit`` of them kept."""

    def __init__(self, limit: int, pinned: bool, alloc: Callable[[int, bool], torch.Tensor]):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"offload: HostPool(limit=...) must be an integer >= 0, got {limit!r}")
        self.limit, self.pinned, self._alloc = limit, pinned, alloc
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.idle = 0  # free buffers kept now
        self.allocated = 0  # buffers ever allocated (the tests' count)
        self.reused = 0  # takes served from the pool

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.idle -= 1
                self.reused += 1
                return free.pop()
            self.allocated += 1
        return self._alloc(nbytes, self.pinned)

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` is free (no copy reads or writes it any more): keep it if there is room."""
        with self._lock:
            if self.idle < self.limit:
                self._free.setdefault(buf.numel(), []).append(buf)
                self.idle += 1

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self.idle = 0

    def stats(self) -> dict:
        with self._lock:
            return {"limit": self.limit, "idle": self.idle, "allocated": self.allocated,
                    "reused": self.reused}
