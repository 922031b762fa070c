"""The chunk store's copies on a dedicated copy stream, and its pool of host buffers,
checked on CPU with a stream double (tests/copy_stream_double.py) that defers work
issued on a side stream until an event after it is waited for, as a GPU would run it later.

What a GPU needs and these tests hold the store to:
* a device <-> host copy is issued on the store's copy stream (not the worker's current stream,
  the legacy default stream training runs on), after an event the requesting thread recorded
  on its own stream when it asked for the move;
* the worker waits for the copy's own event (never a device-wide synchronize), and a move's
  Future completes only after that, so the bytes have landed and no storage is freed (the
  placement's resize_(0)) while a copy still reads it;
* host copies come from a bounded pool that is reused, not a fresh pinned buffer per eviction.
"""

import pytest
import torch

import megatron_grpo.offload.store as store_mod
from copy_stream_double import FakeCuda, factory
from megatron_grpo.offload import ChunkStore, OffloadConfig
from megatron_grpo.offload.placement import TierPlacement

CHUNK = 64 << 10


def config(tmp_path=None, **kw):
    return OffloadConfig(chunk_mb=CHUNK / (1 << 20), offload_dir=str(tmp_path) if tmp_path else None,
                         capacity=(8 << 20) if tmp_path else 0, **kw)


def events(cuda, what, **match):
    return [(thread, d) for thread, w, d in cuda.log if w == what
            and all(d.get(k) == v for k, v in match.items())]


@pytest.mark.parametrize("to", ["cpu", "ssd"])
def test_copies_run_on_the_copy_stream_behind_the_requesters_event(tmp_path, to):
    cuda = FakeCuda()
    t = torch.randn(40_000)  # 160,000 bytes: 3 chunks
    ref = t.clone()
    with ChunkStore(config(tmp_path), rank=0, copy_streams=factory(cuda)) as store:
        ids = store.register("t", t)
        for f in [store.evict(i, to=to) for i in ids]:
            f.result()
        # The allocator may hand the freed bytes to the next tensor: whatever is there now
        # must not matter (the copies landed before the Futures completed).
        t.fill_(float("nan"))
        for f in [store.prefetch(i) for i in ids]:
            f.result()
        assert torch.equal(t, ref)  # no other wait: a completed prefetch has landed
        assert [store.location(i) for i in ids] == ["device"] * 3
    assert len(cuda.streams) == 1  # one copy stream for the store
    copy = cuda.streams[0].name
    # Every move: a mark on the requester's (main) stream, recorded by the requesting thread;
    # the copy stream waits for it; the copy is issued there, never on the default stream.
    marks = [d["event"] for thread, d in events(cuda, "record", stream="default")]
    assert len(marks) == 6 and all(thread == "MainThread"
                                   for thread, _ in events(cuda, "record", stream="default"))
    assert sorted(d["event"] for _, d in events(cuda, "wait_event", stream=copy)) == sorted(marks)
    assert len(events(cuda, "enqueue", stream=copy)) == 6
    assert events(cuda, "enqueue", stream="default") == []
    # The workers waited for the copies' own events, nothing device- or stream-wide.
    done = [d["event"] for _, d in events(cuda, "record", stream=copy)]
    waited = events(cuda, "event_synchronize", stream=copy)
    assert {d["event"] for _, d in waited} == set(done)
    assert all(thread.startswith("grpo-offload-r0") for thread, _ in waited)
    assert all(thread == "MainThread" for thread, _ in events(cuda, "stream_synchronize"))


def test_cpu_tensors_take_no_stream_without_cuda(tmp_path):
    with ChunkStore(config(tmp_path), rank=0) as store:
        t = torch.randn(40_000)
        ref = t.clone()
        ids = store.register("t", t)
        for i in ids:
            store.evict(i, to="cpu")
        store.wait_all()
        t.zero_()
        for i in ids:
            store.prefetch(i)
        store.wait_all()
        assert torch.equal(t, ref)
        assert store.stats()["copy_streams"] == 0


def test_evictions_reuse_a_bounded_pool_of_host_buffers(monkeypatch):
    allocations = []
    real = store_mod.host_tensor

    def counting(nbytes, pinned):
        allocations.append(nbytes)
        return real(nbytes, pinned)

    monkeypatch.setattr(store_mod, "host_tensor", counting)
    pool = 4
    t = torch.randn(3 * CHUNK // 4)  # 3 chunks of exactly CHUNK bytes
    ref = t.clone()
    with ChunkStore(config(), rank=0, host_pool_buffers=pool) as store:
        ids = store.register("t", t)
        for _ in range(6):  # 18 evictions of same-size chunks
            for f in [store.evict(i, to="cpu") for i in ids]:
                f.result()
            t.zero_()
            for f in [store.prefetch(i) for i in ids]:
                f.result()
            assert torch.equal(t, ref)
        assert len(allocations) <= pool, \
            f"{len(allocations)} host buffers allocated for 18 evictions of 3 chunks"
        stats = store.stats()["host_pool"]
        assert stats["allocated"] == len(allocations) == 3 and stats["idle"] == 3
        # More chunks away at once than the pool keeps: the idle ones stay bounded.
        big = torch.randn(10 * CHUNK // 4)
        big_ids = store.register("big", big)
        for f in [store.evict(i, to="cpu") for i in big_ids]:
            f.result()
        for f in [store.prefetch(i) for i in big_ids]:
            f.result()
        assert store.stats()["host_pool"]["idle"] == pool
    assert store.stats()["host_pool"]["idle"] == 0  # freed on close


@pytest.mark.parametrize("target", ["cpu", "ssd"])
def test_the_placement_frees_no_storage_a_pending_copy_uses(tmp_path, monkeypatch, target):
    """Every resize_(0) of the placement (a unit's state away) happens with no copy still
    queued on the copy stream that reads or writes that storage."""
    cuda = FakeCuda()
    frees = []
    real_resize = torch.UntypedStorage.resize_

    def checked_resize(storage, nbytes):
        if nbytes == 0 and cuda.streams:
            assert storage.data_ptr() not in cuda.streams[0].pending_storages(), \
                "a storage freed while a queued copy still uses it"
            frees.append(storage.data_ptr())
        return real_resize(storage, nbytes)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", checked_resize)
    g = torch.Generator().manual_seed(3)
    st = {(u, k): [("x", torch.randn(n, generator=g))] for u in range(4)
          for k, n in (("moments", 30_000), ("master", 15_000))}
    ref = {k: v[0][1].clone() for k, v in st.items()}
    tiers = ["dynamic", "stable", "dynamic", "core"]
    store = ChunkStore(config(tmp_path if target == "ssd" else None), rank=0,
                       copy_streams=factory(cuda))
    p = TierPlacement(store, target, stream=True)
    try:
        p.add(st)
        for step in range(3):
            p.begin_step(tiers, update_now=step == 2, update_next=step == 1)
            p.ensure(update_now=step == 2)

            def run(unit):
                for kind in ("moments", "master"):
                    st[(unit, kind)][0][1].add_(1.0)
                    ref[(unit, kind)].add_(1.0)

            p.stream(p.windows(update_now=step == 2), run)
            p.store.wait_all()  # in training, the next forward and backward run meanwhile
        p.resident_all()
        assert all(torch.equal(v[0][1], ref[k]) for k, v in st.items())
        assert len(frees) >= 12  # the streamed units' tensors left memory every step
    finally:
        p.close()


def test_copy_time_leaves_out_the_wait_for_the_producers_kernels():
    """An eviction asked for while the optimizer's kernels are still queued: the copy stream
    waits for them, and that wait is compute, not copy time (the hidden share, 1 - stall /
    copy time, would count it as hidden copy work)."""
    import time

    cuda = FakeCuda()
    compute = cuda.Stream()  # the requester's stream, with 0.3 s of kernels still queued
    t = torch.randn(CHUNK // 4)
    with ChunkStore(config(), rank=0, copy_streams=factory(cuda)) as store:
        ids = store.register("t", t)
        with cuda.stream(compute):
            compute.enqueue(lambda: time.sleep(0.3))
            future = store.evict(ids[0], to="cpu")
        start = time.perf_counter()
        future.result()
        assert time.perf_counter() - start >= 0.3  # the copy did wait for the kernels
        assert store.stats()["seconds"]["device_to_cpu"] < 0.1
