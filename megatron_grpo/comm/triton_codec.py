"""Triton kernels of the int4 / int8 codec (comm/compress.py) for CUDA tensors: one pass each
where the eager codec runs tens of torch ops. comm/fused_codec.py launches them and picks them
or the eager codec; the eager codec is the CPU path and the reference every kernel here must
reproduce byte for byte (payloads, int8 residuals) or bit for bit (decoded sums).

Rules that make the bytes the eager ones (comm/compress.py ``_ChunkQuantizer``):

* scale = max|x| / L and inv = (1 / max|x|) * L, both divisions correctly rounded
  (``tl.math.div_rn``): Triton's ``/`` on fp32 is an approximate division (div.full.f32) on
  NVIDIA, and a 1-ulp scale difference changes the payload. Chunks with max|x| < _MIN_CHUNK_MAX
  get scale 0 and inv 0; a NaN in a chunk gives the canonical NaN scale (0x7fc00000).
* code = trunc(x * inv + (offset + 0.5)), NaN or inf -> offset: a multiply then an add, each
  rounded. Kernels are launched with ``enable_fp_fusion=False`` so that neither this nor the
  decode's product and sum is contracted into an fma (one rounding instead of two).
* max|x| ignores NaN and records it apart: ``tl.max`` is maxnum on the GPU (NaN dropped) but
  NaN-propagating in the interpreter, and the eager rule is "NaN in the chunk -> NaN scale".
* int4 puts element 2j in the low nibble of code byte j and 2j+1 in the high one; a missing
  last element (odd row length) encodes q = 0 (code 8), the pad to 4 bytes is zero.

Python floats given to a kernel would be compiled in as constants; every value that varies at
run time (lengths, row counts, byte widths) is an int argument, and the fixed ones (levels,
chunk, block sizes) are ``tl.constexpr``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from megatron_grpo.comm.compress_base import _MIN_CHUNK_MAX

MIN_CHUNK_MAX = tl.constexpr(_MIN_CHUNK_MAX)  # 2**-120, exact in fp32
SUM_LEVELS = 12
"""Partial sums decode_sum_kernel keeps (s0..s11, one per level of the pairwise tree): it sums
fewer than 2**12 rows; fused_codec.py (its own SUM_LEVELS, equal) sends more to the eager codec."""


# ---- shared pieces of the encoders (reference: _ChunkQuantizer._encode_rows) -------------

@triton.jit
def _canonical_nan():
    # The NaN torch writes for nan_to_num(nan=math.nan): one bit pattern on every device.
    return tl.full([], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _absmax(x):
    """(max |x| over the non-NaN elements, whether any element is NaN) of a 1-D block."""
    bad = x != x
    amax = tl.max(tl.where(bad, 0.0, tl.abs(x)), axis=0)
    return amax, tl.max(bad.to(tl.int32), axis=0) > 0


@triton.jit
def _scale_inv(amax, has_nan, LEVEL: tl.constexpr):
    """The chunk's payload scale and the multiplier its codes use, as the eager codec has them."""
    nan = _canonical_nan()
    amax = tl.where(has_nan, nan, amax)
    small = amax < MIN_CHUNK_MAX  # False for NaN: such a chunk counts as usable
    level = tl.full([], LEVEL, tl.float32)
    one = tl.full([], 1.0, tl.float32)
    scale = tl.where(small, 0.0, tl.math.div_rn(amax, level))
    scale = tl.where(scale != scale, nan, scale)
    # reciprocal then * L (torch's reciprocal is a correctly rounded 1 / x on CPU and CUDA)
    inv = tl.where(small, 0.0, tl.math.div_rn(one, tl.where(small, one, amax)) * level)
    return scale, inv


@triton.jit
def _codes(x, inv, OFFSET: tl.constexpr):
    """Offset-binary codes (int32) of x: round to nearest by truncating x * inv + offset + 0.5."""
    w = x * inv + (OFFSET + 0.5)
    # w - w is 0 for finite w and NaN for NaN or inf: those get the code of q = 0.
    w = tl.where((w - w) != 0.0, OFFSET * 1.0, w)
    return w.to(tl.int32)


@triton.jit
def _encode_chunk(pay_u8, pay_f32, xe, xo, m, length, row, j, n_c, code_bytes, P, P4, write,
                  C: tl.constexpr, BITS: tl.constexpr):
    """Scale and inv of payload chunk j of ``row`` from its even (xe) and odd (xo) elements
    (m: pair index, ``length`` elements in the chunk, missing ones 0); when ``write``, store its
    scale, its code bytes and, for the row's last chunk, the row's zero pad."""
    amax_e, nan_e = _absmax(xe)
    amax_o, nan_o = _absmax(xo)
    scale, inv = _scale_inv(tl.maximum(amax_e, amax_o), nan_e | nan_o, (1 << (BITS - 1)) - 1)
    if write:
        tl.store(pay_f32 + row * P4 + j, scale)
        ce = _codes(xe, inv, 1 << (BITS - 1))
        co = _codes(xo, inv, 1 << (BITS - 1))
        base = pay_u8 + row * P + 4 * n_c
        if BITS == 4:
            # a missing odd element is x = 0: code 8, the eager pad nibble
            packed = (ce & 15) | ((co & 15) << 4)
            tl.store(base + j * (C // 2) + m, packed.to(tl.uint8), mask=2 * m < length)
        else:
            tl.store(base + j * C + 2 * m, ce.to(tl.uint8), mask=2 * m < length)
            tl.store(base + j * C + 2 * m + 1, co.to(tl.uint8), mask=2 * m + 1 < length)
        if j == n_c - 1:
            pad = tl.arange(0, 4)
            tl.store(base + code_bytes + pad, tl.zeros([4], tl.uint8),
                     mask=pad < P - 4 * n_c - code_bytes)
    return scale, inv


@triton.jit
def _decode(row_u8, row_f32, e, mask, n_c, C: tl.constexpr, BITS: tl.constexpr):
    """Decoded values of elements ``e`` of one payload row (reference: _ChunkQuantizer._decode_rows):
    (code - offset) * scale, one fp32 product."""
    if BITS == 4:
        byte = tl.load(row_u8 + 4 * n_c + e // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((e & 1) * 4)) & 15
    else:
        code = tl.load(row_u8 + 4 * n_c + e, mask=mask, other=0).to(tl.int32)
    scale = tl.load(row_f32 + e // C, mask=mask, other=0.0)
    return (code - (1 << (BITS - 1))).to(tl.float32) * scale


# ---- encode (reference: Compressor.compress_rows; with a subtrahend: prepare_param_delta) -

@triton.jit
def encode_rows_kernel(a_ptr, b_ptr, pay_u8, pay_f32, N, n_c, code_bytes, P, P4,
                       C: tl.constexpr, BITS: tl.constexpr, BLOCK_H: tl.constexpr,
                       SUB: tl.constexpr):
    """Payload chunk (program 0) of row (program 1) of x = a (SUB: a - b, both widened to
    fp32 first). a, b: [R, N] contiguous; payload [R, P] as bytes and as fp32 words."""
    j = tl.program_id(0)
    row = tl.program_id(1)
    length = tl.minimum(N - j * C, C)
    m = tl.arange(0, BLOCK_H)
    me = 2 * m < length
    mo = 2 * m + 1 < length
    at = row * N + j * C + 2 * m
    xe = tl.load(a_ptr + at, mask=me, other=0.0).to(tl.float32)
    xo = tl.load(a_ptr + at + 1, mask=mo, other=0.0).to(tl.float32)
    if SUB:
        xe = xe - tl.load(b_ptr + at, mask=me, other=0.0).to(tl.float32)
        xo = xo - tl.load(b_ptr + at + 1, mask=mo, other=0.0).to(tl.float32)
    _encode_chunk(pay_u8, pay_f32, xe, xo, m, length, row, j, n_c, code_bytes, P, P4, True,
                  C, BITS)


# ---- encode with error feedback (reference: ErrorFeedback.owed, compress_rows, stage) -----

@triton.jit
def _owed(g_ptr, old_u8, old_f32, e, mask, RC: tl.constexpr, W: tl.constexpr,
          HAS_RES: tl.constexpr):
    """c = g + r at flat positions e (0 where masked); r decoded from the int8 residual
    (QuantisedResidual: row e // RC is [fp32 scale | RC codes | pad], W bytes)."""
    g = tl.load(g_ptr + e, mask=mask, other=0.0)
    if HAS_RES:
        rrow = e // RC
        code = tl.load(old_u8 + rrow * W + 4 + (e - rrow * RC), mask=mask, other=128)
        scale = tl.load(old_f32 + rrow * (W // 4), mask=mask, other=0.0)
        g = g + (code.to(tl.int32) - 128).to(tl.float32) * scale
    return g


@triton.jit
def encode_feedback_kernel(g_ptr, old_u8, old_f32, pay_u8, pay_f32, new_u8, new_f32, zero_ptr,
                           total, N, n_c, code_bytes, P, P4,
                           C: tl.constexpr, BITS: tl.constexpr, BLOCK_H: tl.constexpr,
                           RC: tl.constexpr, BLOCK_R: tl.constexpr, W: tl.constexpr,
                           HAS_RES: tl.constexpr, HAS_ZERO: tl.constexpr):
    """One bucket's send payload and new int8 residual in one pass; program k owns residual
    chunk k, flat elements [k RC, k RC + RC) of the [dp, N] bucket g.

    The residual's chunks run over the flat bucket while the payload's restart at every row,
    so a residual chunk can overlap several payload chunks and a payload chunk two residual
    chunks. Program k therefore computes the scale of every payload chunk that overlaps its
    elements (reading that whole chunk of g and of the old residual), writes the payload of
    those that start in its range (each chunk is written once), and from the scales codes its
    own elements, decodes them and quantises r' = c - D(q) to its residual chunk. Nothing is
    written that another program reads: g and the old residual are read-only; unlike the eager
    ``owed``, the gradient buffer is not overwritten with c. HAS_ZERO: r' is 0 where bit e % 8
    of byte e // 8 of ``zero_ptr`` is set (elements sent exactly, whose residual stage() zeroes)."""
    k = tl.program_id(0)
    lo = k * RC
    hi = tl.minimum(lo + RC, total)
    t = tl.arange(0, BLOCK_R)
    e = lo + t
    in_range = e < hi
    row_t = e // N
    chunk_t = row_t * n_c + (e - row_t * N) // C  # payload chunk of each element
    scale_t = tl.zeros([BLOCK_R], tl.float32)
    inv_t = tl.zeros([BLOCK_R], tl.float32)
    m = tl.arange(0, BLOCK_H)
    first = (lo // N) * n_c + (lo - (lo // N) * N) // C
    last = ((hi - 1) // N) * n_c + (hi - 1 - ((hi - 1) // N) * N) // C
    for p in range(first, last + 1):
        row = p // n_c
        j = p - row * n_c
        start = row * N + j * C
        length = tl.minimum(N - j * C, C)
        me = 2 * m < length
        mo = 2 * m + 1 < length
        xe = _owed(g_ptr, old_u8, old_f32, start + 2 * m, me, RC, W, HAS_RES)
        xo = _owed(g_ptr, old_u8, old_f32, start + 2 * m + 1, mo, RC, W, HAS_RES)
        scale, inv = _encode_chunk(pay_u8, pay_f32, xe, xo, m, length, row, j, n_c, code_bytes,
                                   P, P4, start >= lo, C, BITS)
        scale_t = tl.where(chunk_t == p, scale, scale_t)
        inv_t = tl.where(chunk_t == p, inv, inv_t)
    # r' = c - D(q), elementwise as ErrorFeedback.stage; zero past the bucket's end (the eager
    # residual zero-pads its short last chunk, and zeros do not change its scale).
    c = _owed(g_ptr, old_u8, old_f32, e, in_range, RC, W, HAS_RES)
    q = _codes(c, inv_t, 1 << (BITS - 1)) - (1 << (BITS - 1))
    r = tl.where(in_range, c - q.to(tl.float32) * scale_t, 0.0)
    if HAS_ZERO:
        bits = tl.load(zero_ptr + e // 8, mask=in_range, other=0).to(tl.int32)
        r = tl.where(((bits >> (e & 7)) & 1) != 0, 0.0, r)
    # The new residual as QuantisedResidual.write quantises it (the int8 codec, one chunk a row).
    amax, has_nan = _absmax(r)
    rscale, rinv = _scale_inv(amax, has_nan, 127)
    tl.store(new_f32 + k * (W // 4), rscale)
    tl.store(new_u8 + k * W + 4 + t, _codes(r, rinv, 128).to(tl.uint8), mask=t < RC)
    pad = tl.arange(0, 4)
    tl.store(new_u8 + k * W + 4 + RC + pad, tl.zeros([4], tl.uint8), mask=pad < W - 4 - RC)


# ---- decode and sum (reference: Compressor.decompress_rows_sum) ---------------------------

@triton.jit
def _push(c, s, i, K: tl.constexpr):
    """Row i's carry c at level K of the binary counter that decompress_rows_sum's tree is:
    with bits 0..K of i all set, level K holds a left subtree and merges (s + c, carried on);
    with bits below K set and bit K clear, c is stored at level K (higher levels then do
    nothing). The tests check that this is the eager pairwise order for every row count."""
    bits = i & ((2 << K) - 1)
    if bits == (2 << K) - 1:
        c = s + c
    if bits == (1 << K) - 1:
        s = c
    return c, s


@triton.jit
def _fold(total, s, R, K: tl.constexpr):
    """After R rows, level K holds a partial sum iff bit K of R is set; they are merged from
    the lowest level up, each as s + (sum of the lower ones), as the eager stack unwinds."""
    if ((R >> K) & 1) != 0:
        if (R & ((1 << K) - 1)) != 0:
            total = s + total
        else:
            total = s
    return total


@triton.jit
def decode_sum_kernel(pay_u8, pay_f32, out_ptr, R, N, n_c, P, P4,
                      C: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[e] = pairwise sum over the R payload rows [R, P] of their decoded element e."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < N
    s0 = tl.zeros([BLOCK], tl.float32)
    s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11 = s0, s0, s0, s0, s0, s0, s0, s0, s0, s0, s0
    for i in range(R):
        c = _decode(pay_u8 + i * P, pay_f32 + i * P4, e, mask, n_c, C, BITS)
        c, s0 = _push(c, s0, i, 0)
        c, s1 = _push(c, s1, i, 1)
        c, s2 = _push(c, s2, i, 2)
        c, s3 = _push(c, s3, i, 3)
        c, s4 = _push(c, s4, i, 4)
        c, s5 = _push(c, s5, i, 5)
        c, s6 = _push(c, s6, i, 6)
        c, s7 = _push(c, s7, i, 7)
        c, s8 = _push(c, s8, i, 8)
        c, s9 = _push(c, s9, i, 9)
        c, s10 = _push(c, s10, i, 10)
        c, s11 = _push(c, s11, i, 11)
    total = tl.zeros([BLOCK], tl.float32)
    total = _fold(total, s0, R, 0)
    total = _fold(total, s1, R, 1)
    total = _fold(total, s2, R, 2)
    total = _fold(total, s3, R, 3)
    total = _fold(total, s4, R, 4)
    total = _fold(total, s5, R, 5)
    total = _fold(total, s6, R, 6)
    total = _fold(total, s7, R, 7)
    total = _fold(total, s8, R, 8)
    total = _fold(total, s9, R, 9)
    total = _fold(total, s10, R, 10)
    total = _fold(total, s11, R, 11)
    tl.store(out_ptr + e, total, mask=mask)


# ---- decode and add (reference: gather_param_delta's rows.add_(D(q).to(rows.dtype))) ------

@triton.jit
def _round_to(x, kind: tl.constexpr):
    """fp32 x in dtype ``kind``, rounded to nearest even. bf16 by its bits, as torch rounds
    (NaN -> 0x7fc0): Triton's interpreter truncates on an fp32 -> bf16 cast, the GPU rounds."""
    if kind == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(x != x, 0x7FC0, b)
        return b.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(kind)


@triton.jit
def decode_add_kernel(pay_u8, pay_f32, dst_ptr, N, n_c, P, P4,
                      C: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """dst[row] += D(payload[row]) (program 1: row), in dst's dtype: D(q) is rounded to it
    first, then added in fp32 and rounded once, as torch adds two bf16 / fp16 tensors."""
    row = tl.program_id(1)
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < N
    v = _decode(pay_u8 + row * P, pay_f32 + row * P4, e, mask, n_c, C, BITS)
    dst = dst_ptr + row * N + e
    old = tl.load(dst, mask=mask)
    kind: tl.constexpr = dst_ptr.dtype.element_ty
    total = old.to(tl.float32) + _round_to(v, kind).to(tl.float32)
    tl.store(dst, _round_to(total, kind), mask=mask)
