"""OffloadedResiduals: error-feedback residuals kept on SSD between their read and their write
give the same bits as residuals kept in memory, through skipped steps, with a few resident, in
every residual dtype (fp32, bf16, int8: stored as their raw bytes, scales included)."""

import pytest
import torch

from megatron_grpo.comm.compress import Int4Compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback, backing_tensor, residual_nbytes
from megatron_grpo.offload import ChunkStore, OffloadConfig
from megatron_grpo.offload.residuals import OffloadedResiduals
from megatron_grpo.offload.slot_file import align_up


def _grad(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _owe_and_stage(ef, key, g, c, dp, rank):
    """What CompressedReduceScatter does with the EF state during backward, without the network."""
    grad = g.clone()
    payload = c.compress_rows(ef.owed(key, grad).view(dp, -1))
    ef.stage(key, grad, payload, rank, c)
    grad.fill_(float("nan"))  # freed after the sync: stage has taken what it needs
    return payload


def _same(a, b) -> bool:
    a, b = backing_tensor(a), backing_tensor(b)
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("target", ["ssd", "cpu"])
def test_offloaded_residuals_are_bit_identical_through_skipped_steps(tmp_path, target, dtype):
    c, dp, n, keys = Int4Compressor(256), 2, 8192, [(u, 0) for u in range(10)]
    cfg = OffloadConfig(chunk_mb=0.25, offload_dir=str(tmp_path) if target == "ssd" else None,
                        capacity=8 << 20)
    each = residual_nbytes(n, dtype, 256)  # the raw bytes of one residual: 4, 2 or ~1 per element
    with ChunkStore(cfg, rank=0) as store:
        res = OffloadedResiduals(store, target, lookahead=2)
        plain, offloaded = ErrorFeedback(dtype, 256), ErrorFeedback(dtype, 256)
        offloaded.use_store(res)
        resident_during_backward = []
        for step in range(8):
            res.begin_step()
            skipped = step in (3, 6)
            for key in reversed(keys):  # backward: the last buckets are ready first
                g = _grad(n, 1000 * step + key[0])
                if skipped and key[0] == 2:
                    g[5] = float("inf")  # found later by the optimizer: the step is skipped
                a = _owe_and_stage(plain, key, g, c, dp, step % dp)
                b = _owe_and_stage(offloaded, key, g, c, dp, step % dp)
                assert torch.equal(a, b)  # the same payloads went on the wire
                resident_during_backward.append(res.nbytes() // each)
            if skipped:
                plain.discard(), offloaded.discard()
            else:
                plain.commit(), offloaded.commit()
        store.wait_all()
        res.settle()
        assert offloaded.nbytes() == 0  # between steps every residual is away
        # From the second step on, backward holds at most lookahead + 1 being read and
        # lookahead + 1 still being written: 6 of the 10, however the threads are scheduled.
        assert 2 <= max(resident_during_backward[len(keys):]) <= 6
        assert res.placed_bytes() == len(keys) * each  # compact in the store too
        # One registration per key, reused by every commit (a new one each step would grow the
        # store's chunk table for good).
        assert sum(store.stats()["resident_bytes"].values()) == len(keys) * each
        if target == "ssd":
            assert store.stats()["ssd_used_bytes"] == len(keys) * align_up(each)
        for key in keys:
            assert _same(offloaded.stored(key), plain.stored(key)), key
        state = offloaded.state_dict()["residuals"]
        assert set(state) == set(keys)
        restored = ErrorFeedback(dtype, 256)
        restored.load_state_dict(offloaded.state_dict())  # the checkpoint of an offloaded run
        assert all(_same(restored.stored(k), plain.stored(k)) for k in keys)


def test_reset_and_drop_go_through_the_store(tmp_path):
    c = Int4Compressor(256)
    with ChunkStore(OffloadConfig(chunk_mb=0.25, offload_dir=str(tmp_path), capacity=4 << 20),
                    rank=0) as store:
        ef = ErrorFeedback()
        ef.use_store(OffloadedResiduals(store, "ssd"))
        for step in range(2):
            _owe_and_stage(ef, "a", _grad(4096, step), c, 2, 0)
            _owe_and_stage(ef, "b", _grad(4096, 10 + step), c, 2, 0)
            ef.commit()
        store.wait_all()
        ef.reset("a")
        store.wait_all()
        assert float(ef.residual("a").abs().sum()) == 0.0
        used = store.stats()["ssd_used_bytes"]
        ef.drop("b")
        assert ef.keys() == ["a"] and ef.residual("b") is None
        assert store.stats()["ssd_used_bytes"] == used - 16384  # b's extent is given back
