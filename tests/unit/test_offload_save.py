"""Checkpoints with the memory tier: a save brings no offloaded state back to the device (it is
read from the chunk store into host memory, through a map of the SSD file where it can be), the
error-feedback residuals a save reads are released again, and a skipped step leaves no gradient
shard it read ahead resident (docs/offload.md, "Checkpoints")."""

import pytest
import torch

from megatron_grpo.comm.compress import Int4Compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback, backing_tensor
from megatron_grpo.offload import ChunkStore, OffloadChecksumError, OffloadConfig
from megatron_grpo.offload.placement import AWAY, RESIDENT, TierPlacement
from megatron_grpo.offload.residuals import OffloadedResiduals

CHUNK = 64 << 10  # 64 KiB chunks: a 40,000-element fp32 tensor is 3 chunks


def config(tmp_path, target, workers=1):
    # One I/O worker: chunks are written in the order asked, so a tensor's extents follow each
    # other in the file (two workers may interleave them; the store then copies instead).
    return OffloadConfig(chunk_mb=CHUNK / (1 << 20), io_workers=workers, capacity=8 << 20,
                         offload_dir=str(tmp_path) if target == "ssd" else None)


def storage_bytes(t):
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("target", ["ssd", "cpu"])
def test_a_save_reads_away_state_from_the_store_and_brings_no_unit_back(tmp_path, target):
    g = torch.Generator().manual_seed(1)
    st = {}
    for u in range(4):  # units 0-2 dynamic (streamed, away after the step), unit 3 core
        st[(u, "moments")] = [("exp_avg", torch.randn(40_000, generator=g)),
                              ("exp_avg_sq", torch.rand(40_000, generator=g).to(torch.bfloat16))]
        st[(u, "master")] = [("w", torch.randn(3, 1000, generator=g))]
    ref = {(k, name): t.clone() for k, pairs in st.items() for name, t in pairs}
    tiers = ["dynamic", "dynamic", "dynamic", "core"]
    p = TierPlacement(ChunkStore(config(tmp_path, target), rank=0), target, stream=True)
    fetches = []  # every chunk any save below asks back to the device
    prefetch = p.store.prefetch

    def counted(chunk_id, keep=False):
        fetches.append(chunk_id)
        return prefetch(chunk_id, keep)

    def save():
        """What the training loop does: before_save (prepare_save), then megatron's state dict
        reads every tensor through GRPODistributedOptimizer (saved_tensor). Returns the copies,
        the groups holding device memory before it (resident, arriving or leaving), those
        resident once it has let the moves in flight land, and the most groups holding device
        memory at once while it read."""
        def on_device():
            return {k for k, u in p.units.items() if u.state != AWAY}
        before = on_device()
        p.store.prefetch = counted
        try:
            p.prepare_save()
            resident = {k for k, u in p.units.items() if u.state == RESIDENT}
            most, saved = len(on_device()), {}
            for key, pairs in st.items():
                for name, t in pairs:
                    saved[(key, name)] = p.saved_tensor(t)
                    most = max(most, len(on_device()))
            return saved, before, resident, most
        finally:
            p.store.prefetch = prefetch

    def check(saved, resident, expected):
        for (key, name), t in saved.items():
            live = dict(st[key])[name]
            if key in resident:  # resident: the tensor itself, as without the tier
                assert t is live and p.units[key].state == RESIDENT
            else:  # away: a host copy; the placed tensor still owns no memory
                assert t is not live and storage_bytes(live) == 0 and p.units[key].state == AWAY
            assert t.device.type == "cpu" and t.dtype == live.dtype and t.shape == live.shape
            assert torch.equal(t, expected[(key, name)]), (key, name)

    try:
        p.add(st)
        # The streamed units leave; the first one's state is read back already for the step.
        p.begin_step(tiers, update_now=False, update_next=False)
        saved, before, resident, most = save()
        core = {(3, "moments"), (3, "master")}
        assert before == resident == core | {(0, "moments"), (0, "master")}
        assert fetches == [] and most == 4  # the save brought no unit back
        check(saved, resident, ref)
        # Which way each away tensor came out: 2 units x (160,000 + 80,000 + 12,000) bytes.
        reads = p.store.stats()["checkpoint_reads"]
        if target == "ssd":  # each tensor's chunks lie in order in the file: mapped, crc checked
            assert reads == {"mapped": 504_000, "host": 0, "copied": 0}
        else:  # a one-chunk tensor is its host copy; a longer one is copied chunk by chunk
            assert reads == {"mapped": 0, "host": 2 * 12_000, "copied": 2 * 240_000}
        # The next step streams the units as if no save had happened: nothing was written again.
        written = {d: p.store.stats()["bytes"][d] for d in ("device_to_cpu", "to_ssd")}

        def update(unit):
            if unit == 0:  # the stream's own writes start after this update
                assert written == {d: p.store.stats()["bytes"][d] for d in written}
            for kind in ("moments", "master"):
                for name, t in st[(unit, kind)]:
                    t.add_(1)
                    ref[((unit, kind), name)] += 1
        p.ensure(update_now=False)
        p.stream(p.windows(update_now=False), update)
        # A save after a streamed step, as in training: every streamed unit away or leaving.
        saved, before, resident, most = save()
        # Units 1 and 2 may still be being written out: freed, not kept, by the save.
        assert core <= before <= core | {(u, k) for u in (1, 2) for k in ("moments", "master")}
        assert resident == core and fetches == [] and most == 2
        check(saved, resident, ref)
        assert sum(p.store.stats()["checkpoint_reads"].values()) == 504_000 + 756_000
        p.resident_all()
        assert all(torch.equal(t, ref[(k, name)]) for k, pairs in st.items() for name, t in pairs)
    finally:
        p.close()


def test_spread_chunks_are_read_into_one_host_tensor_and_a_bad_chunk_stops_the_save(tmp_path):
    g = torch.Generator().manual_seed(2)
    a, b, c = (torch.randn(40_000, generator=g) for _ in range(3))
    ref_a, ref_c = a.clone(), c.clone()
    with ChunkStore(config(tmp_path, "ssd"), rank=5) as store:
        ids_a, ids_b, ids_c = store.register("a", a), store.register("b", b), store.register("c", c)
        for i, j in zip(ids_a, ids_b):  # interleaved: a's extents are not consecutive
            store.evict(i, "ssd"), store.evict(j, "ssd")
        for i in ids_c:  # c's are
            store.evict(i, "ssd")
        store.wait_all()
        assert [store.chunk_info(i)["file_offset"] for i in ids_a] == [0, 2 * CHUNK, 4 * CHUNK]
        first = store.chunk_info(ids_c[0])["file_offset"]
        assert [store.chunk_info(i)["file_offset"] for i in ids_c] == [first + k * CHUNK for k in range(3)]
        assert torch.equal(store.host_bytes(ids_a).view(torch.float32), ref_a)
        assert torch.equal(store.host_bytes(ids_c).view(torch.float32), ref_c)
        assert store.stats()["checkpoint_reads"] == {"mapped": 160_000, "host": 0, "copied": 160_000}
        assert [store.location(i) for i in ids_a + ids_c] == ["ssd"] * 6  # read, not moved
        # A flipped byte under c's second chunk: the map's check sees it, and the copying read
        # it falls back to raises, naming the chunk, the file and the rank: no bad state saved.
        offset = store.chunk_info(ids_c[1])["file_offset"]
        with open(store.file.path, "r+b") as fh:
            fh.seek(offset + 10)
            byte = fh.read(1)
            fh.seek(offset + 10)
            fh.write(bytes([byte[0] ^ 0x40]))
        with pytest.raises(OffloadChecksumError, match=r"rank 5\): checksum mismatch reading chunk "
                                                       r"\d+ \(tensor 'c', chunk 2 of 3"):
            store.host_bytes(ids_c)
        assert torch.equal(c, ref_c)  # a read for a save never writes the registered tensor


def _step(ef, keys, c, seed):
    """One step of backward (each residual added into its gradient, then staged) and commit."""
    for key in reversed(keys):  # backward: the last buckets are ready first
        grad = torch.randn(4096, generator=torch.Generator().manual_seed(seed + key[0]))
        payload = c.compress_rows(ef.owed(key, grad).view(2, -1))
        ef.stage(key, grad, payload, 0, c)
    ef.commit()


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_error_feedback_state_dict_releases_every_offloaded_residual(tmp_path, dtype):
    c, keys = Int4Compressor(256), [(u, 0) for u in range(6)]
    with ChunkStore(config(tmp_path, "ssd", workers=2), rank=0) as store:
        res = OffloadedResiduals(store, "ssd", lookahead=2)
        plain, offloaded = ErrorFeedback(dtype, 256), ErrorFeedback(dtype, 256)
        offloaded.use_store(res)
        for step in range(3):
            res.begin_step()
            _step(plain, keys, c, 100 * step)
            _step(offloaded, keys, c, 100 * step)
        store.wait_all()
        res.settle()
        saved = offloaded.state_dict()  # the checkpoint reads every residual in key order
        # The same content as residuals kept in memory, and none of them left resident (kept,
        # each stayed on the device until its read in the next backward).
        expected = plain.state_dict()
        assert list(saved["residuals"]) == list(expected["residuals"]) == keys[::-1]
        for key in keys:
            s, e = saved["residuals"][key], expected["residuals"][key]
            if dtype == "int8":
                assert torch.equal(s["int8_payload"], e["int8_payload"])
            else:
                assert torch.equal(s, e)
        assert res.nbytes() == 0 and sum(res.device_bytes_by_key().values()) == 0
        assert all(storage_bytes(backing_tensor(res._tensors[k])) == 0 for k in keys)
        # The next step reads them back as before: the same bits as the plain ones.
        res.begin_step()
        _step(plain, keys, c, 900)
        _step(offloaded, keys, c, 900)
        for key in keys:
            assert torch.equal(offloaded.residual(key), plain.residual(key))


def test_reading_every_residual_in_another_order_reads_none_ahead_that_was_released(tmp_path):
    # What a checkpoint does (ErrorFeedback's and DelayedAccumulators' state_dict): read each
    # key and release it, in key order, after a backward that read them in reverse. Reading
    # ahead in the backward's order brought back keys already read and released: resident
    # until the next step.
    keys = [(u, 0) for u in range(6)]
    with ChunkStore(config(tmp_path, "cpu"), rank=0) as store:
        res = OffloadedResiduals(store, "cpu", lookahead=2)
        for k in keys:
            res[k] = torch.full((4096,), float(k[0]))
        for step in range(2):
            res.begin_step()
            for k in reversed(keys):  # backward
                assert res.get(k)[0].item() == k[0]
                res.release(k)
            for k in reversed(keys):  # commit: the same values written again
                res[k] = res.buffer(k, torch.empty(4096)).fill_(k[0])
            store.wait_all()
            res.settle()
        for k in keys:  # the save
            assert res.get(k)[0].item() == k[0]
            res.release(k)
        assert res.nbytes() == 0 and all(res._state[k] == AWAY for k in keys)
        res.begin_step()  # the next step reads ahead in the backward's order, as before
        assert [k for k in keys if res._state[k] != AWAY] == keys[-2:]


def test_a_skipped_step_leaves_no_gradient_shard_it_read_ahead_resident(tmp_path):
    from types import SimpleNamespace

    from megatron_grpo.megatron.grad_shards import GradShards
    from megatron_grpo.megatron.grad_storage import BucketGrads

    class Bucket:
        def __init__(self, seed):
            self.grad_data = torch.randn(8192, generator=torch.Generator().manual_seed(seed))
            self.params_list = []

    groups = [SimpleNamespace(buckets=[]) for _ in range(3)]
    ctrl = SimpleNamespace(units=[SimpleNamespace(group=g) for g in groups])
    placement = SimpleNamespace(windows=lambda update_now: [0, 1, 2])
    with ChunkStore(config(tmp_path, "ssd"), rank=0) as store:
        grads_store = OffloadedResiduals(store, "ssd", lookahead=2, prefix="grad")
        shards = GradShards(grads_store, placement, ctrl, optimizers=[])
        for step in range(2):
            shards.begin_step(update_now=False)
            held = []
            for u in (2, 1, 0):  # backward: each bucket's shard leaves at its sync
                groups[u].buckets = [Bucket(100 * step + 10 * u + i) for i in range(2)]
                for i, bucket in enumerate(groups[u].buckets):
                    grads = BucketGrads(bucket, rank=1, size=2, late=[])
                    shards.release(u, i, grads)
                    held.append(grads)
            store.wait_all()
            # Backward is over: the optimizer step reads ahead the first units' shards...
            shards.expect([0, 1, 2])
            assert sum(grads_store.device_bytes_by_key().values()) == 2 * 16_384
            if step == 1:  # ... and then updates every unit with them
                for u in (0, 1, 2):
                    shards.fetch(u)
            # step 0: a non-finite gradient skips the step; the shards are dropped unread.
            for grads in held:  # GradStorage.after_step
                grads.drop()
            assert grads_store.nbytes() == 0, f"step {step}: shards left resident"
            assert sum(grads_store.device_bytes_by_key().values()) == 0
            assert all(grads_store._state[k] == AWAY for k in grads_store.keys())
