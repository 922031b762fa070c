"""The SSD tier's file (one preallocated file per rank, cut into 4096-aligned extents) and the
bounded pool of aligned host buffers that every transfer to or from it goes through.

Why it looks like this (pains users of other offload engines report):
- the name is deterministic per rank (grpo-offload-rank00003.bin), so a rerun finds and replaces
  its own file instead of leaving unreloadable swap files behind; an exclusive flock stops two
  live jobs sharing one;
- the size is allocated up front with posix_fallocate, so "disk full" is found at construction,
  not in the middle of a run, and the file is never a wrong-size sparse file;
- every extent starts on a 4096 boundary and is a multiple of 4096 long, so O_DIRECT works; a
  chunk that is not a multiple of 4096 is zero-padded in the file and read back at its exact
  length by the caller, so nothing is truncated to the block size;
- reads and writes loop over short transfers and raise on end-of-file, never return partial data;
- staging buffers are few and reused, so pinned host memory cannot grow with the work in flight;
- the file is mapped once, however many tensors a checkpoint reads through the map: every mmap
  holds a descriptor of its own (and counts against vm.max_map_count), so one map per tensor
  made a large model's save die on the open-file limit (`ulimit -n`, often 1024);
- running out of descriptors is named as that (the limit, its value, how to raise it), never as
  a bad offload directory or a filesystem without O_DIRECT.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import mmap
import os
import resource
import stat
import threading
import weakref
from contextlib import contextmanager
from typing import List, Optional, Tuple

import torch

from .config import ALIGN

SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
ACCESS_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)
FD_ERRNOS = (errno.EMFILE, errno.ENFILE)


class OffloadError(RuntimeError):
    """Base of every error the chunk store raises; the message says what to do."""


class OffloadDirError(OffloadError):
    """The offload directory cannot hold this rank's file (missing, not a directory, unwritable,
    too small, or in use by another process)."""


class OffloadCapacityError(OffloadError):
    """The preallocated file has no free extent left for a chunk."""


class OffloadOpenFilesError(OffloadError):
    """This process (EMFILE) or the whole node (ENFILE) is out of file descriptors: the offload
    directory itself may be fine, so no fallback to host memory hides it."""


def open_files_error(exc: OSError, rank: int, what: str) -> OffloadOpenFilesError:
    """The error for ``exc`` (EMFILE or ENFILE) raised while ``what``: the limit that was hit, its
    value, and how to raise it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if exc.errno == errno.ENFILE:
        cause = (f"the node's open-file table is full (ENFILE, errno {errno.ENFILE}: {exc.strerror}): "
                 f"other processes on this node hold too many files open. Close them, or raise the "
                 f"node's limit (sysctl fs.file-max)")
    else:
        cause = (f"this process has reached its open-file limit (EMFILE, errno {errno.EMFILE}: "
                 f"{exc.strerror}; `ulimit -n` is {soft} here, hard limit {hard}). Raise it before "
                 f"the job starts, e.g. `ulimit -n 65536` in the sbatch script (up to the hard "
                 f"limit; above it needs the node's limits.conf)")
    return OffloadOpenFilesError(f"offload (rank {rank}): {what} failed: {cause}.")


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def file_name(rank: int) -> str:
    return f"grpo-offload-rank{rank:05d}.bin"


def _bytes_text(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes} bytes ({nbytes / (1 << 30):.1f} GiB)"
    return f"{nbytes} bytes ({nbytes / (1 << 20):.1f} MiB)"


def _dir_error(directory: str, rank: int, needed: int, problem: str) -> OffloadDirError:
    return OffloadDirError(
        f"offload (rank {rank}): cannot use offload directory {directory!r} for the SSD tier: "
        f"{problem}. This rank needs {_bytes_text(needed)} there for {file_name(rank)}. Set "
        f"--grpo-offload-dir (OffloadConfig.offload_dir) to a writable local disk with that much "
        f"free space, or use --grpo-offload-fallback cpu to keep these chunks in host memory.")


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``, looping over short writes (the tests patch this)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite returned {n} at offset {offset + done}")
        done += n


def pread_all(fd: int, into: memoryview, offset: int) -> None:
    """Fill ``into`` from ``offset``, looping over short reads; end of file is an error."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of file at offset {offset + done} "
                                     f"({len(into) - done} bytes missing): the file was truncated")
        done += n


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory is page-aligned, which is what O_DIRECT needs."""
    return mmap.mmap(-1, max(nbytes, ALIGN))


def host_tensor(nbytes: int, pinned: bool) -> torch.Tensor:
    """Host memory for copies and staging: pinned when CUDA is there (async-capable copies)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class StagingPool:
    """At most ``count`` reusable, 4096-aligned host buffers of ``nbytes`` each.

    Buffers are made on first need and kept; ``peak_in_use`` and ``allocated`` are the
    instrumentation the tests read. ``fit(n)`` lowers ``nbytes`` to what the largest chunk
    needs before any buffer exists (and grows it later, never past the limit given at
    construction): a store of 128 MB chunks over tensors of a few MB stages in buffers of a few
    MB, which matters where staging shares host memory with training (a CPU run)."""

    def __init__(self, count: int, nbytes: int, pinned: bool):
        self.count, self.nbytes, self.pinned = count, nbytes, pinned
        self.limit = nbytes
        self._fitted = False
        self.allocated = 0
        self.in_use = 0
        self.peak_in_use = 0
        self._free: List[torch.Tensor] = []
        self._cond = threading.Condition()

    def fit(self, largest: int) -> None:
        """Size buffers for chunks of at most ``largest`` bytes (aligned, capped at the limit).
        Free buffers that are too small are dropped; ones in use are dropped when returned."""
        want = min(self.limit, -(-largest // ALIGN) * ALIGN)
        with self._cond:
            if self._fitted and want <= self.nbytes:
                return
            self._fitted = True
            self.nbytes = want
            kept = [b for b in self._free if b.numel() >= want]
            self.allocated -= len(self._free) - len(kept)
            self._free = kept
            self._cond.notify_all()

    def _new_buffer(self) -> torch.Tensor:
        # over-allocate by one alignment unit and slice, so the buffer start suits O_DIRECT
        # for pinned and ordinary memory alike
        raw = host_tensor(self.nbytes + ALIGN, self.pinned)
        start = (-raw.data_ptr()) % ALIGN
        return raw[start:start + self.nbytes]

    @contextmanager
    def buffer(self):
        with self._cond:
            while not self._free and self.allocated >= self.count:
                self._cond.wait()
            buf = self._free.pop() if self._free else None
            if buf is None:
                self.allocated += 1  # reserve the slot, allocate outside the lock
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        try:
            if buf is None:
                buf = self._new_buffer()
            yield buf
        finally:
            with self._cond:
                self.in_use -= 1
                if buf is not None and buf.numel() >= self.nbytes:
                    self._free.append(buf)
                else:
                    self.allocated -= 1  # allocation failed, or too small since fit()
                self._cond.notify()


def _open_direct(path: str, rank: int) -> Tuple[Optional[int], str]:
    """An O_DIRECT descriptor of ``path`` if the filesystem accepts it, else (None, why not).

    Some filesystems refuse the flag at open (EINVAL), others only at the first transfer, so one
    aligned block is written and read back before the mode is trusted. Out of descriptors is
    raised: it says nothing about the filesystem, and buffered I/O would hide it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None, "O_DIRECT is not available on this platform"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | flag)
    except OSError as exc:
        if exc.errno in FD_ERRNOS:
            raise open_files_error(exc, rank, f"opening the SSD tier's file {path} for O_DIRECT") from exc
        return None, f"open with O_DIRECT failed: {exc}"
    probe = aligned_buffer(ALIGN)
    try:
        pwrite_all(fd, memoryview(probe), 0)
        pread_all(fd, memoryview(probe), 0)
    except OSError as exc:
        os.close(fd)
        return None, f"an aligned O_DIRECT transfer failed: {exc}"
    finally:
        probe.close()
    return fd, ""


class ExtentAllocator:
    """First-fit allocation of aligned extents in [0, size), coalescing freed neighbours.

    Chunks are mostly one size, so first-fit keeps the file dense without a smarter scheme."""

    def __init__(self, size: int):
        self.size = size
        self.used = 0
        self._free: List[Tuple[int, int]] = [(0, size)] if size else []  # sorted (offset, length)

    def allocate(self, nbytes: int) -> Optional[int]:
        length = align_up(nbytes)
        for i, (offset, free) in enumerate(self._free):
            if free >= length:
                if free == length:
                    del self._free[i]
                else:
                    self._free[i] = (offset + length, free - length)
                self.used += length
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        length = align_up(nbytes)
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, length))
        self.used -= length
        # merge with the right neighbour, then the left one
        if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:
            self._free[i] = (offset, length + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev_offset, prev_length = self._free[i - 1]
            self._free[i - 1] = (prev_offset, prev_length + self._free.pop(i)[1])


class SlotFile:
    """This rank's preallocated offload file. Thread-safe: pread/pwrite carry their offsets."""

    def __init__(self, directory: str, rank: int, capacity: int, io_mode: str = "direct"):
        self.directory = directory
        self.rank = rank
        self.size = align_up(capacity)
        self.path = os.path.join(directory, file_name(rank))
        self.direct_fallback_reason = ""
        self._check_directory()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in FD_ERRNOS:
                raise open_files_error(exc, rank, f"opening the SSD tier's file {self.path}") from exc
            problem = "it is not writable" if exc.errno in ACCESS_ERRNOS else "cannot create a file"
            raise _dir_error(directory, rank, self.size, f"{problem} ({exc})") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)  # the file belongs to the process holding the lock: leave it
            raise _dir_error(directory, rank, self.size,
                             f"{self.path} is in use by another process (two jobs with the same "
                             f"offload directory and rank?)") from exc
        try:
            self._allocate()
            self._io_fd, self.io_mode = self._fd, "buffered"
            if io_mode == "direct":
                direct_fd, why = _open_direct(self.path, rank)
                if direct_fd is None:
                    self.direct_fallback_reason = why
                else:
                    self._io_fd, self.io_mode = direct_fd, "direct"
        except BaseException:
            # we hold the lock, so the file (new or a stale one of an earlier run) is ours
            os.close(self._fd)
            _unlink_quietly(self.path)
            raise
        self.extents = ExtentAllocator(self.size)
        # The file's one map while a view of it lives (``map``); a weak reference, so the map
        # goes (and its pages leave the resident set) with the last view, as a checkpoint's
        # tensors are dropped after the save.
        self._whole: Optional[weakref.ref] = None
        self._map_lock = threading.Lock()
        self.closed = False

    def _check_directory(self) -> None:
        try:
            mode = os.stat(self.directory).st_mode
        except FileNotFoundError as exc:
            raise _dir_error(self.directory, self.rank, self.size, "it does not exist") from exc
        except NotADirectoryError as exc:
            raise _dir_error(self.directory, self.rank, self.size,
                             "a component of the path is a regular file, not a directory") from exc
        except OSError as exc:
            raise _dir_error(self.directory, self.rank, self.size, f"stat failed ({exc})") from exc
        if not stat.S_ISDIR(mode):
            raise _dir_error(self.directory, self.rank, self.size, "it is not a directory")

    def _allocate(self) -> None:
        # Drop a stale file's content first so its old blocks do not count against the new size.
        os.ftruncate(self._fd, 0)
        try:
            os.posix_fallocate(self._fd, 0, self.size)
        except OSError as exc:
            if exc.errno not in SPACE_ERRNOS:
                raise _dir_error(self.directory, self.rank, self.size,
                                 f"allocating the file failed ({exc})") from exc
            vfs = os.statvfs(self.directory)
            free = _bytes_text(vfs.f_bavail * vfs.f_frsize)
            raise _dir_error(self.directory, self.rank, self.size,
                             f"not enough space ({free} free; {exc})") from exc

    def write(self, data: memoryview, offset: int) -> None:
        """Write an aligned, padded extent (len(data) a multiple of 4096)."""
        pwrite_all(self._io_fd, data, offset)

    def read(self, into: memoryview, offset: int) -> None:
        pread_all(self._io_fd, into, offset)

    def map(self, offset: int, length: int) -> torch.Tensor:
        """``length`` bytes from ``offset`` as a uint8 host tensor backed by the file
        (ChunkStore.host_bytes: a checkpoint reads away state through it, so the bytes reach host
        memory only as page cache, while the writer reads them).

        Every tensor is a view of one private map of the whole file, made on the first call and
        kept while any view lives. A map per tensor would hold a descriptor per tensor (Python's
        mmap keeps a dup of the one it maps): a save of tens of thousands of tensors ran out of
        descriptors under `ulimit -n 1024` (and each map counts against vm.max_map_count).
        Mapping the whole file costs address space only: MAP_NORESERVE, because a private
        writable map is otherwise charged as memory the process may write, and the kernel's
        overcommit check refuses one larger than memory (the file can be).

        Copy-on-write: a write to a view never reaches the file. Through the buffered
        descriptor; O_DIRECT writes invalidate the cached pages they cover, so reads see what
        the store wrote. Raises OSError where the filesystem cannot map its files."""
        if offset < 0 or length <= 0 or offset + length > self.size:
            raise ValueError(f"offload (rank {self.rank}): map of {length} bytes at {offset} is "
                             f"outside {self.path} ({self.size} bytes)")
        with self._map_lock:
            whole = self._whole() if self._whole is not None else None
            if whole is None:
                whole = mmap.mmap(self._fd, self.size,
                                  flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self._whole = weakref.ref(whole)
        # The view exports the map's buffer, which keeps the map alive as long as the view.
        return torch.frombuffer(whole, dtype=torch.uint8, count=length, offset=offset)

    def drop_pages(self, offset: int, length: int) -> None:
        """Take the map's pages over [offset, offset + length) out of this process's resident set
        (and discard private copies a write to a view made there): a later read maps them in
        again from the page cache or the file. Nothing happens while no view is alive."""
        whole = self._whole() if self._whole is not None else None
        if whole is None:
            return
        start = offset - offset % mmap.PAGESIZE  # madvise needs a page boundary
        whole.madvise(mmap.MADV_DONTNEED, start, length + offset - start)

    def close(self, remove: bool = True) -> None:
        """Close the descriptors and (by default) delete the file: its content is scratch that
        no later run can use."""
        if self.closed:
            return
        self.closed = True
        # Not unmapped here: a checkpoint may still hold views (the map holds its own
        # descriptor, and the file's content, until the last view goes).
        self._whole = None
        if self._io_fd != self._fd:
            os.close(self._io_fd)
        if remove:
            _unlink_quietly(self.path)  # before the lock goes, so no other process loses its file
        os.close(self._fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
