"""ChunkStore (megatron_grpo/offload): moves are bit-exact, failures reach the caller, the file
is what it claims to be. CPU mode: the "device" tensors are ordinary CPU tensors."""

import contextlib
import errno
import os
import threading
import time

import pytest
import torch

from megatron_grpo.offload import (ChunkStore, OffloadCapacityError, OffloadChecksumError,
                                   OffloadConfig, OffloadConfigError, OffloadDirError,
                                   OffloadIOError, StagingPool, file_name)
from megatron_grpo.offload import slot_file

CHUNK = 1 << 18  # 256 KiB chunks (chunk_mb=0.25): several chunks per test tensor
KB4 = 4096


def padded(n):
    return -(-n // KB4) * KB4


def make_tensors():
    """Odd sizes: no tensor is a multiple of the chunk size, no last chunk a multiple of 4096."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(80_000, generator=g)
    return {
        "fp32": torch.randn(300_001, generator=g),  # 1,200,004 bytes: 5 chunks
        "bf16": torch.randn(200_003, generator=g).to(torch.bfloat16),  # 400,006 bytes: 2
        "int8": torch.randint(-128, 128, (777_777,), generator=g, dtype=torch.int8),  # 3
        "tiny": torch.randn(1000, generator=g),  # 4,000 bytes: 1 chunk shorter than 4096
        "slice": big[3:3 + 70_001],  # a view at an odd storage offset inside a larger buffer
    }, big


def ssd_round_trip(store, ids, t):
    """Every chunk of ``t`` to the file and back, with ``t`` zeroed in between."""
    for i in ids:
        store.evict(i, "ssd")
    store.wait_all()
    t.zero_()
    for i in ids:
        store.prefetch(i)
    store.wait_all()


def store_for(tmp_path, rank=0, **kw):
    kw.setdefault("capacity", 16 << 20)
    return ChunkStore(OffloadConfig(chunk_mb=CHUNK / (1 << 20), offload_dir=str(tmp_path), **kw),
                      rank=rank)


@pytest.mark.parametrize("to,io_mode", [("cpu", "direct"), ("ssd", "direct"), ("ssd", "buffered")])
def test_evict_then_prefetch_is_bit_identical(tmp_path, to, io_mode):
    tensors, big = make_tensors()
    reference = {k: v.clone() for k, v in tensors.items()}
    big_ref = big.clone()
    with store_for(tmp_path, io_mode=io_mode) as store:
        ids = {k: store.register(k, v) for k, v in tensors.items()}
        assert {k: len(v) for k, v in ids.items()} == {"fp32": 5, "bf16": 2, "int8": 3,
                                                      "tiny": 1, "slice": 2}
        sizes = [store.chunk_info(i)["nbytes"] for v in ids.values() for i in v]
        assert sum(sizes) == sum(t.numel() * t.element_size() for t in tensors.values())
        futures = [store.evict(i, to) for v in ids.values() for i in v]
        store.wait_all()
        assert [f.result() for f in futures] == [to] * 13
        assert {store.location(i) for v in ids.values() for i in v} == {to}
        st = store.stats()
        assert st["io_mode"] == io_mode
        assert st["resident_bytes"] == {"device": 0, "cpu": sum(sizes) if to == "cpu" else 0,
                                        "ssd": sum(sizes) if to == "ssd" else 0}
        expected_file = sum(padded(n) for n in sizes) if to == "ssd" else 0
        assert st["ssd_bytes_written"] == expected_file
        assert st["ssd_used_bytes"] == expected_file
        for t in tensors.values():  # the device bytes are now free to reuse: scribble on them
            t.fill_(7)
        big[:3] = 7
        for v in ids.values():
            for i in v:
                store.prefetch(i)
        store.wait_all()
        for k, t in tensors.items():
            assert torch.equal(t, reference[k]), k
        assert torch.equal(big[3 + 70_001:], big_ref[3 + 70_001:])  # neighbours untouched
        assert torch.equal(big[:3], torch.full((3,), 7.0))
        st = store.stats()
        assert st["resident_bytes"] == {"device": sum(sizes), "cpu": 0, "ssd": 0}
        assert st["ssd_bytes_read"] == expected_file
        assert st["ssd_used_bytes"] == 0


def test_moves_of_one_chunk_run_in_the_order_asked(tmp_path):
    t = torch.randn(100_000)
    ref = t.clone()
    with store_for(tmp_path) as store:
        (c0, c1) = store.register("w", t)
        futures = [store.evict(c1, "ssd"), store.prefetch(c1), store.evict(c1, "cpu"),
                   store.evict(c1, "ssd"), store.evict(c1, "cpu"), store.evict(c1, "ssd")]
        store.wait_all()
        assert [f.result() for f in futures] == ["ssd", "device", "cpu", "ssd", "cpu", "ssd"]
        t.zero_()
        store.prefetch(c1).result(timeout=5)
        assert torch.equal(t[CHUNK // 4:], ref[CHUNK // 4:])
        assert store.location(c0) == "device" and store.location(c1) == "device"


def test_file_name_is_per_rank_and_preallocated_to_the_aligned_capacity(tmp_path):
    capacity = 5 * KB4 + 1
    with store_for(tmp_path, rank=3, capacity=capacity) as s3, \
            store_for(tmp_path, rank=12, capacity=capacity):
        path = tmp_path / "grpo-offload-rank00003.bin"
        assert file_name(3) == "grpo-offload-rank00003.bin"
        assert sorted(os.listdir(tmp_path)) == ["grpo-offload-rank00003.bin",
                                                "grpo-offload-rank00012.bin"]
        assert s3.stats()["file"] == str(path)
        assert os.stat(path).st_size == 6 * KB4
        assert os.stat(path).st_blocks * 512 >= 6 * KB4  # allocated up front, not sparse
        with pytest.raises(OffloadDirError, match="in use by another process"):
            store_for(tmp_path, rank=3, capacity=capacity)
        assert os.stat(path).st_size == 6 * KB4  # the failed second store left it alone
    assert os.listdir(tmp_path) == []  # close() deletes the scratch files


@pytest.mark.parametrize("where", [0, 151_427, 151_428])
def test_flipped_byte_in_the_file_is_detected_on_prefetch(tmp_path, where):
    t = torch.randn(300_001)  # last chunk: 151,428 bytes (padded to 155,648 in the file)
    ref = t.clone()
    with store_for(tmp_path, rank=2) as store:
        ids = store.register("layer3.weight", t)
        store.evict(ids[4], "ssd").result(timeout=5)
        offset = store.chunk_info(ids[4])["file_offset"]
        with open(store.stats()["file"], "r+b") as f:
            f.seek(offset + where)
            byte = f.read(1)[0]
            f.seek(offset + where)
            f.write(bytes([byte ^ 0x10]))
        future = store.prefetch(ids[4])
        if where == 151_428:  # a padding byte: not data, not checked, the chunk is intact
            future.result(timeout=5)
            assert torch.equal(t, ref)
            return
        error = future.exception(timeout=5)
        assert isinstance(error, OffloadChecksumError)
        message = str(error)
        for part in (store.stats()["file"], "chunk 4 ", "'layer3.weight'", "chunk 5 of 5",
                     "rank 2", "restart from the last checkpoint"):
            assert part in message, part
        with pytest.raises(OffloadChecksumError):
            store.check()
        assert store.location(ids[4]) == "ssd"


def _assert_dir_error(error, directory, rank, needed, problem):
    message = str(error)
    for part in (repr(str(directory)), f"rank {rank}", f"{needed} bytes", problem,
                 "--grpo-offload-dir", "--grpo-offload-fallback cpu"):
        assert part in message, (part, message)


def test_missing_or_non_directory_offload_dir_is_a_construction_error(tmp_path):
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    cases = [(tmp_path / "missing", "it does not exist"),
             (regular / "sub", "a component of the path is a regular file"),
             (regular, "it is not a directory")]
    for directory, problem in cases:
        with pytest.raises(OffloadDirError) as info:
            store_for(directory, rank=5, capacity=3 * KB4)
        _assert_dir_error(info.value, directory, 5, 3 * KB4, problem)
    assert os.listdir(tmp_path) == ["regular"]


def test_unwritable_offload_dir_is_a_construction_error(tmp_path, tmpfs):
    if os.geteuid() != 0:  # permissions stop ordinary users
        directory = tmp_path / "ro"
        directory.mkdir(mode=0o500)
        context = contextlib.nullcontext(directory)
    else:  # root ignores permissions: use a read-only filesystem instead
        context = tmpfs(tmp_path / "ro", "1m", read_only=True)
    with context as directory:
        with pytest.raises(OffloadDirError) as info:
            store_for(directory, rank=1, capacity=KB4)
        _assert_dir_error(info.value, directory, 1, KB4, "it is not writable")
        assert os.listdir(directory) == []


def test_too_small_filesystem_is_a_capacity_error_and_leaves_no_file(tmp_path, tmpfs):
    with tmpfs(tmp_path / "small", "1m") as directory:
        with pytest.raises(OffloadDirError) as info:
            store_for(directory, rank=7, capacity=4 << 20)
        _assert_dir_error(info.value, directory, 7, 4 << 20, "not enough space")
        assert os.listdir(directory) == []
        with store_for(directory, rank=7, capacity=512 << 10) as store:  # what fits, works
            assert store.stats()["ssd_capacity_bytes"] == 512 << 10


def test_fallback_cpu_keeps_ssd_bound_chunks_in_host_memory(tmp_path):
    t = torch.randn(100_000)
    ref = t.clone()
    with pytest.warns(UserWarning, match="it does not exist.*Falling back"):
        store = store_for(tmp_path / "missing", fallback="cpu")
    with store:
        ids = store.register("w", t)
        assert [store.evict(i, "ssd").result(timeout=5) for i in ids] == ["cpu", "cpu"]
        assert store.stats()["file"] is None and "does not exist" in store.stats()["ssd_fallback"]
        t.zero_()
        for i in ids:
            store.prefetch(i)
        store.wait_all()
        assert torch.equal(t, ref)


def test_worker_exception_reaches_future_and_check_and_the_chunk_stays_valid(tmp_path,
                                                                              monkeypatch):
    t = torch.randn(100_000)
    ref = t.clone()
    with store_for(tmp_path, rank=1) as store:
        c0, c1 = store.register("w", t)
        store.evict(c1, "cpu").result(timeout=5)

        def disk_full(fd, data, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(slot_file, "pwrite_all", disk_full)
        start = time.monotonic()
        error = store.evict(c0, "ssd").exception(timeout=2)
        assert isinstance(error, OffloadIOError) and isinstance(error.__cause__, OSError)
        for part in (store.stats()["file"], "chunk 0 ", "rank 1", "No space left on device",
                     "still valid in device"):
            assert part in str(error), part
        while True:  # check() must report it too, within 2 s of the failure
            try:
                store.check()
            except OffloadIOError as raised:
                assert raised is error
                break
            assert time.monotonic() - start < 2.0
            time.sleep(0.01)
        store.check()  # reported once: nothing further pending
        assert "still valid in cpu" in str(store.evict(c1, "ssd").exception(timeout=2))
        with pytest.raises(OffloadIOError, match="still valid in cpu"):
            store.wait_all()
        assert (store.location(c0), store.location(c1)) == ("device", "cpu")
        assert store.stats()["ssd_used_bytes"] == 0  # the failed writes gave their extents back
        monkeypatch.undo()

        assert store.evict(c0, "ssd").result(timeout=5) == "ssd"
        monkeypatch.setattr(slot_file, "pread_all", lambda fd, into, offset: 1 / 0)
        assert "still valid in ssd" in str(store.prefetch(c0).exception(timeout=2))
        monkeypatch.undo()
        with pytest.raises(OffloadIOError, match="ZeroDivisionError"):
            store.check()
        t.zero_()
        for c in (c0, c1):
            store.prefetch(c)
        store.wait_all()
        assert torch.equal(t, ref)


def test_short_reads_and_writes_are_looped_until_complete(tmp_path, monkeypatch):
    t = torch.randn(300_001)
    ref = t.clone()
    calls = {"pwrite": 0, "preadv": 0}
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def short_pwrite(fd, data, offset):
        calls["pwrite"] += 1
        return real_pwrite(fd, data[:1000], offset)

    def short_preadv(fd, buffers, offset):
        calls["preadv"] += 1
        return real_preadv(fd, [buffers[0][:1000]], offset)

    with store_for(tmp_path, io_mode="buffered", io_workers=1) as store:
        ids = store.register("w", t)
        monkeypatch.setattr(slot_file.os, "pwrite", short_pwrite)
        monkeypatch.setattr(slot_file.os, "preadv", short_preadv)
        ssd_round_trip(store, ids, t)
        monkeypatch.undo()
        assert torch.equal(t, ref)
        expected = 4 * -(-CHUNK // 1000) + -(-padded(151_428) // 1000)
        assert calls == {"pwrite": expected, "preadv": expected}


def test_end_of_file_is_an_error_not_a_short_read(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match=r"end of file at offset 5000 \(3192 bytes missing\): "
                                          r"the file was truncated"):
            slot_file.pread_all(fd, memoryview(bytearray(KB4)), KB4)
    finally:
        os.close(fd)


def test_staging_pool_never_exceeds_its_bound(tmp_path, monkeypatch):
    t = torch.randn(12 * CHUNK // 4)  # 12 full chunks
    ref = t.clone()
    active, peak = [0], {"write": 0, "read": 0}
    lock = threading.Lock()

    def instrumented(kind, real):
        def transfer(fd, view, offset):
            with lock:
                active[0] += 1
                peak[kind] = max(peak[kind], active[0])
            time.sleep(0.02)  # long enough that all four workers want a buffer at once
            try:
                real(fd, view, offset)
            finally:
                with lock:
                    active[0] -= 1
        return transfer

    monkeypatch.setattr(slot_file, "pwrite_all", instrumented("write", slot_file.pwrite_all))
    monkeypatch.setattr(slot_file, "pread_all", instrumented("read", slot_file.pread_all))
    with store_for(tmp_path, io_workers=4, staging_buffers=2) as store:
        ids = store.register("w", t)
        ssd_round_trip(store, ids, t)
        assert torch.equal(t, ref)
        assert peak == {"write": 2, "read": 2}
        assert store.stats()["staging"] == {"count": 2, "buffer_bytes": CHUNK, "allocated": 2,
                                            "peak_in_use": 2}
    pool = StagingPool(count=1, nbytes=CHUNK, pinned=False)
    with pool.buffer() as buf:
        assert buf.data_ptr() % KB4 == 0 and buf.numel() == CHUNK


def test_capacity_exhausted_is_reported_and_the_chunk_stays(tmp_path):
    t = torch.randn(3 * CHUNK // 4)
    with store_for(tmp_path, capacity=2 * CHUNK) as store:
        ids = store.register("w", t)
        futures = [store.evict(i, "ssd") for i in ids]
        cf_done = [f.exception(timeout=5) for f in futures]
        assert cf_done[:2] == [None, None]
        assert isinstance(cf_done[2], OffloadCapacityError)
        assert f"{2 * CHUNK} of {2 * CHUNK} bytes in use, {CHUNK} more needed" in str(cf_done[2])
        assert [store.location(i) for i in ids] == ["ssd", "ssd", "device"]
        with pytest.raises(OffloadCapacityError):
            store.check()


def test_direct_io_falls_back_to_buffered_where_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(slot_file.os, "open", no_direct)
    t = torch.randn(70_001)
    ref = t.clone()
    with store_for(tmp_path) as store:
        assert store.stats()["io_mode"] == "buffered"
        assert "open with O_DIRECT failed" in store.stats()["direct_fallback_reason"]
        (c0, c1) = store.register("w", t)
        store.evict(c1, "ssd").result(timeout=5)
        t.zero_()
        store.prefetch(c1).result(timeout=5)
        assert torch.equal(t[CHUNK // 4:], ref[CHUNK // 4:])


def test_close_is_idempotent_and_joins_the_workers(tmp_path):
    t = torch.randn(200_000)
    store = store_for(tmp_path, rank=4, io_workers=3)
    ids = store.register("w", t)
    for i in ids:
        store.evict(i, "ssd")
    assert any(th.name.startswith("grpo-offload-r4") for th in threading.enumerate())
    store.close()
    store.close()
    assert [th.name for th in threading.enumerate() if th.name.startswith("grpo-offload")] == []
    assert [store.location(i) for i in ids] == ["ssd"] * 4  # close waited for the moves
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        store.prefetch(ids[0])


def test_register_rejects_what_it_cannot_chunk(tmp_path):
    with store_for(tmp_path) as store:
        store.register("w", torch.zeros(10))
        with pytest.raises(ValueError, match="already registered"):
            store.register("w", torch.zeros(10))
        with pytest.raises(ValueError, match="contiguous"):
            store.register("t", torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match="'cpu' or 'ssd'"):
            store.evict(0, "disk")
        with pytest.raises(KeyError, match="no chunk with id 9"):
            store.location(9)


@pytest.mark.parametrize("field,value,accepted", [
    ("chunk_mb", 0, "a positive number of MB"),
    ("chunk_mb", 0.001, "a whole multiple of 4096 bytes (0.00390625 MB)"),
    ("fallback", "disk", "one of error, cpu"),
    ("io_mode", "mmap", "one of direct, buffered"),
    ("io_workers", 0, "an integer >= 1"),
    ("staging_buffers", 1.5, "an integer >= 1"),
    ("capacity", -1, "an integer number of bytes >= 0"),
])
def test_config_validation_names_the_field(field, value, accepted):
    with pytest.raises(OffloadConfigError) as info:
        OffloadConfig(**{field: value}).validate()
    assert str(info.value) == f"OffloadConfig.{field} must be {accepted}, got {value!r}"


def test_config_needs_a_capacity_with_an_offload_dir(tmp_path):
    with pytest.raises(OffloadConfigError, match=r"OffloadConfig.capacity must be > 0 bytes"):
        OffloadConfig(offload_dir=str(tmp_path)).validate()
    assert OffloadConfig().validate().chunk_bytes == 128 << 20


def test_staging_buffers_are_sized_for_the_largest_chunk_not_the_chunk_limit(tmp_path):
    # 128 MB chunks over a 20 KB tensor must not stage through 128 MB buffers (on a CPU run
    # staging is training's own host memory).
    small = torch.randn(5_000)
    ref = small.clone()
    with ChunkStore(OffloadConfig(offload_dir=str(tmp_path), capacity=1 << 20), rank=0) as store:
        ids = store.register("small", small)
        ssd_round_trip(store, ids, small)
        assert torch.equal(small, ref)
        assert store.stats()["staging"]["buffer_bytes"] == 20_480  # 20,000 B rounded to 4096
        bigger = torch.randn(50_000)
        big_ref = bigger.clone()
        ids = store.register("bigger", bigger)  # grows the buffers; the small ones are dropped
        ssd_round_trip(store, ids, bigger)
        assert torch.equal(bigger, big_ref)
        staging = store.stats()["staging"]
        assert staging["buffer_bytes"] == 200_704 and staging["allocated"] <= 2
