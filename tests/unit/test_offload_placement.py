"""TierPlacement (megatron_grpo.offload.placement): the stable tier's state leaves memory between
updates, comes back one step ahead, bit for bit, and nothing is silently lost or stale."""


import pytest
import torch

from megatron_grpo.offload import ChunkStore, OffloadCapacityError, OffloadConfig
from megatron_grpo.offload.placement import TierPlacement, owns_storage, planned_bytes

CHUNK = 64 << 10  # 64 KiB chunks: a 40,000-element fp32 tensor is 3 chunks


def make(tmp_path, target="ssd"):
    cfg = OffloadConfig(chunk_mb=CHUNK / (1 << 20), offload_dir=str(tmp_path) if target == "ssd" else None,
                        capacity=8 << 20)
    return TierPlacement(ChunkStore(cfg, rank=0), target)


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {0: [("master", torch.randn(40_000, generator=g)), ("exp_avg", torch.randn(40_000, generator=g))],
            1: [("master", torch.randn(1_000, generator=g))],
            2: [("master", torch.randn(5_000, generator=g))]}


def place_away(p, st, tiers):
    """Register ``st``, run a step start with ``tiers`` (no update) and let every move finish."""
    p.add(st)
    p.begin_step(tiers, False, False)
    p.store.wait_all()
    p.settle()


def storage_bytes(t):
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("target", ["ssd", "cpu"])
def test_stable_state_is_freed_between_updates_and_comes_back_bit_identical(tmp_path, target):
    st = state()
    ref = {u: [t.clone() for _, t in pairs] for u, pairs in st.items()}
    tiers = ["stable", "core", "dynamic"]
    p = make(tmp_path, target)
    try:
        p.add(st)
        p.begin_step(tiers, update_now=False, update_next=False)
        p.ensure(update_now=False)
        p.store.wait_all()
        p.settle()
        # Unit 0's tensors own no memory now; core and dynamic units keep theirs.
        assert [storage_bytes(t) for _, t in st[0]] == [0, 0]
        assert storage_bytes(st[1][0][1]) == 4_000 and storage_bytes(st[2][0][1]) == 20_000
        assert p.resident_bytes() == {"stable": {"device": 0, target: 320_000},
                                      "core": {"device": 4_000, target: 0},
                                      "dynamic": {"device": 20_000, target: 0}}
        m = p.step_metrics()
        assert m["offload_bytes_written"] == (2 * 163_840 if target == "ssd" else 320_000)
        assert m["offload_bytes_stable_" + target] == 320_000
        # The step before the update prefetches; the update step finds the state resident.
        p.begin_step(tiers, update_now=False, update_next=True)
        p.store.wait_all()
        p.begin_step(tiers, update_now=True, update_next=False)
        p.ensure(update_now=True)
        assert p.stall_s < 0.05
        for (_, t), r in zip(st[0], ref[0]):
            assert storage_bytes(t) == 160_000 and torch.equal(t, r)
        assert p.step_metrics()["offload_stall_s"] == p.stall_s
    finally:
        p.close()


def test_a_late_prefetch_is_a_measured_stall_not_a_wrong_read(tmp_path):
    st = state(1)
    ref = st[0][0][1].clone()
    p = make(tmp_path)
    try:
        place_away(p, st, ["stable", "core", "core"])
        assert storage_bytes(st[0][0][1]) == 0
        # No step-ahead prefetch (e.g. the interval changed): ensure() fetches and waits.
        p.begin_step(["stable", "core", "core"], update_now=True, update_next=False)
        p.ensure(update_now=True)
        assert torch.equal(st[0][0][1], ref)
        assert p.step_metrics()["offload_bytes_read"] == 2 * 163_840
    finally:
        p.close()


def test_units_leaving_stable_come_back_and_resident_all_restores_everything(tmp_path):
    st = state(3)
    ref = [t.clone() for pairs in st.values() for _, t in pairs]
    p = make(tmp_path)
    try:
        place_away(p, st, ["stable", "stable", "stable"])
        p.begin_step(["core", "stable", "stable"], False, False)  # a re-tier moved unit 0 out
        p.ensure(update_now=False)
        assert torch.equal(st[0][0][1], ref[0]) and storage_bytes(st[1][0][1]) == 0
        p.resident_all()  # before a checkpoint is written
        assert all(torch.equal(t, r) for t, r in zip((t for ps in st.values() for _, t in ps), ref))
    finally:
        p.close()


def test_a_replaced_state_tensor_is_an_error_and_views_are_refused(tmp_path):
    st = state(4)
    p = make(tmp_path)
    try:
        p.add(st)
        with pytest.raises(RuntimeError, match="'master' of unit 1 was replaced"):
            p.add({1: [("master", torch.zeros(1_000))]})
        base = torch.zeros(100)
        assert owns_storage(base) and not owns_storage(base[10:20])
        with pytest.raises(ValueError, match="view into a larger buffer"):
            p.add({3: [("master", base[10:20])]})
    finally:
        p.close()


def test_prefetch_during_backward_does_not_trip_autograd_version_checks(tmp_path):
    # megatron's fp32 master shards are detached views of the params: they share the param's
    # version counter. The store must write their bytes without bumping it.
    w = torch.nn.Parameter(torch.randn(64, 64))
    master = w.detach().view(-1)
    master.data = master.data.clone()  # GRPO's own master storage, as in bind()
    x = torch.randn(8, 64)
    p = make(tmp_path)
    try:
        p.add({0: [("master", master)]})
        p.begin_step(["stable"], False, False)
        p.store.wait_all()
        p.settle()
        loss = (x @ w).square().sum()  # saves w for backward
        p.begin_step(["stable"], update_now=False, update_next=True)
        p.store.wait_all()
        loss.backward()  # would raise "modified by an inplace operation" on a bumped version
        assert w.grad is not None
    finally:
        p.close()


def test_background_error_reaches_the_step(tmp_path):
    st = state(5)
    cfg = OffloadConfig(chunk_mb=CHUNK / (1 << 20), offload_dir=str(tmp_path), capacity=64 << 10)
    p = TierPlacement(ChunkStore(cfg, rank=0), "ssd")
    try:
        p.add(st)
        with pytest.raises(OffloadCapacityError, match="no room for chunk"):
            # 320 KB into a 64 KiB file. State registered since the last step leaves before
            # this step's forward, so the failed write is waited for here.
            p.begin_step(["stable", "core", "core"], False, False)
        # Nothing was freed: the bytes that could not leave are still in the tensors.
        assert storage_bytes(st[0][0][1]) == 160_000
    finally:
        p.store.close()


def test_stream_keeps_two_units_resident_at_most_and_restores_every_byte(tmp_path):
    g = torch.Generator().manual_seed(6)
    st = {}
    for u in range(5):  # unit 4 is core: never streamed
        st[(u, "moments")] = [("m", torch.randn(20_000, generator=g))]
        st[(u, "master")] = [("w", torch.randn(10_000, generator=g))]
    ref = {k: v[0][1].clone() for k, v in st.items()}
    tiers = ["dynamic", "dynamic", "stable", "dynamic", "core"]
    p = TierPlacement(ChunkStore(OffloadConfig(chunk_mb=CHUNK / (1 << 20), offload_dir=str(tmp_path),
                                               capacity=8 << 20), rank=0), "ssd", stream=True)
    try:
        p.add(st)
        p.begin_step(tiers, update_now=False, update_next=False)
        assert p.windows(update_now=False) == [0, 1, 3]
        assert p.windows(update_now=True) == [0, 1, 2, 3]
        p.store.wait_all()  # in training, forward and backward run meanwhile
        p.ensure(update_now=False)
        seen = []

        def run(unit):
            allocated = {k[0] for k, u in p.units.items() if k[0] != 4
                         and any(storage_bytes(t.tensor) for t in u.tensors)}
            seen.append((unit, len(allocated)))
            for kind in ("moments", "master"):
                assert torch.equal(st[(unit, kind)][0][1], ref[(unit, kind)])
                st[(unit, kind)][0][1].add_(1.0)  # the optimizer's update

        p.stream(p.windows(update_now=True), run)
        assert [u for u, _ in seen] == [0, 1, 2, 3]
        assert all(n <= 3 for _, n in seen), seen  # this unit, the next one, the one leaving
        p.store.wait_all()
        p.settle()
        assert all(storage_bytes(st[(u, k)][0][1]) == 0 for u in range(4) for k in ("moments", "master"))
        assert storage_bytes(st[(4, "moments")][0][1]) == 80_000
        p.resident_all()
        for u in range(4):
            for kind in ("moments", "master"):
                assert torch.equal(st[(u, kind)][0][1], ref[(u, kind)] + 1.0)
    finally:
        p.close()


def test_planned_bytes_rounds_each_chunk_up():
    assert planned_bytes([1, CHUNK, CHUNK + 1], CHUNK) == 4096 + CHUNK + CHUNK + 4096


def test_a_flipped_byte_in_the_file_stops_the_step_naming_file_chunk_and_rank(tmp_path):
    from megatron_grpo.offload import OffloadChecksumError

    st = state(7)
    p = TierPlacement(ChunkStore(OffloadConfig(chunk_mb=CHUNK / (1 << 20), offload_dir=str(tmp_path),
                                               capacity=8 << 20, io_mode="buffered"), rank=3), "ssd")
    try:
        place_away(p, st, ["stable", "core", "core"])
        info = p.store.chunk_info(p.units[0].tensors[0].ids[1])
        with open(p.store.file.path, "r+b") as fh:  # the disk returns one bad byte
            fh.seek(info["file_offset"] + 100)
            byte = fh.read(1)
            fh.seek(info["file_offset"] + 100)
            fh.write(bytes([byte[0] ^ 0x01]))
        p.begin_step(["stable", "core", "core"], update_now=True, update_next=False)
        with pytest.raises(OffloadChecksumError) as err:
            p.ensure(update_now=True)
        text = str(err.value)
        assert "rank 3" in text and p.store.file.path in text and "chunk 2 of 3" in text
        assert "'unit0/master'" in text and "restart from the last checkpoint" in text
    finally:
        p.store.close()


def test_hidden_share_is_the_copy_time_the_step_did_not_wait_for(tmp_path):
    """offload_hidden_share = 1 - stall / copy busy time, per step (the device check prints it)."""
    p = make(tmp_path, "cpu")
    try:
        zero = {d: 0 for d in ("device_to_cpu", "cpu_to_device", "to_ssd", "from_ssd")}
        p._last_stats = {**p.store.stats(), "bytes": dict(zero), "seconds": {d: 0.0 for d in zero}}
        now = {**p.store.stats(),
               "bytes": {**zero, "device_to_cpu": 3_000_000, "cpu_to_device": 1_000_000},
               "seconds": {"device_to_cpu": 0.3, "cpu_to_device": 0.5, "to_ssd": 0.0, "from_ssd": 0.2}}
        p.store.stats = lambda: now
        p.stall_s = 0.25
        m = p.step_metrics()
        assert m["offload_io_busy_s"] == pytest.approx(1.0) and m["offload_stall_s"] == 0.25
        assert m["offload_hidden_share"] == pytest.approx(0.75)
        assert m["offload_write_gbps"] == pytest.approx(3e6 / 0.3 / 1e9)
        assert m["offload_read_gbps"] == pytest.approx(1e6 / 0.7 / 1e9)
    finally:
        del p.store.stats
        p.close()


def test_new_state_leaves_before_the_step_and_the_end_of_a_run_brings_nothing_back(tmp_path):
    st = state(7)
    ref = st[0][0][1].clone()
    p = make(tmp_path)
    p.add(st)
    # Registered before step 1 (the masters): gone when begin_step returns, not a step later
    # (resident through step 1, that was a run's peak).
    p.begin_step(["stable", "core", "core"], update_now=False, update_next=False)
    assert storage_bytes(st[0][0][1]) == 0 == storage_bytes(st[0][1][1])
    assert storage_bytes(st[1][0][1]) == 4_000  # core: stays
    # The end of a run: the store closes, its file goes, nothing is brought back.
    files = list(tmp_path.iterdir())
    p.close(restore=False)
    assert storage_bytes(st[0][0][1]) == 0 and files and not any(f.exists() for f in files)
    # close() (restore=True) still brings everything back first.
    st2 = state(7)
    q = make(tmp_path)
    q.add(st2)
    q.begin_step(["stable", "core", "core"], update_now=False, update_next=False)
    q.close()
    assert torch.equal(st2[0][0][1], ref)
