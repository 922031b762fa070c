"""Error feedback with staged residual updates: the identity, commit/discard, exact elements."""

import pytest
import torch

from megatron_grpo.comm.compress import COMPRESSOR_NAMES, Int4Compressor, Int8Compressor, build_compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback


def _randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _step(ef, key, g, c, dp, rank=0, commit=True, zero_index=None):
    """What CompressedReduceScatter does with the EF state, without the network."""
    grad = g.clone()
    owed = ef.owed(key, grad).view(dp, -1)
    payload = c.compress_rows(owed)
    ef.stage(key, grad, payload, rank, c, zero_index)
    # The residual is computed at stage time: the glue may free the whole gradient after the
    # sync, so nothing of it may be read at commit.
    assert not ef.references_grad(key)
    grad.fill_(float("nan"))
    (ef.commit if commit else ef.discard)()
    return payload


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_error_feedback_identity(name):
    c = build_compressor(name, 256, 0.05)
    ef = ErrorFeedback()
    n, dp, steps = 2 * 1000, 2, 50
    sent = torch.zeros(n, dtype=torch.float64)
    true = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        g = _randn(n, seed=100 + t) * (1 + t / 10)
        payload = _step(ef, "b0", g, c, dp, rank=t % 2)
        assert payload.shape == (dp, c.payload_bytes(n // dp))
        sent += c.decompress_rows(payload, n // dp).view(-1).double()
        true += g.double()
    expect = true - ef.residual("b0").double()
    assert float((sent - expect).norm() / expect.norm()) < 1e-5
    assert float(ef.residual("b0").norm()) < float(true.norm())  # bounded, not absorbing all


def test_discarded_step_leaves_the_residual_bit_identical():
    c, ef = Int4Compressor(256), ErrorFeedback()
    _step(ef, 0, _randn(1024, 1), c, 2)
    before = ef.residual(0).clone()
    bad = _randn(1024, 2)
    bad[700] = float("inf")  # a non-finite gradient: the optimizer skips the step
    _step(ef, 0, bad, c, 2, rank=1, commit=False)
    assert torch.equal(ef.residual(0), before) and bool(torch.isfinite(ef.residual(0)).all())
    # Committing the same bad step instead poisons the residual's chunk for good: what the
    # skip protects against.
    _step(ef, 0, bad, c, 2, rank=1, commit=True)
    assert not bool(torch.isfinite(ef.residual(0)).all())


def test_first_step_discarded_keeps_no_residual():
    ef = ErrorFeedback()
    _step(ef, "k", _randn(512, 3), Int8Compressor(256), 2, commit=False)
    assert ef.residual("k") is None and not ef.pending


def test_exact_elements_keep_a_zero_residual():
    c, ef = Int4Compressor(256), ErrorFeedback()
    index = torch.tensor([0, 5, 600, 1023])
    for t in range(3):
        g = _randn(1024, 10 + t)
        g.index_fill_(0, index, 0.0)  # what ReplicatedElements.take leaves in the buffer
        _step(ef, 1, g, c, 2, zero_index=index)
    assert torch.equal(ef.residual(1).index_select(0, index), torch.zeros(4))
    assert float(ef.residual(1).abs().sum()) > 0


def test_bookkeeping_and_checkpoint():
    c, ef = Int8Compressor(256), ErrorFeedback()
    assert ef.residual(1) is None and ef.nbytes() == 0
    _step(ef, 1, _randn(512, 9), c, 2)
    assert ef.nbytes() == 512 * 4
    state = ef.state_dict()
    assert state["residuals"][1].device.type == "cpu"
    restored = ErrorFeedback()
    restored.load_state_dict(state)
    assert torch.equal(restored.residual(1), ef.residual(1))
    g2 = _randn(512, 10)
    assert torch.equal(_step(ef, 1, g2, c, 2), _step(restored, 1, g2, c, 2))  # same state, same bytes
    grad = g2.clone()
    ef.owed(1, grad)
    ef.stage(1, grad, c.compress_rows(grad.view(2, -1)), 0, c)
    assert ef.nbytes() == 2 * 512 * 4  # the committed residual and the staged one
    with pytest.raises(RuntimeError, match="staged"):
        ef.state_dict()  # a checkpoint in the middle of a step would lose the staged update
    ef.discard()
    ef.reset(1)
    assert torch.equal(ef.residual(1), torch.zeros(512))
    ef.drop(1)
    assert ef.residual(1) is None and ef.nbytes() == 0


def test_errors_name_arguments():
    ef = ErrorFeedback()
    with pytest.raises(ValueError, match="float32"):
        ef.owed(0, torch.zeros(4, dtype=torch.float16))
    _step(ef, 0, torch.ones(10), Int4Compressor(256), 2)
    with pytest.raises(ValueError, match="drop"):
        ef.owed(0, torch.zeros(12))
    with pytest.raises(ValueError, match="residuals"):
        ef.load_state_dict({})
