"""Dynamic-tier compressors and error feedback: exact payload sizes, error bounds, EF invariant."""

import math

import pytest
import torch

from megatron_grpo.comm.compress import (
    COMPRESSOR_NAMES,
    Compressor,
    ErrorFeedback,
    Int4Compressor,
    Int8Compressor,
    TopKCompressor,
    build_compressor,
)

LENGTHS = (1, 255, 256, 257, 10_000)
EPS = torch.finfo(torch.float32).eps


def _randn(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


# Sizes worked out by hand from the documented formats (chunk 256, top-k ratio 0.05):
# int4 4*ceil(N/256) + round4(ceil(N/2)); int8 4*ceil(N/256) + round4(N); topk 8*ceil(0.05 N).
@pytest.mark.parametrize("name, sizes", [
    ("int4", (8, 132, 132, 140, 5160)),
    ("int8", (8, 260, 260, 268, 10160)),
    ("topk", (8, 104, 104, 104, 4000)),
])
def test_payload_sizes_exact(name, sizes):
    c = build_compressor(name, chunk=256, topk_ratio=0.05)
    for n, expected in zip(LENGTHS, sizes):
        assert c.payload_bytes(n) == expected, (name, n)
        payload = c.compress(_randn(n))
        assert payload.dtype == torch.uint8 and payload.shape == (expected,)
        assert c.decompress(payload, n).shape == (n,)


def test_payload_sizes_other_chunks():
    assert Int4Compressor(64).payload_bytes(1000) == 4 * 16 + 500
    assert Int4Compressor(3).payload_bytes(7) == 4 * 3 + 4  # ceil(7/2)=4 code bytes
    assert Int8Compressor(1024).payload_bytes(3000) == 4 * 3 + 3000
    assert TopKCompressor(0.07).payload_bytes(100) == 8 * 7  # not 8 from 7.000000000000001
    assert TopKCompressor(1.0).payload_bytes(5) == 40


def test_int4_ratio_exact():
    c = Int4Compressor(256)
    assert c.ratio(256) == 4 * 256 / (128 + 4)
    assert c.ratio(33_554_432) == 4 * 256 / (128 + 4)
    assert round(c.ratio(256), 4) == 7.7576
    assert Int8Compressor(256).ratio(256) == 4 * 256 / (256 + 4)


@pytest.mark.parametrize("cls, level", [(Int4Compressor, 7), (Int8Compressor, 127)])
@pytest.mark.parametrize("n, chunk", [(1, 256), (255, 256), (257, 256), (10_000, 256), (1001, 7)])
def test_quantiser_error_bound(cls, level, n, chunk):
    x = _randn(n, seed=n) * torch.logspace(-3, 2, n)  # chunks of very different magnitudes
    c = cls(chunk)
    y = c.decompress(c.compress(x), n)
    pad = (-n) % chunk
    xc = torch.cat([x, x.new_zeros(pad)]).view(-1, chunk)
    err = torch.cat([(x - y), x.new_zeros(pad)]).view(-1, chunk).abs()
    amax = xc.abs().amax(dim=1, keepdim=True)
    scale = amax / level
    assert bool((err <= scale / 2 + 4 * EPS * amax).all())
    # The bound is reached, not just respected loosely: rounding error is near scale/2 somewhere.
    if n >= 1000:
        assert float((err / scale).max()) > 0.45


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_zeros_exact(name):
    c = build_compressor(name, 256, 0.05)
    for n in LENGTHS:
        y = c.decompress(c.compress(torch.zeros(n)), n)
        assert torch.equal(y, torch.zeros(n))


def test_zero_chunk_scale_zero_and_max_exact():
    c = Int4Compressor(4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, -3.5, 1.0, 0.5, 3.5])
    p = c.compress(x)
    scales = p[:8].clone().view(torch.float32)
    assert scales.tolist() == [0.0, 0.5]
    # codes: chunk 0 all 8 (q=0); chunk 1 q = -7, 2, 1, 7 -> 1, 10, 9, 15; low nibble first.
    assert p[8:12].tolist() == [0x88, 0x88, 10 << 4 | 1, 15 << 4 | 9]
    assert c.decompress(p, 8).tolist() == [0.0, 0.0, 0.0, 0.0, -3.5, 1.0, 0.5, 3.5]


def test_nonfinite_spreads_to_its_chunk_only():
    c = Int4Compressor(4)
    x = torch.tensor([1.0, float("nan"), 2.0, 3.0, 1.0, 2.0, 3.0, 4.0, float("inf"), 0.0, 1.0, 1.0])
    y = c.decompress(c.compress(x), 12)
    assert bool(y[:4].isnan().all()) and not bool(y[8:].isfinite().any())
    assert torch.allclose(y[4:8], x[4:8], atol=4 / 14 + 1e-6)


def test_tiny_chunk_flushed_to_zero():
    c = Int8Compressor(2)
    x = torch.tensor([1e-38, -2e-39, 1.0, -0.5])
    y = c.decompress(c.compress(x), 4)
    assert y[:2].tolist() == [0.0, 0.0] and bool(y.isfinite().all())


def test_topk_keeps_exactly_k_largest():
    n = 10_000
    c = TopKCompressor(0.05)
    x = _randn(n, seed=3)
    k = c.k(n)
    assert k == 500
    y = c.decompress(c.compress(x), n)
    expected = set(torch.argsort(x.abs(), descending=True)[:k].tolist())
    kept = set(torch.nonzero(y).flatten().tolist())
    assert kept == expected
    idx = torch.tensor(sorted(expected))
    assert torch.equal(y[idx], x[idx])
    assert int((y != 0).sum()) == k
    # Indices are stored ascending: the payload's int32 half.
    stored = c.compress(x)[:4 * k].view(torch.int32)
    assert torch.equal(stored.long(), idx)


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_deterministic_bytes(name):
    c = build_compressor(name, 256, 0.05)
    x = _randn(10_000, seed=5)
    x[::37] = x[1]  # ties for top-k
    assert torch.equal(c.compress(x), c.compress(x.clone()))


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_decompress_accumulate_adds(name):
    c = build_compressor(name, 256, 0.05)
    n = 1000
    x, base = _randn(n, seed=6), _randn(n, seed=7)
    p = c.compress(x)
    out = base.clone()
    ret = c.decompress(p, n, out=out, accumulate=True)
    assert ret is out
    assert torch.equal(out, base + c.decompress(p, n))
    out2 = base.clone()
    c.decompress(p, n, out=out2)
    assert torch.equal(out2, c.decompress(p, n))


def test_decompress_reads_misaligned_slice():
    c = Int4Compressor(256)
    x = _randn(300, seed=8)
    p = c.compress(x)
    buf = torch.empty(p.numel() + 1, dtype=torch.uint8)
    buf[1:] = p
    assert torch.equal(c.decompress(buf[1:], 300), c.decompress(p, 300))


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_error_feedback_identity(name):
    c = build_compressor(name, 256, 0.05)
    ef = ErrorFeedback()
    n, shards, steps = 2 * 1000, 2, 50
    sent = torch.zeros(n, dtype=torch.float64)
    true = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        g = _randn(n, seed=100 + t) * (1 + t / 10)
        payloads = ef.compress("b0", g, c, shards)
        assert len(payloads) == shards and all(p.numel() == c.payload_bytes(n // shards) for p in payloads)
        decoded = torch.cat([c.decompress(p, n // shards) for p in payloads])
        sent += decoded.double()
        true += g.double()
    expect = true - ef.residual("b0").double()
    rel = float((sent - expect).norm() / expect.norm())
    assert rel < 1e-5
    # The residual stays bounded (it is not just absorbing everything).
    assert float(ef.residual("b0").norm()) < float(true.norm())


def test_error_feedback_shards_equal_per_shard():
    c = Int4Compressor(256)
    together, apart = ErrorFeedback(), ErrorFeedback()
    n = 2 * 1000  # shard of 1000: partial last chunk, so shard boundaries matter
    for t in range(5):
        g = _randn(n, seed=200 + t)
        both = together.compress(0, g, c, 2)
        first = apart.compress("a", g[:1000].clone(), c, 1)
        second = apart.compress("b", g[1000:].clone(), c, 1)
        assert torch.equal(both[0], first[0]) and torch.equal(both[1], second[0])
    assert torch.equal(together.residual(0), torch.cat([apart.residual("a"), apart.residual("b")]))


def test_error_feedback_bookkeeping():
    c = Int8Compressor(256)
    ef = ErrorFeedback()
    g = _randn(512, seed=9)
    assert ef.residual(1) is None and ef.nbytes() == 0
    ef.compress(1, g, c, 2)
    assert ef.nbytes() == 512 * 4
    assert not torch.equal(ef.residual(1), torch.zeros(512))
    state = ef.state_dict()
    assert state["residuals"][1].device.type == "cpu"
    restored = ErrorFeedback()
    restored.load_state_dict(state)
    assert torch.equal(restored.residual(1), ef.residual(1))
    # Same state, same next step: bit-identical payloads.
    g2 = _randn(512, seed=10)
    assert all(torch.equal(a, b) for a, b in zip(ef.compress(1, g2, c, 2), restored.compress(1, g2, c, 2)))
    ef.reset(1)
    assert torch.equal(ef.residual(1), torch.zeros(512)) and ef.nbytes() == 512 * 4
    ef.drop(1)
    assert ef.residual(1) is None and ef.nbytes() == 0
    assert torch.equal(g, _randn(512, seed=9))  # compress never modifies the gradient itself


def test_errors_name_arguments():
    with pytest.raises(ValueError, match="int4, int8, topk"):
        build_compressor("fp8", 256, 0.05)
    with pytest.raises(ValueError, match="chunk"):
        Int4Compressor(0)
    with pytest.raises(ValueError, match="ratio"):
        TopKCompressor(0.0)
    c = Int4Compressor(256)
    with pytest.raises(ValueError, match="float32"):
        c.compress(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="132 bytes"):
        c.decompress(torch.zeros(131, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="out="):
        c.decompress(c.compress(torch.zeros(4)), 4, accumulate=True)
    ef = ErrorFeedback()
    with pytest.raises(ValueError, match="shards"):
        ef.compress(0, torch.zeros(10), c, 3)
    ef.compress(0, torch.zeros(10), c, 2)
    with pytest.raises(ValueError, match="drop"):
        ef.compress(0, torch.zeros(12), c, 2)
    assert isinstance(c, Compressor) and c.name == "int4" and math.isclose(c.ratio(256), 256 / 33)
