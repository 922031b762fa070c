"""What a failed checkpoint write was: "no space left on <--save>" when the disk is full, or the
open-file limit that ran out (also for a load).

A full disk reaches a save in two forms: the kernel's ENOSPC ("[Errno 28] No space left on
device", an OSError, or the text of a dist_checkpointing worker's failure), and torch.save's zip
writer, which turns the failed write into a RuntimeError that names no errno ("[enforce fail at
inline_container.cc:672] . unexpected pos 704 vs 598", or "basic_ios::clear: iostream error" when
the failure lands in a flush). The second says nothing about space, so the free space of the
filesystem is measured right after the failure: a write that ran out leaves it (nearly) full,
because the partial file is still there. Below FULL_BELOW_BYTES free, the cause is named "no
space left on <root>"; with more, the message says a write failed although there was room (a
quota, an I/O error), so the user does not go looking for space that is there.

Out of file descriptors (EMFILE: the process is at its `ulimit -n`; ENFILE: the node's table is
full) is no disk problem: freeing space or pointing --save elsewhere would not help. It reaches a
save or a load as an OSError, as torch's zip writer's RuntimeError ("open file failed with
strerror: Too many open files", no errno), as megatron's "Worker failure: [Errno 24] ..."
RuntimeError raised from the writer's OSError, or inside torch's CheckpointException, whose
failures (rank -> (exception, trace)) crossed ranks pickled, without their ``__cause__``. So the
errno is looked for in the exception, what it wraps and each rank's failure, and in their text;
the message then names the limit that ran out, its value and how to raise it.
"""

from __future__ import annotations

import errno
import functools
import os
import resource
import shutil
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from megatron_grpo.training.safety.checkpoint_dirs import CheckpointError
from megatron_grpo.training.safety.launcher_watch import open_files_problem

# torch.save's zip writer (caffe2 PyTorchStreamWriter) on a failed write.
ZIP_WRITER_FAILURES = ("unexpected pos", "file write failed", "iostream error")
NO_SPACE = (os.strerror(errno.ENOSPC), f"[Errno {errno.ENOSPC}]")
OPEN_FILES = (errno.ENFILE, errno.EMFILE)
"""Out of file descriptors; ENFILE first, as its text ("Too many open files in system") holds EMFILE's."""
FIX_DISK = "free space on its filesystem or make it writable (or point --save elsewhere)"
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


def cause_text(exc: BaseException, role: str = "writer") -> str:
    """The failure, one line: each rank's for torch's CheckpointException, else "Type: message"."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        # Every rank raises it; only the coordinator may hold the failures (rank -> (exc, trace)).
        causes = {r: str(e[0] if isinstance(e, tuple) else e) for r, e in failures.items()}
        cause = ("; ".join(f"rank {r}: {c}" for r, c in sorted(causes.items())) if causes else
                 f"the checkpoint {role} reported a failure; rank 0's error names the rank and the cause")
    else:
        cause = f"{type(exc).__name__}: {exc}"
    return " ".join(cause.split())


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


def _open_files_errno(exc: BaseException) -> Optional[int]:
    """EMFILE or ENFILE when ``exc`` itself (not what it wraps) says it ran out of descriptors:
    an OSError's errno, or the errno or strerror in its text."""
    if isinstance(exc, OSError) and exc.errno in OPEN_FILES:
        return exc.errno
    text = str(exc)
    for number in OPEN_FILES:
        if f"[Errno {number}]" in text or os.strerror(number) in text:
            return number
    return None


def out_of_files(exc: BaseException, rank: int) -> Dict[int, int]:
    """{rank: EMFILE or ENFILE} for each rank whose part of a failed save or load ran out of file
    descriptors, found in ``exc``, its ``__cause__`` and ``__context__`` chain and, for torch's
    CheckpointException, each rank's failure; what this process raised counts as ``rank``'s."""
    found: Dict[int, int] = {}
    seen = set()
    todo = [(exc, rank)]
    while todo:
        current, where = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # its text holds every rank's: read each rank's own
            todo += [(f[0] if isinstance(f, tuple) else f, int(r)) for r, f in failures.items()]
        else:
            number = _open_files_errno(current)
            if number is not None:
                found.setdefault(where, number)
        todo += [(getattr(current, "__cause__", None), where), (getattr(current, "__context__", None), where)]
    return found


def _ranks(ranks: List[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def open_files_advice(found: Dict[int, int], rank: int) -> str:
    """Which open-file limit ran out where (``found`` from ``out_of_files``, seen on ``rank``),
    its value on this rank and how to raise it."""
    said = []
    for number in OPEN_FILES:
        ranks = sorted(r for r, n in found.items() if n == number)
        if not ranks:
            continue
        if ranks == [rank]:  # this process: launcher_watch's words, with this process's limit
            said.append(open_files_problem(OSError(number, os.strerror(number))))
        elif number == errno.ENFILE:
            said.append(f"the open-file table of the node of {_ranks(ranks)} is full (ENFILE, errno "
                        f"{number}: {os.strerror(number)}): other processes on that node hold too many "
                        f"files open; close them, or raise the node's limit (sysctl fs.file-max)")
        else:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            whose = "its" if len(ranks) == 1 else "their"
            said.append(f"{_ranks(ranks)} reached {whose} open-file limit (EMFILE, errno {number}: "
                        f"{os.strerror(number)}; `ulimit -n` is {soft} on rank {rank}, hard "
                        f"limit {hard}); raise it before the job starts, e.g. `ulimit -n 65536` in the "
                        f"sbatch script (up to the hard limit; above it needs the node's limits.conf)")
    return "; ".join(said)


def what_to_do(exc: BaseException, rank: int) -> str:
    """For a save that failed with ``exc`` on ``rank``: raise the open-file limit that ran out
    (which one, its value), or free the disk (the sentence, capitalised). A CheckpointException
    whose other ranks failed otherwise gets both."""
    found = out_of_files(exc, rank)
    if not found:
        return FIX_DISK[0].upper() + FIX_DISK[1:]
    todo = open_files_advice(found, rank)
    failures = getattr(exc, "failures", None)
    others = sorted(int(r) for r in failures if int(r) not in found) if isinstance(failures, dict) else []
    if others:
        todo += f"; for {_ranks(others)}: {FIX_DISK}"
    return todo[0].upper() + todo[1:]


def names_open_file_limit(flag: str) -> Callable:
    """Decorator of a checkpoint load ``fn(path, ...)``: a load that runs out of file descriptors
    raises CheckpointError naming the rank, the limit, its value and how to raise it, instead of
    leaving torch's CheckpointException or a bare OSError to end the run with a traceback."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def load(path: str, *args, **kwargs):
            try:
                return fn(path, *args, **kwargs)
            except BaseException as exc:  # torch's CheckpointException is no Exception
                rank = dist.get_rank() if dist.is_initialized() else 0
                found = out_of_files(exc, rank)
                if not found:
                    raise
                advice = open_files_advice(found, rank)
                raise CheckpointError(
                    f"{flag} {path}: reading the checkpoint failed on rank {rank} "
                    f"({cause_text(exc, 'reader')}). {advice[0].upper() + advice[1:]}; a load writes "
                    f"nothing, so the checkpoint is as it was: run again with the same {flag}.") from exc
        return load
    return decorate
