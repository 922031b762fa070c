"""DelayedAccumulators (--grpo-stable-mode delayed) in device memory and in the memory tier's
store (host memory or SSD): the same sums bit for bit through skipped steps and
skipped updates, a checkpoint round trip, and between uses no accumulator resident beyond the
read-ahead."""

import pytest
import torch

from megatron_grpo.comm.accumulators import DelayedAccumulators
from megatron_grpo.offload import ChunkStore, OffloadConfig
from megatron_grpo.offload.residuals import OffloadedResiduals

N, KEYS, INTERVAL = 4096, [(u, 0) for u in range(6)], 4


def _grad(step, key, dtype=torch.float32):
    g = torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + key[0]))
    return g.to(dtype)


def _run(acc, steps, skipped=(), begin=None, dtype=torch.float32):
    """Delayed stable buckets: held every step but the update (every INTERVAL), where the
    sum is read in backward, added to that step's gradient and released."""
    seen = {}
    for step in range(1, steps + 1):
        if begin is not None:
            begin()
        for key in KEYS:
            g = _grad(step, key, dtype)
            if step % INTERVAL == 0:
                taken = acc.take(key)
                if taken is not None:
                    total, count = taken
                    seen[(step, key)] = (g + total) / (count + 1)
                    acc.release(key)
            else:
                acc.hold(key, g)
        if step in skipped:
            acc.discard()
        else:
            acc.commit()
    return seen


def _store(tmp_path, target):
    cfg = OffloadConfig(chunk_mb=0.0078125, offload_dir=str(tmp_path) if target == "ssd" else None,
                        capacity=4 << 20)
    return ChunkStore(cfg, rank=0)


@pytest.mark.parametrize("target", ["ssd", "cpu"])
def test_offloaded_accumulators_give_the_same_updates_through_skipped_steps(tmp_path, target):
    # 2: a held step skipped (its gradient is not summed); 8: an update skipped (the sum of
    # 5-7 stays, and the update at 12 reads 5-7 and 9-11).
    skipped = (2, 8)
    plain = DelayedAccumulators()
    want = _run(plain, 13, skipped)
    assert {s for s, _ in want} == {4, 8, 12}
    with _store(tmp_path, target) as store:
        kept = OffloadedResiduals(store, target, lookahead=2)
        acc = DelayedAccumulators()
        acc.use_store(kept)
        got = _run(acc, 13, skipped, begin=kept.begin_step)
        store.wait_all()
        kept.settle()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        # Once the writes have landed, no sum is resident.
        assert kept.nbytes() == 0
        assert kept.placed_bytes() == len(KEYS) * N * 4
        assert acc.counts == plain.counts == {k: 1 for k in KEYS}
        assert all(torch.equal(acc[k][0], plain[k][0]) for k in KEYS)


def test_the_dict_path_sums_exactly_what_was_held_since_the_last_update():
    acc = DelayedAccumulators()
    seen = _run(acc, 7, skipped=(5,))
    # Update at 4 read steps 1-3; after it, 5 was skipped, 6 and 7 are summed.
    for key in KEYS:
        want = (_grad(4, key) + _grad(1, key) + _grad(2, key) + _grad(3, key)) / 4
        assert torch.allclose(seen[(4, key)], want, rtol=0, atol=1e-6)
        total, count = acc[key]
        assert count == 2 and torch.equal(total, _grad(6, key) + _grad(7, key))
    # Dropped units (re-tiered) leave nothing behind.
    acc.drop(KEYS[0])
    assert KEYS[0] not in acc.keys() and acc.nbytes() == (len(KEYS) - 1) * N * 4


@pytest.mark.parametrize("target", ["ssd", "cpu"])
def test_a_checkpoint_of_offloaded_accumulators_restores_them_in_either_placement(tmp_path, target):
    with _store(tmp_path, target) as store:
        kept = OffloadedResiduals(store, target, lookahead=2)
        acc = DelayedAccumulators()
        acc.use_store(kept)
        _run(acc, 6, begin=kept.begin_step)  # 5 and 6 summed after the update at 4
        state = acc.state_dict()
        store.wait_all()
        kept.settle()
        assert kept.nbytes() == 0  # saving read them back and released them
    plain = DelayedAccumulators()
    plain.load_state_dict(state, torch.device("cpu"))
    assert plain.counts == {k: 2 for k in KEYS}
    for key in KEYS:
        assert torch.equal(plain[key][0], _grad(5, key) + _grad(6, key))
    (tmp_path / "again").mkdir()
    with _store(tmp_path / "again", target) as store:
        kept = OffloadedResiduals(store, target, lookahead=2)
        moved = DelayedAccumulators()
        moved.use_store(kept)
        moved.load_state_dict(state, torch.device("cpu"))
        store.wait_all()
        kept.settle()
        assert kept.nbytes() == 0  # loaded straight into the store
        for key in KEYS:  # the loaded state itself was copied, not freed by the store
            assert state[key][0].untyped_storage().nbytes() == N * 4
            assert torch.equal(state[key][0], _grad(5, key) + _grad(6, key))
        assert all(torch.equal(moved[k][0], plain[k][0]) for k in KEYS)


def test_bf16_gradient_buffers_keep_bf16_sums():
    acc = DelayedAccumulators()
    _run(acc, 3, dtype=torch.bfloat16)
    assert all(acc[k][0].dtype == torch.bfloat16 for k in KEYS)
