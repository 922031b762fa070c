"""A chunk of the store (megatron_grpo/offload/store.py): where its one valid copy is, and the
errors a move of it raises."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .slot_file import OffloadError


class OffloadIOError(OffloadError):
    """A background move failed (disk full, I/O error ...); the chunk stayed where it was."""


class OffloadChecksumError(OffloadError):
    """A chunk read back from the file does not match the checksum taken when it was written."""


@dataclass
class _Chunk:
    id: int
    name: str
    index: int
    count: int  # chunks of this tensor
    view: torch.Tensor  # uint8 view of the chunk's bytes in the registered tensor
    location: str = "device"
    host: Optional[torch.Tensor] = None
    offset: Optional[int] = None  # file offset while on ssd
    crc: Optional[int] = None
    tail: Optional[cf.Future] = None  # the last move asked for; the next one chains behind it
    shadow: bool = False  # on device, and its file extent still holds the same bytes

    @property
    def nbytes(self) -> int:
        return self.view.numel()

    def describe(self) -> str:
        return (f"chunk {self.id} (tensor {self.name!r}, chunk {self.index + 1} of {self.count}, "
                f"{self.nbytes} bytes)")


class _Clock:
    """A move's busy time, less what it spent waiting for the producer's kernels."""

    def __init__(self):
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds


def land(dst: torch.Tensor, src: torch.Tensor, copy: Optional[Tuple], clock: _Clock) -> None:
    """dst <- src, landed when this returns. On a copy stream (``copy``: the stream and the event
    to come after) the worker waits for the copy's events (its thread only); the time the stream
    waited for the producer's kernels is not copy time."""
    if copy is None:
        dst.copy_(src)
        return
    stream, mark = copy
    waited, _ = stream.run(dst, src, mark)
    clock.exclude(waited)
