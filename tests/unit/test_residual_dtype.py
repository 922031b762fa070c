"""Error-feedback residuals staged at once and stored in fp32, bf16 or int8.

``stage`` computes r' = c - D(q) while the gradient buffer still holds c, so the megatron glue
can free the bucket's gradient right after its sync: every test here overwrites the whole
gradient after staging (the old code read it again at commit). fp32 residuals must be the old
formula's bits; bf16 and int8 are that residual rounded, and a skipped step keeps the old one."""

import io

import pytest
import torch

from megatron_grpo.comm.compress import build_compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback, QuantisedResidual, residual_nbytes

DTYPES = ("fp32", "bf16", "int8")


def _randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _old_residual(c, payload, rank, compressor, zero_index=None):
    """The residual exactly as ErrorFeedback.commit computed it with fp32 residuals: the buffer as
    commit saw it (own shard overwritten by the reduce-scatter), the own shard's c put back,
    every row minus the decode of the whole payload, exact elements zeroed."""
    dp = payload.shape[0]
    shard = c.numel() // dp
    c_own = c[rank * shard:(rank + 1) * shard].clone()
    grad = c.clone()
    grad[rank * shard:(rank + 1) * shard].fill_(123.0)  # the reduce-scatter's sum
    residual = torch.empty_like(grad)
    residual.copy_(grad)
    rows = residual.view(dp, shard)
    rows[rank].copy_(c_own)
    rows.sub_(compressor.decompress_rows(payload, shard))
    if zero_index is not None and zero_index.numel():
        residual.index_fill_(0, zero_index, 0.0)
    return residual


def _stage(ef, key, g, compressor, dp, rank=0, zero_index=None, block=None, stats=None):
    """What CompressedReduceScatter does with the EF state; afterwards the whole gradient is
    overwritten (the glue frees it after the sync). Returns (c, payload)."""
    grad = g.clone()
    if zero_index is not None:
        grad.index_fill_(0, zero_index, 0.0)  # what ReplicatedElements.take leaves
    c = ef.owed(key, grad).clone()
    payload = compressor.compress_rows(grad.view(dp, -1))
    ef.stage(key, grad, payload, rank, compressor, zero_index, stats=stats, block_elements=block)
    assert not ef.references_grad(key)
    grad.fill_(float("nan"))
    return c, payload


def _expected(reference, dtype, chunk):
    if dtype == "fp32":
        return reference
    if dtype == "bf16":
        return reference.to(torch.bfloat16)
    return QuantisedResidual.quantise(reference, chunk)


def _same(a, b) -> bool:
    if isinstance(a, QuantisedResidual):
        return isinstance(b, QuantisedResidual) and torch.equal(a.payload, b.payload) and a.numel() == b.numel()
    return a.dtype == b.dtype and torch.equal(a, b)


# ---- fp32: the old formula's bits --------------------------------------------------------------
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("name", ["int4", "int8", "int2", "topk"])
def test_fp32_staged_residual_is_the_old_commit_bit_for_bit(dp, name):
    compressor = build_compressor(name, 256, 0.05)
    ef, n = ErrorFeedback("fp32"), dp * 1000
    zero_index = torch.tensor([3, 999, 1000, n - 1])
    for step in range(4):
        rank = step % dp
        c, payload = _stage(ef, "b", _randn(n, 7 * dp + step) * (1 + step), compressor, dp, rank,
                            zero_index, block=1000 if step % 2 else None)  # one shard per block, or all
        expect = _old_residual(c, payload, rank, compressor, zero_index)
        assert torch.equal(ef.staged("b"), expect), (step, float((ef.staged("b") - expect).abs().max()))
        ef.commit()
        assert torch.equal(ef.residual("b"), expect)


# ---- every dtype: stage, commit, discard ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 1000, 3000])
def test_commit_stores_the_rounded_residual_and_discard_keeps_the_old_one(dtype, block):
    # Shards of 1000 are not whole chunks of 256: an int8 chunk straddles two shards, and with
    # blocks of one or three shards it straddles two blocks too.
    # int2 has no zero level: the exact elements' D(q) is +-0.45 RMS, so their residual is
    # zeroed by stage, not by the arithmetic.
    compressor, dp, n = build_compressor("int2", 256), 4, 4000
    ef = ErrorFeedback(dtype, 256)
    zero_index = torch.tensor([5, 999, 2500])
    committed = None
    for step in range(5):
        skipped = step == 2
        c, payload = _stage(ef, 0, _randn(n, 40 + step), compressor, dp, rank=step % dp,
                            zero_index=zero_index, block=block)
        reference = _old_residual(c, payload, step % dp, compressor, zero_index)
        assert _same(ef.staged(0), _expected(reference, dtype, 256)), step
        if skipped:
            ef.discard()
            assert not ef.pending and _same(ef.stored(0), committed)  # exactly as it was
        else:
            ef.commit()
            committed = ef.stored(0).clone()
            assert _same(committed, _expected(reference, dtype, 256))


@pytest.mark.parametrize("dtype", DTYPES)
def test_owed_adds_the_stored_residual_exactly(dtype):
    ef, compressor = ErrorFeedback(dtype, 128), build_compressor("int8", 256)
    _stage(ef, "k", _randn(2048, 1), compressor, 2)
    ef.commit()
    g = _randn(2048, 2)
    values = ef.residual("k")
    assert values.dtype == torch.float32 and values.shape == (2048,)
    assert torch.equal(ef.owed("k", g.clone()), g + values)  # bf16 -> fp32 and int8 decode are exact


def test_int8_is_absmax_over_127_per_chunk_rounded_to_nearest():
    x = _randn(1000, 5) * torch.linspace(0.01, 10, 1000)  # chunks of very different scale
    x[256:512] = 0.0  # an all-zero chunk: scale 0, decodes to 0
    q = QuantisedResidual.quantise(x, 256)
    got = q.float()
    for start in range(0, 1000, 256):
        chunk = x[start:start + 256]
        amax = chunk.abs().max()
        if amax == 0:
            assert torch.equal(got[start:start + 256], torch.zeros_like(chunk))
            continue
        scale = amax / 127
        codes = torch.floor(chunk * (amax.reciprocal() * 127) + 0.5).clamp(-127, 127)
        assert torch.equal(got[start:start + 256], codes * scale), start
        assert float((got[start:start + 256] - chunk).abs().max()) <= float(scale) / 2 * 1.0001
    assert q.nbytes() == 4 * (4 + 256)  # 4 chunks, the last one short (232) padded to 256


def test_stage_residual_converts_at_stage_time():
    # PowerSGD and the inter-instance all-reduce hand over the new residual itself.
    r = _randn(3000, 9)
    index = torch.tensor([0, 1500])
    for dtype in DTYPES:
        ef = ErrorFeedback(dtype, 256)
        ef.stage_residual("p", r.clone(), index)
        expect = r.clone().index_fill_(0, index, 0.0)
        assert _same(ef.staged("p"), _expected(expect, dtype, 256)), dtype
        ef.discard()
        assert ef.stored("p") is None


def test_stats_see_every_block_once_and_the_same_values():
    compressor, dp, n = build_compressor("int4", 256), 8, 8 * 512
    seen = []
    ef = ErrorFeedback("int8")
    c, payload = _stage(ef, 0, _randn(n, 3), compressor, dp, block=2 * 512,
                        stats=lambda applied, owed: seen.append((applied.clone(), owed.clone())))
    assert [a.numel() for a, _ in seen] == [1024] * 4
    assert torch.equal(torch.cat([a for a, _ in seen]), compressor.decompress_rows(payload, 512).view(-1))
    assert torch.equal(torch.cat([o for _, o in seen]), c)


# ---- bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,per_element", [("fp32", 4.0), ("bf16", 2.0), ("int8", 1 + 4 / 256)])
def test_nbytes_per_dtype(dtype, per_element):
    compressor, dp, n = build_compressor("int4", 256), 2, 2 * 4096
    ef = ErrorFeedback(dtype, 256)
    assert ef.nbytes() == 0
    _stage(ef, 0, _randn(n, 1), compressor, dp)
    assert ef.nbytes() == n * per_element  # staged only
    ef.commit()
    assert ef.nbytes() == n * per_element == residual_nbytes(n, dtype, 256)
    _stage(ef, 0, _randn(n, 2), compressor, dp)
    assert ef.nbytes() == 2 * n * per_element  # until commit: the old one and the new one
    ef.discard()
    assert ef.nbytes() == n * per_element


# ---- checkpoints -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_round_trip_is_exact_and_resumes_bit_for_bit(dtype):
    compressor, dp, n = build_compressor("int4", 256), 2, 3000
    ef = ErrorFeedback(dtype, 128)
    for step in range(3):
        _stage(ef, (step % 2, 0), _randn(n, step), compressor, dp)
        ef.commit()
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # plain tensors, ints and strings only
    restored = ErrorFeedback(dtype, 128)
    restored.load_state_dict(state)
    for key in ef.keys():
        assert _same(restored.stored(key), ef.stored(key)), key
    g = _randn(n, 99)
    a = _stage(ef, (0, 0), g, compressor, dp)[1]
    b = _stage(restored, (0, 0), g, compressor, dp)[1]
    assert torch.equal(a, b)  # the same bytes on the wire
    ef.commit(), restored.commit()
    assert _same(restored.stored((0, 0)), ef.stored((0, 0)))


def test_a_checkpoint_of_another_dtype_is_converted():
    fp32 = ErrorFeedback("fp32")
    _stage(fp32, 0, _randn(1024, 4), build_compressor("int4", 256), 2)
    fp32.commit()
    old_format = {"residuals": {0: fp32.residual(0).clone()}}  # a checkpoint from before int8 residuals
    for dtype in DTYPES:
        ef = ErrorFeedback(dtype, 256)
        ef.load_state_dict(old_format)
        assert _same(ef.stored(0), _expected(fp32.residual(0), dtype, 256)), dtype
    int8 = ErrorFeedback("int8")
    int8.load_state_dict(fp32.state_dict())
    back = ErrorFeedback("fp32")
    back.load_state_dict(int8.state_dict())
    assert torch.equal(back.residual(0), int8.residual(0))


def test_reset_zeroes_every_dtype_and_bad_dtype_is_refused():
    for dtype in DTYPES:
        ef = ErrorFeedback(dtype)
        _stage(ef, 0, _randn(1024, 4), build_compressor("int4", 256), 2)
        ef.commit()
        ef.reset(0)
        assert torch.equal(ef.residual(0), torch.zeros(1024)), dtype
        assert not torch.signbit(ef.residual(0)).any()  # +0, not -0: what quantising zeros gives
    with pytest.raises(ValueError, match="--grpo-residual-dtype"):
        ErrorFeedback("fp16")
    with pytest.raises(ValueError, match="--grpo-compress-chunk"):
        ErrorFeedback("int8", 0)
