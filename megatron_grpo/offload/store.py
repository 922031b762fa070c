"""ChunkStore: fixed-size chunks of flat tensors moved between device, host memory and SSD.

A registered tensor keeps its storage; the store only moves copies of its chunks. A chunk's
*location* is where its one valid copy is: ``device`` (the tensor itself), ``cpu`` (a host copy,
pinned when CUDA is available) or ``ssd`` (an extent of this rank's preallocated file). After an
evict completes the device bytes of that chunk are the caller's to reuse; ``prefetch`` writes the
chunk back into exactly those bytes, bit for bit.

Every move runs on a small thread pool and returns a Future; moves of one chunk run in the order
they were asked for (each is chained behind the previous one), moves of different chunks run in
parallel. The caller never blocks: workers wait for a staging buffer, and there are at most
``staging_buffers`` of them, so host memory used for staging is bounded whatever is in flight.

A move that fails leaves the chunk where it was, valid; its error is set on the Future and kept
for ``check()``/``wait_all()``, so nothing fails silently. Training uses it through
offload/placement.py and offload/residuals.py (docs/offload.md).

On CUDA, device <-> host copies run on the store's own copy stream, ordered by events against
the stream of the thread that asked for the move (offload/copy_stream.py has the rules), so
they overlap training's kernels; a move's Future completes only once its copy has landed. Host
copies of chunks in ``cpu`` come from a bounded pool of reused (pinned) buffers
(offload/host_pool.py). On CPU neither is used: copies are plain ``copy_`` calls.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import warnings
import zlib
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .config import OffloadConfig
from .copy_stream import CopyStream
from .host_pool import HostPool
from .chunk import OffloadChecksumError, OffloadIOError, _Chunk, _Clock, land  # noqa: F401  (re-exported)
from .slot_file import (OffloadCapacityError, OffloadDirError, OffloadError, SlotFile,
                        StagingPool, align_up, host_tensor)

LOCATIONS = ("device", "cpu", "ssd")
DIRECTIONS = ("device_to_cpu", "cpu_to_device", "to_ssd", "from_ssd")
# Free pinned host buffers kept for the next evictions to host memory (CUDA). On CPU none are
# kept: plain host memory is cheap to allocate, and a kept buffer is resident-set memory.
HOST_POOL_BUFFERS = 8


class ChunkStore:
    """Device / host / SSD chunk store of one rank. See the module docstring and docs/offload.md.

    ``copy_streams``: ``device -> CopyStream`` for every device (tests pass a stream double);
    default: a CopyStream for CUDA devices, none on CPU. ``host_pool_buffers``: free host
    buffers kept for reuse (default HOST_POOL_BUFFERS with CUDA, 0 without)."""

    def __init__(self, config: OffloadConfig, rank: Optional[int] = None,
                 copy_streams: Optional[Callable[[torch.device], CopyStream]] = None,
                 host_pool_buffers: Optional[int] = None):
        self.config = config.validate()
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"offload: ChunkStore(rank=...) must be an integer >= 0, got {rank!r}")
        self.rank = rank
        self.chunk_bytes = config.chunk_bytes
        self.pinned = torch.cuda.is_available()
        self.ssd_fallback = ""
        self.file: Optional[SlotFile] = None
        if config.offload_dir is not None:
            try:
                self.file = SlotFile(config.offload_dir, rank, config.capacity, config.io_mode)
            except OffloadDirError as exc:
                if config.fallback != "cpu":
                    raise
                self.ssd_fallback = str(exc)
                warnings.warn(f"{exc} Falling back: chunks evicted to ssd stay in host memory.")
        self._staging = StagingPool(config.staging_buffers, self.chunk_bytes, self.pinned)
        if host_pool_buffers is None:
            host_pool_buffers = HOST_POOL_BUFFERS if self.pinned else 0
        # host_tensor looked up at each call (tests count allocations by replacing it).
        self._host = HostPool(host_pool_buffers, self.pinned, lambda n, p: host_tensor(n, p))
        self._stream_factory = copy_streams
        self._copy_streams: Dict[str, CopyStream] = {}
        self._chunks: Dict[int, _Chunk] = {}
        self._names: Dict[str, List[int]] = {}
        self._lock = threading.Lock()
        self._pending: set = set()
        self._errors: List[BaseException] = []
        self._bytes = {d: 0 for d in DIRECTIONS}
        self._seconds = {d: 0.0 for d in DIRECTIONS}
        self._checkpoint_reads = {"mapped": 0, "host": 0, "copied": 0}  # bytes, by host_bytes' way
        self._pool = cf.ThreadPoolExecutor(config.io_workers,
                                           thread_name_prefix=f"grpo-offload-r{rank}")
        self._closed = False

    # ---- registration and queries -------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> List[int]:
        """Cut a contiguous tensor into chunks (in place: no copy) and return their ids."""
        self._check_open()
        if name in self._names:
            raise ValueError(f"offload: a tensor named {name!r} is already registered")
        if not tensor.is_contiguous():
            raise ValueError(f"offload: tensor {name!r} must be contiguous to be chunked")
        # chunk_bytes is a multiple of 4096, so chunk boundaries never split an element.
        # A fresh tensor on the same storage, not tensor.detach().view(...): a detached view
        # shares the version counter of its base, and the base may share it with a parameter
        # in the autograd graph (megatron's fp32 master shards are detached views of the
        # params), so a prefetch landing during backward would fail it ("modified by an
        # inplace operation"). Bytes the store copies are not autograd's business.
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        raw.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(),
                 (tensor.numel() * tensor.element_size(),))
        count = -(-raw.numel() // self.chunk_bytes)
        ids = []
        with self._lock:
            for index in range(count):
                chunk_id = len(self._chunks)
                start = index * self.chunk_bytes
                view = raw[start:start + self.chunk_bytes]
                self._chunks[chunk_id] = _Chunk(chunk_id, name, index, count, view)
                ids.append(chunk_id)
            self._names[name] = ids
        self._staging.fit(max(c.nbytes for c in self._chunks.values()))
        return ids

    def chunks(self, name: str) -> List[int]:
        return list(self._names[name])

    def location(self, chunk_id: int) -> str:
        """Where the chunk's valid copy is now (moves still in flight are not counted)."""
        return self._chunk(chunk_id).location

    def chunk_info(self, chunk_id: int) -> dict:
        c = self._chunk(chunk_id)
        return {"id": c.id, "name": c.name, "index": c.index, "nbytes": c.nbytes,
                "location": c.location, "file_offset": c.offset, "crc32": c.crc}

    # ---- moves --------------------------------------------------------------------------
    def evict(self, chunk_id: int, to: str = "cpu") -> cf.Future:
        """Move the chunk's valid copy to host memory (``cpu``) or the file (``ssd``)."""
        if to not in ("cpu", "ssd"):
            raise ValueError(f"offload: evict(to=...) must be 'cpu' or 'ssd', got {to!r}")
        if to == "ssd" and self.file is None:
            if not self.ssd_fallback:
                raise ValueError("offload: evict(to='ssd') needs OffloadConfig.offload_dir "
                                 "(--grpo-offload-dir); none is set")
            to = "cpu"  # fallback='cpu' after the file could not be made
        return self._schedule(self._chunk(chunk_id), to)

    def prefetch(self, chunk_id: int, keep: bool = False) -> cf.Future:
        """Bring the chunk back into its bytes of the registered tensor. ``keep``: a chunk read
        from the file keeps its extent as a shadow copy, so ``drop_device`` can send it back
        without writing (for state that is read, then maybe needed again unchanged)."""
        return self._schedule(self._chunk(chunk_id), "device+keep" if keep else "device")

    def drop_device(self, chunk_id: int) -> bool:
        """A shadowed chunk (prefetched with keep, unchanged since): its valid copy is the file
        extent or host copy again, at once and without I/O, and its device bytes are the
        caller's to free. False (nothing changes) when the chunk has no shadow or a move is
        pending."""
        chunk = self._chunk(chunk_id)
        with self._lock:
            if not chunk.shadow or chunk.location != "device" or \
                    (chunk.tail is not None and not chunk.tail.done()):
                return False
            chunk.location = "cpu" if chunk.host is not None else "ssd"
            chunk.shadow = False
            return True

    def overwrite(self, chunk_id: int) -> None:
        """The caller is about to write the chunk's device bytes anew: its other copies are
        discarded (extent given back), its valid copy is the device, and its storage must be
        allocated by the caller. Waits for a pending move of the chunk first."""
        chunk = self._chunk(chunk_id)
        tail = chunk.tail
        if tail is not None:
            cf.wait([tail])
        with self._lock:
            if chunk.offset is not None and (chunk.location == "ssd" or chunk.shadow):
                self.file.extents.release(chunk.offset, chunk.nbytes)
            released = chunk.host
            chunk.location, chunk.host, chunk.offset, chunk.crc, chunk.shadow = \
                "device", None, None, None, False
        if released is not None:
            self._host.give(released)

    def host_bytes(self, ids: Sequence[int]) -> torch.Tensor:
        """The bytes of ``ids`` (one registered tensor's chunks, in order) as a uint8 host
        tensor, read where they are and never brought back to the device: what a checkpoint
        writes for state that is away. Waits for these chunks' moves in flight. Three ways,
        counted in ``stats()["checkpoint_reads"]``:

        * ``mapped``: every chunk on ssd, in consecutive extents: a view of the file's one
          private map (SlotFile.map: one descriptor however many tensors a save maps),
          checked against each chunk's crc32 (the pages the check touched are dropped again), so
          the bytes enter memory only as page cache, when the checkpoint writer reads them;
        * ``host``: one chunk in (unpinned) host memory: its host copy itself, no copy;
        * ``copied``: otherwise (chunks spread over the file, several host copies, a chunk on
          the device): a new host tensor that each chunk is read (checksum checked) or copied
          into.

        The result is valid until one of these chunks moves again (its host copy or extent may
        be reused then): write it out before the next step."""
        chunks = [self._chunk(i) for i in ids]
        cf.wait([c.tail for c in chunks if c.tail is not None])
        out = self._mapped(chunks) if chunks else None
        if out is not None:
            how = "mapped"
        elif len(chunks) == 1 and chunks[0].location == "cpu" and not self.pinned:
            # Pinned host copies (CUDA) are copied: the writer's sharded tensors require every
            # piece of one tensor to agree on pinning, and the pieces beside it are not pinned.
            out, how = chunks[0].host[:chunks[0].nbytes], "host"
        else:
            out, how = torch.empty(sum(c.nbytes for c in chunks), dtype=torch.uint8), "copied"
            start = 0
            for c in chunks:
                dst = out[start:start + c.nbytes]
                if c.location == "ssd":
                    self._read(c, dst, None)  # checksum checked; counted as from_ssd
                else:
                    dst.copy_(c.host if c.location == "cpu" else c.view)
                start += c.nbytes
        with self._lock:
            self._checkpoint_reads[how] += out.numel()
        return out

    def _mapped(self, chunks: List[_Chunk]) -> Optional[torch.Tensor]:
        if self.file is None or any(c.location != "ssd" for c in chunks):
            return None
        first = chunks[0].offset
        # A full chunk's extent is exactly chunk_bytes long (a multiple of 4096): consecutive
        # extents hold the tensor's bytes in order, with no padding between them.
        if any(c.offset != first + k * self.chunk_bytes for k, c in enumerate(chunks)):
            return None
        try:
            mapped = self.file.map(first, sum(c.nbytes for c in chunks))
        except OSError:  # a filesystem that cannot map its files: the copying read works anyway
            return None
        flat = mapped.numpy()
        for k, c in enumerate(chunks):
            start = k * self.chunk_bytes
            same = zlib.crc32(flat[start:start + c.nbytes]) == c.crc
            # The check read these pages into this process: out again, so the resident set
            # holds at most one chunk of them at a time (the writer maps them back in).
            self.file.drop_pages(c.offset, c.nbytes)
            if not same:
                # Stale cached pages or bad data: the copying read checks again and raises
                # OffloadChecksumError if the file itself is bad.
                return None
        return mapped  # a view of the file's one map, which it keeps alive

    def wait_all(self, timeout: Optional[float] = None) -> None:
        """Wait for every move asked for so far, then raise the first unreported error."""
        with self._lock:
            pending = list(self._pending)
        cf.wait(pending, timeout=timeout)
        self.check()

    def check(self) -> None:
        """Raise the oldest background error not yet raised here (each is raised once)."""
        with self._lock:
            error = self._errors.pop(0) if self._errors else None
        if error is not None:
            raise error

    def _copy_stream(self, device: torch.device) -> Optional[CopyStream]:
        if self._stream_factory is None and device.type != "cuda":
            return None
        key = str(device)
        with self._lock:
            stream = self._copy_streams.get(key)
            if stream is None:
                stream = (self._stream_factory or CopyStream)(device)
                self._copy_streams[key] = stream
        return stream

    def _schedule(self, chunk: _Chunk, target: str) -> cf.Future:
        self._check_open()
        stream = self._copy_stream(chunk.view.device)
        # Recorded now, on the asking thread's stream: the copy follows the kernels that wrote
        # the bytes (evict) or the allocation it writes into (prefetch), nothing later.
        copy = (stream, stream.mark()) if stream is not None else None
        result: cf.Future = cf.Future()
        with self._lock:
            previous, chunk.tail = chunk.tail, result
            self._pending.add(result)
        result.add_done_callback(self._forget)

        def start(_previous=None) -> None:
            try:
                self._pool.submit(self._run, chunk, target, result, copy)
            except RuntimeError as exc:  # pool already shut down: report, do not drop
                if result.set_running_or_notify_cancel():
                    result.set_exception(OffloadError(f"offload (rank {self.rank}): "
                                                      f"store closed before {chunk.describe()} "
                                                      f"could move to {target}: {exc}"))

        if previous is None:
            start()
        else:
            previous.add_done_callback(start)  # runs at once if previous is already done
        return result

    def _forget(self, future: cf.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _run(self, chunk: _Chunk, target: str, result: cf.Future, copy) -> None:
        if not result.set_running_or_notify_cancel():
            return
        source = chunk.location
        try:
            self._move(chunk, target, copy)
        except BaseException as exc:  # noqa: B902 - every failure must reach the caller
            if not isinstance(exc, OffloadError):
                where = self.file.path if self.file is not None else "host memory"
                error = OffloadIOError(
                    f"offload (rank {self.rank}): moving {chunk.describe()} from {source} to "
                    f"{target} ({where}) failed: {exc!r}. The chunk is still valid in {source}. "
                    f"If the disk is full or failing, free space or set --grpo-offload-dir "
                    f"(OffloadConfig.offload_dir) to another local disk, or use "
                    f"--grpo-offload-fallback cpu.")
                error.__cause__ = exc
            else:
                error = exc
            with self._lock:
                self._errors.append(error)
            result.set_exception(error)
        else:
            result.set_result(chunk.location)

    def _move(self, chunk: _Chunk, target: str, copy) -> None:
        # Runs on a worker; moves of one chunk never overlap (chained), so the chunk's fields
        # are read without the lock and committed under it, only after the data is in place.
        # ``copy`` (stream, mark) is used for the copies that read or write the chunk's device
        # bytes only; host <-> host copies are plain.
        source = chunk.location
        if source == target or (source == "device" and target == "device+keep"):
            return
        if target == "cpu":
            host = self._host.take(chunk.nbytes)
            if source == "device":
                with self._timed("device_to_cpu", chunk.nbytes) as clock:
                    land(host, chunk.view, copy, clock)
            else:
                self._read(chunk, host, None)
            self._commit(chunk, "cpu", host=host)
        elif target == "ssd":
            if source == "device":
                self._write(chunk, chunk.view, copy)
            else:
                self._write(chunk, chunk.host, None)
        else:
            if source == "cpu":
                with self._timed("cpu_to_device", chunk.nbytes) as clock:
                    land(chunk.view, chunk.host, copy, clock)
                self._commit(chunk, "device", keep=target == "device+keep")
            else:
                self._read(chunk, chunk.view, copy)
                self._commit(chunk, "device", keep=target == "device+keep")

    def _write(self, chunk: _Chunk, source: torch.Tensor, copy) -> None:
        nbytes, padded = chunk.nbytes, align_up(chunk.nbytes)
        with self._lock:
            offset = self.file.extents.allocate(nbytes)
            used, size = self.file.extents.used, self.file.size
        if offset is None:
            raise OffloadCapacityError(
                f"offload (rank {self.rank}): no room for {chunk.describe()} in {self.file.path}: "
                f"{used} of {size} bytes in use, {padded} more needed. Raise the SSD capacity "
                f"(OffloadConfig.capacity) or evict fewer chunks to ssd; the chunk stays in "
                f"{chunk.location}.")
        try:
            with self._staging.buffer() as buf, self._timed("to_ssd", padded) as clock:
                land(buf[:nbytes], source, copy, clock)  # landed before the checksum
                buf[nbytes:padded].zero_()  # padding is written too: never leak stale bytes
                view = memoryview(buf.numpy())
                crc = zlib.crc32(view[:nbytes])
                self.file.write(view[:padded], offset)
        except BaseException:
            with self._lock:
                self.file.extents.release(offset, nbytes)
            raise
        self._commit(chunk, "ssd", offset=offset, crc=crc)

    def _read(self, chunk: _Chunk, into: torch.Tensor, copy) -> None:
        nbytes, padded = chunk.nbytes, align_up(chunk.nbytes)
        with self._staging.buffer() as buf, self._timed("from_ssd", padded) as clock:
            view = memoryview(buf.numpy())
            self.file.read(view[:padded], chunk.offset)
            crc = zlib.crc32(view[:nbytes])
            if crc != chunk.crc:
                raise OffloadChecksumError(
                    f"offload (rank {self.rank}): checksum mismatch reading {chunk.describe()} "
                    f"from {self.file.path} at offset {chunk.offset}: crc32 {crc:#010x}, written "
                    f"as {chunk.crc:#010x}. The file was changed or the disk returned bad data; "
                    f"the chunk cannot be recovered from this store. Check the disk (dmesg, "
                    f"smartctl), move --grpo-offload-dir to another disk, and restart from the "
                    f"last checkpoint.")
            # Landed before the staging buffer goes back to the pool (the next read reuses it).
            land(into, buf[:nbytes], copy, clock)

    def _commit(self, chunk: _Chunk, location: str, host: Optional[torch.Tensor] = None,
                offset: Optional[int] = None, crc: Optional[int] = None, keep: bool = False) -> None:
        with self._lock:
            if keep:  # the file extent or host copy keeps the same bytes: a shadow copy
                chunk.location, chunk.shadow = "device", True
                return
            held = chunk.offset if (chunk.location == "ssd" or chunk.shadow) else None
            if held is not None and held != offset:
                self.file.extents.release(held, chunk.nbytes)
            released = chunk.host if chunk.host is not host else None
            chunk.location, chunk.host, chunk.offset, chunk.crc = location, host, offset, crc
            chunk.shadow = False
        if released is not None:
            self._host.give(released)  # every copy from it has landed: free for reuse

    @contextmanager
    def _timed(self, direction: str, nbytes: int):
        start = time.perf_counter()
        clock = _Clock()
        yield clock
        with self._lock:
            self._seconds[direction] += time.perf_counter() - start - clock.excluded
            self._bytes[direction] += nbytes

    # ---- bookkeeping --------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters since construction. Bytes and seconds are per direction; seconds are worker
        busy time summed over workers (they can add up to more than wall time)."""
        with self._lock:
            resident = {loc: 0 for loc in LOCATIONS}
            for c in self._chunks.values():
                resident[c.location] += c.nbytes
            return {
                "rank": self.rank,
                "file": self.file.path if self.file is not None else None,
                "io_mode": self.file.io_mode if self.file is not None else None,
                "direct_fallback_reason": self.file.direct_fallback_reason if self.file else "",
                "ssd_fallback": self.ssd_fallback,
                "ssd_capacity_bytes": self.file.size if self.file is not None else 0,
                "ssd_used_bytes": self.file.extents.used if self.file is not None else 0,
                "bytes": dict(self._bytes),
                "seconds": dict(self._seconds),
                "ssd_bytes_written": self._bytes["to_ssd"],
                "ssd_bytes_read": self._bytes["from_ssd"],
                "resident_bytes": resident,
                "staging": {"count": self._staging.count, "buffer_bytes": self._staging.nbytes,
                            "allocated": self._staging.allocated,
                            "peak_in_use": self._staging.peak_in_use},
                "pinned": self.pinned,
                "pending": len(self._pending),
                "host_pool": self._host.stats(),
                "copy_streams": len(self._copy_streams),
                "checkpoint_reads": dict(self._checkpoint_reads),
            }

    def _chunk(self, chunk_id: int) -> _Chunk:
        try:
            return self._chunks[chunk_id]
        except KeyError:
            raise KeyError(f"offload: no chunk with id {chunk_id} ({len(self._chunks)} chunks "
                           f"are registered, ids from 0)") from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"offload (rank {self.rank}): the chunk store is closed")

    def close(self) -> None:
        """Finish the moves in flight, join the workers, close and delete the file. Idempotent.

        Chunks still on cpu/ssd are dropped: prefetch what you need first. Errors of the last
        moves are not raised here; call ``wait_all()`` before ``close()`` to see them."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending)
        cf.wait(pending)
        self._pool.shutdown(wait=True)
        for stream in self._copy_streams.values():
            stream.close()  # nothing queued may still use the buffers freed below
        if self.file is not None:
            self.file.close()
        for c in self._chunks.values():
            c.host = None
        self._host.close()

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
