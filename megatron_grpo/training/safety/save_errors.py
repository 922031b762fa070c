"""What a failed checkpoint write was: "no space left on <--save>" when the disk is full.

A full disk reaches a save in two forms: the kernel's ENOSPC ("[Errno 28] No space left on
device", an OSError, or the text of a dist_checkpointing worker's failure), and torch.save's zip
writer, which turns the failed write into a RuntimeError that names no errno ("[enforce fail at
inline_container.cc:672] . unexpected pos 704 vs 598", or "basic_ios::clear: iostream error" when
the failure lands in a flush). The second says nothing about space, so the free space of the
filesystem is measured right after the failure: a write that ran out leaves it (nearly) full,
because the partial file is still there. Below FULL_BELOW_BYTES free, the cause is named "no
space left on <root>"; with more, the message says a write failed although there was room (a
quota, an I/O error), so the user does not go looking for space that is there.
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Optional

# torch.save's zip writer (caffe2 PyTorchStreamWriter) on a failed write.
ZIP_WRITER_FAILURES = ("unexpected pos", "file write failed", "iostream error")
NO_SPACE = (os.strerror(errno.ENOSPC), f"[Errno {errno.ENOSPC}]")
FULL_BELOW_BYTES = 64 << 20
"""Free bytes under which a failed write is put down to a full disk. A write that ran out of
space leaves the filesystem full to the block (its partial file stays until the next save
replaces it), so this only needs to be above a few blocks and below any free space that could
make a checkpoint fit; 64 MiB is less than one shard of any real model."""


def is_zip_writer_failure(exc: BaseException) -> bool:
    """A RuntimeError from torch.save's zip writer failing to write (full disk, I/O error)."""
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in ZIP_WRITER_FAILURES)


def free_bytes(path: str) -> Optional[int]:
    """Free bytes (for this user) on the filesystem holding ``path`` or its nearest existing
    parent; None if it cannot be measured."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def explain(root: str, cause: str) -> str:
    """``cause`` (the failure text, one line) led by "no space left on <root>" when the write ran
    out of space, or followed by the free space when torch's writer failed with room left."""
    no_space = any(m in cause for m in NO_SPACE)
    zip_writer = any(m in cause for m in ZIP_WRITER_FAILURES)
    if not (no_space or zip_writer):
        return cause
    free = free_bytes(root)
    if no_space or (free is not None and free < FULL_BELOW_BYTES):
        measured = f"{free} bytes free after the failure" if free is not None else "free space not measurable"
        return f"no space left on {root}: {measured}; {cause}"
    if free is None:
        return cause
    return (f"{cause}; a write failed with {free} bytes free on {root} after the failure, so not for "
            f"lack of space (a quota, an I/O error)")
