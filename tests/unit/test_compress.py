"""Dynamic-tier compressors and error feedback: exact payload sizes, error bounds, EF invariant."""

import math

import pytest
import torch

from megatron_grpo.comm import compress_base
from megatron_grpo.comm.compress_int2 import Int2Compressor
from megatron_grpo.comm.compress import (
    COMPRESSOR_NAMES,
    Compressor,
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
# int4 4*ceil(N/256) + round4(ceil(N/2)); int8 4*ceil(N/256) + round4(N);
# int2 4*ceil(N/256) + round4(ceil(N/4)); topk 8*ceil(0.05 N).
@pytest.mark.parametrize("name, sizes", [
    ("int4", (8, 132, 132, 140, 5160)),
    ("int8", (8, 260, 260, 268, 10160)),
    ("int2", (8, 68, 68, 76, 2660)),
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
    assert Int2Compressor(256).ratio(256) == 4 * 256 / (64 + 4)


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


def test_int2_codes_by_hand():
    # chunk 0 all zero: scale 0, codes 0, decodes to zeros. chunk 1 = [-4, 1, 2, 1]: RMS
    # sqrt(22 / 4) = 2.345, threshold 0.9816 * 2.345 = 2.302 -> codes 1 (-, outer), 2 (+, inner),
    # 2, 2. The last chunk is one element (3.0): its RMS is 3 (the padding is not counted), code 3.
    c = Int2Compressor(4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, -4.0, 1.0, 2.0, 1.0, 3.0])
    p = c.compress(x)
    assert p.numel() == 3 * 4 + 4  # three scales, ceil(9/4) = 3 code bytes padded to 4
    s = torch.tensor([0.0, 5.5, 9.0]).sqrt()
    assert torch.equal(p[:12].clone().view(torch.float32), s)
    assert p[12:16].tolist() == [0, 2 << 6 | 2 << 4 | 2 << 2 | 1, 3, 0]
    levels = torch.tensor([0.4528, -1.5104, 0.4528, 0.4528, 0.4528, 1.5104])
    want = torch.cat([torch.zeros(4), levels[1:5] * s[1], levels[5:] * s[2]])
    y = c.decompress(p, 9)
    assert torch.equal(y, want) and torch.equal(y[:4].abs(), torch.zeros(4))


def test_int2_error_is_that_of_the_gaussian_quantiser():
    # Lloyd-Max at 4 levels: mean squared error 0.1175 of the variance for Gaussian values, so
    # a relative error of ~0.343; the ternary max-scaled alternative would read ~0.75.
    x = _randn(1 << 16, seed=11) * 3.0
    y = Int2Compressor(256).decompress(Int2Compressor(256).compress(x), x.numel())
    rel = float((x - y).norm() / x.norm())
    assert 0.33 < rel < 0.36
    assert float((y * x).sum() / (y.norm() * x.norm())) > 0.93


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





def test_errors_name_arguments():
    with pytest.raises(ValueError, match="int4, int8, int2, topk"):
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
    assert isinstance(c, Compressor) and c.name == "int4" and math.isclose(c.ratio(256), 256 / 33)


# ---- batched rows: compress_rows / decompress_rows / decompress_rows_sum ----------------------

# (name, chunk, topk ratio): odd chunks exercise the int4 pair padding past a whole last chunk.
ROW_SETTINGS = [("int4", 256, 0.05), ("int4", 7, 0.05), ("int4", 3, 0.05), ("int8", 256, 0.05),
                ("int8", 7, 0.05), ("topk", 256, 0.05), ("topk", 256, 0.3), ("topk", 256, 1.0)]
# (R, N): N = 1, N < chunk, N % chunk != 0, whole chunks; R = 1 and R = 64.
ROW_SHAPES = [(1, 1), (64, 1), (1, 257), (64, 79), (64, 256), (3, 1000), (5, 9), (2, 13)]


def _random_shapes(count=6, seed=11):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 65, (count,), generator=g).tolist()
    cols = torch.randint(1, 700, (count,), generator=g).tolist()
    return list(zip(rows, cols))


def _rows(r, n, seed):
    # Rows of very different magnitudes, so chunk scales and top-k picks differ per row.
    return _randn(r * n, seed=seed).view(r, n) * torch.logspace(-2, 2, r).unsqueeze(1)


def _bits(t):
    return t.view(torch.int32)  # compare fp32 bit patterns (NaN payloads, -0.0)


def _sequential_sum(c, payload2d, n):
    out = torch.zeros(n)
    for r in range(payload2d.shape[0]):
        c.decompress(payload2d[r], n, out=out, accumulate=True)
    return out


@pytest.mark.parametrize("name, chunk, ratio", ROW_SETTINGS)
@pytest.mark.parametrize("shape", ROW_SHAPES + _random_shapes())
def test_rows_match_single_rows(name, chunk, ratio, shape):
    r, n = shape
    c = build_compressor(name, chunk, ratio)
    x = _rows(r, n, seed=r * 1000 + n)
    p = c.compress_rows(x)
    assert p.dtype == torch.uint8 and p.shape == (r, c.payload_bytes(n)) and p.is_contiguous()
    for i in range(r):
        assert torch.equal(p[i], c.compress(x[i])), i
    d = c.decompress_rows(p, n)
    assert d.dtype == torch.float32 and d.shape == (r, n) and d.is_contiguous()
    for i in range(r):
        assert torch.equal(_bits(d[i]), _bits(c.decompress(p[i], n))), i
    # The flat buffer of R payloads (what all_to_all sends) decodes the same as a [R, P] view.
    flat = torch.cat([c.compress(x[i]) for i in range(r)])
    assert torch.equal(flat, p.view(-1))


@pytest.mark.parametrize("name, chunk, ratio", ROW_SETTINGS)
@pytest.mark.parametrize("shape", ROW_SHAPES + _random_shapes())
def test_rows_sum_close_to_sequential_and_deterministic(name, chunk, ratio, shape):
    r, n = shape
    c = build_compressor(name, chunk, ratio)
    p = c.compress_rows(_randn(r * n, seed=7 * r + n).view(r, n))
    s = c.decompress_rows_sum(p, n)
    assert s.dtype == torch.float32 and s.shape == (n,)
    seq = _sequential_sum(c, p, n)
    decoded = c.decompress_rows(p, n).double()
    exact = decoded.sum(dim=0)
    assert float((s.double() - seq.double()).norm()) <= 1e-6 * float(seq.double().norm()) + 1e-30
    # Element-wise: both fp32 sums are within a few ulp of sum |v| of the float64 sum.
    bound = 1e-6 * decoded.abs().sum(dim=0)
    assert bool(((s.double() - exact).abs() <= bound).all())
    assert torch.equal(_bits(s), _bits(c.decompress_rows_sum(p, n)))  # run to run
    out = torch.full((n,), 123.0)
    assert c.decompress_rows_sum(p, n, out=out) is out  # overwritten, not added to
    assert torch.equal(_bits(out), _bits(s))
    if r == 1:
        assert torch.equal(_bits(s), _bits(c.decompress(p[0], n)))


def test_rows_sum_documented_order():
    c = Int8Compressor(256)
    n = 500
    scales = torch.tensor([1e3, 1.0, -1e-3, 7.0, 1e-5]).unsqueeze(1)
    p = c.compress_rows(_randn(5 * n, seed=12).view(5, n) * scales)
    v = [c.decompress(p[i], n) for i in range(5)]
    # Pairwise in row order: adjacent rows added, an odd last row carried up a level.
    expected = ((v[0] + v[1]) + (v[2] + v[3])) + v[4]
    assert torch.equal(_bits(c.decompress_rows_sum(p, n)), _bits(expected))
    assert torch.equal(_bits(c.decompress_rows_sum(p[:4], n)), _bits((v[0] + v[1]) + (v[2] + v[3])))
    assert torch.equal(_bits(c.decompress_rows_sum(p[:3], n)), _bits((v[0] + v[1]) + v[2]))
    assert torch.equal(_bits(c.decompress_rows_sum(p[:2], n)), _bits(v[0] + v[1]))
    # And not the sequential order (these magnitudes round differently), so the test has teeth.
    assert not torch.equal(c.decompress_rows_sum(p, n), (((v[0] + v[1]) + v[2]) + v[3]) + v[4])


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
@pytest.mark.parametrize("rows, n", [(37, 10), (5, 40), (64, 3), (9, 16)])
def test_rows_blocking_changes_nothing(monkeypatch, name, rows, n):
    # Big buckets are processed in blocks of 2**k rows; with blocks forced small (16 elements:
    # 1, 2, 4 or 16 rows per block here), every result stays bit-identical to one block.
    c = build_compressor(name, 7, 0.2)
    x = _rows(rows, n, seed=rows + n)
    p = c.compress_rows(x)
    d, s = c.decompress_rows(p, n), c.decompress_rows_sum(p, n)
    monkeypatch.setattr(compress_base, "_BLOCK_ELEMS", 16)
    assert len(compress_base._row_blocks(rows, n)) > 1
    assert torch.equal(c.compress_rows(x), p)
    assert torch.equal(_bits(c.decompress_rows(p, n)), _bits(d))
    assert torch.equal(_bits(c.decompress_rows_sum(p, n)), _bits(s))
    out = torch.empty(rows, n)
    assert c.decompress_rows(p, n, out=out) is out and torch.equal(_bits(out), _bits(d))


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_rows_nonfinite_and_ties_match_single_rows(name):
    c = build_compressor(name, 16, 0.1)
    r, n = 6, 100
    x = _randn(r * n, seed=13).view(r, n)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 99] = -float("inf")
    x[3, ::3] = 2.5  # ties in |x| for top-k
    x[4, 10:20] = -2.5
    x[5] = 0.0
    p = c.compress_rows(x)
    d = c.decompress_rows(p, n)
    for i in range(r):
        assert torch.equal(p[i], c.compress(x[i])), i
        assert torch.equal(_bits(d[i]), _bits(c.decompress(p[i], n))), i
    if name != "topk":  # a chunk holding NaN or inf decodes to all NaN; other chunks finite
        assert bool(d[0, :16].isnan().all()) and bool(d[1, 32:48].isnan().all())
        assert bool(d[2, 96:].isnan().all()) and bool(d[0, 16:].isfinite().all())
    assert torch.equal(d[5], torch.zeros(n))


def test_rows_accept_noncontiguous_and_misaligned():
    c = Int4Compressor(256)
    x = _randn(300 * 4, seed=14).view(300, 4).t()  # [4, 300], not contiguous
    p = c.compress_rows(x)
    assert torch.equal(p, c.compress_rows(x.contiguous()))
    buf = torch.empty(p.numel() + 1, dtype=torch.uint8)
    buf[1:] = p.view(-1)
    shifted = buf[1:].view(4, -1)  # scales no longer 4-byte aligned: read through a copy
    assert torch.equal(c.decompress_rows(shifted, 300), c.decompress_rows(p, 300))
    assert torch.equal(c.decompress_rows_sum(shifted, 300), c.decompress_rows_sum(p, 300))


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_rows_replace_per_shard_residual_loop_exactly(name):
    # The batched residual update c -= D(C(c)) on the [dp, N] view gives what the per-shard
    # loop of error feedback gives, byte for byte and bit for bit, step after step.
    c = build_compressor(name, 256, 0.05)
    dp, n = 8, 8 * 300
    batched, looped = torch.zeros(n), torch.zeros(n)
    for t in range(3):
        g = _randn(n, seed=300 + t)
        looped.add_(g)
        loop = []
        for i in range(dp):
            part = looped[i * 300:(i + 1) * 300]
            loop.append(c.compress(part))
            part.sub_(c.decompress(loop[-1], 300))
        batched.add_(g)
        view = batched.view(dp, -1)
        rows = c.compress_rows(view)
        view.sub_(c.decompress_rows(rows, 300))
        assert all(torch.equal(rows[i], loop[i]) for i in range(dp))
        assert torch.equal(_bits(batched), _bits(looped))


def _aten_ops(fn):
    from torch.profiler import profile
    with profile() as prof:
        fn()
    return sorted((e.key, e.count) for e in prof.key_averages() if e.key.startswith("aten::"))


@pytest.mark.parametrize("name", COMPRESSOR_NAMES)
def test_rows_op_count_independent_of_rows(name):
    c = build_compressor(name, 256, 0.05)
    n = 79
    small, big = _randn(2 * n, seed=15).view(2, n), _randn(64 * n, seed=16).view(64, n)
    ps, pb = c.compress_rows(small), c.compress_rows(big)
    assert _aten_ops(lambda: c.compress_rows(small)) == _aten_ops(lambda: c.compress_rows(big))
    assert _aten_ops(lambda: c.decompress_rows(ps, n)) == \
        _aten_ops(lambda: c.decompress_rows(pb, n))
    # The sum adds one add per level of its pairwise tree: log2 64 = 6, against 1 for R = 2.
    adds = lambda ops: dict(ops).get("aten::add_", 0)  # noqa: E731
    assert adds(_aten_ops(lambda: c.decompress_rows_sum(pb, n))) == 6
    assert adds(_aten_ops(lambda: c.decompress_rows_sum(ps, n))) == 1


def test_rows_errors_name_arguments():
    c = Int4Compressor(256)
    with pytest.raises(ValueError, match=r"compress_rows: x2d must be a 2-D torch.float32"):
        c.compress_rows(torch.zeros(8))
    with pytest.raises(ValueError, match=r"x2d must be a 2-D torch.float32 .*float16"):
        c.compress_rows(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"x2d must be a 2-D"):
        c.compress_rows([[1.0]])
    for shape in ((0, 8), (3, 0)):
        with pytest.raises(ValueError, match=r"at least 1 row and 1 column, got shape"):
            c.compress_rows(torch.zeros(shape))
    p = c.compress_rows(torch.ones(3, 256))
    with pytest.raises(ValueError, match=r"decompress_rows: payload2d must be a 2-D torch.uint8 "
                                         r"tensor \[R >= 1, 132\]"):
        c.decompress_rows(p[:, :131], 256)
    with pytest.raises(ValueError, match=r"payload2d must be a 2-D .* got torch.uint8 with "
                                         r"shape \(396,\)"):
        c.decompress_rows(p.view(-1), 256)
    with pytest.raises(ValueError, match=r"payload2d .* got torch.int8"):
        c.decompress_rows(p.view(torch.int8), 256)
    with pytest.raises(ValueError, match=r"payload2d .*\(0, 132\)"):
        c.decompress_rows(p[:0], 256)
    with pytest.raises(ValueError, match=r"decompress_rows: numel must be a positive int"):
        c.decompress_rows(p, 0)
    with pytest.raises(ValueError, match=r"decompress_rows_sum: payload2d .*132"):
        c.decompress_rows_sum(p[:, :8], 256)
    with pytest.raises(ValueError, match=r"decompress_rows_sum: out must be a 1-D "
                                         r"torch.float32 tensor of 256"):
        c.decompress_rows_sum(p, 256, out=torch.zeros(255))
    with pytest.raises(ValueError, match=r"out must be .* got torch.float64"):
        c.decompress_rows_sum(p, 256, out=torch.zeros(256, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"decompress_rows: out must be a contiguous torch.float32 "
                                         r"tensor of shape \(3, 256\)"):
        c.decompress_rows(p, 256, out=torch.zeros(3, 255))
    with pytest.raises(ValueError, match=r"decompress_rows: out must be a contiguous"):
        c.decompress_rows(p, 256, out=torch.zeros(256, 3).t())
    with pytest.raises(ValueError, match=r"topk: numel must be < 2\*\*31"):
        TopKCompressor(0.05).decompress_rows(torch.zeros(1, 8, dtype=torch.uint8), 2 ** 31)


class _CudaScalarDivision(torch.overrides.TorchFunctionMode):
    """Test double of CUDA's division by a Python number: torch's CUDA kernel computes
    ``t / s`` as ``t * (1 / s)`` with the reciprocal rounded to fp32, 1 ulp off the true
    quotient for some values (seen on an H200 in the GPU check: ``a / 7 != a / tensor(7)``).
    The CPU kernel divides exactly. Tensor by tensor is an exact division on both."""

    _DIVS = {torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.div_,
             torch.Tensor.__truediv__, torch.Tensor.__itruediv__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._DIVS and len(args) == 2 and isinstance(args[1], (int, float)) \
                and not kwargs.get("rounding_mode"):
            inv = float(torch.tensor(1.0 / args[1], dtype=torch.float32))
            if func in (torch.Tensor.div_, torch.Tensor.__itruediv__):
                return args[0].mul_(inv)
            return torch.mul(args[0], inv)
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_scales_are_true_quotients_under_cuda_division(name):
    """Each chunk's fp32 scale is amax / L correctly rounded, also where dividing by a Python
    number is a multiply by its reciprocal (CUDA). Before the fix, ~13 % of int4 scales were 1
    ulp off on the GPU, so GPU payloads differed from the CPU's (first GPU check, phase b)."""
    c = build_compressor(name, 256)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 256 * 64, generator=g) * torch.logspace(-4, 3, 8).view(8, 1)
    exact = c.compress_rows(x)
    with _CudaScalarDivision():
        payload = c.compress_rows(x)
    n_chunks = x.shape[1] // 256
    scale = payload[:, :4 * n_chunks].contiguous().view(torch.float32)
    amax = x.view(8, n_chunks, 256).abs().amax(dim=2).double()
    want = (amax / c.level).float()
    assert torch.equal(scale, want), f"{int((scale != want).sum())} of {scale.numel()} scales off"
    assert torch.equal(payload, exact)
    # The double does bite: the same quotient through a Python number comes out different.
    with _CudaScalarDivision():
        assert not torch.equal((amax.float() / c.level), want)
