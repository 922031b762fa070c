"""Gradient / update compressors of the dynamic tier (error feedback: comm/error_feedback.py).

A dynamic bucket's fp32 gradient is split into dp equal shards and every shard is compressed on
its own into a flat ``torch.uint8`` payload. The payload size is a function of the shard length
only, never of the values, so all ranks can exchange payloads with equal-sized collectives
(``all_to_all_single``, ``all_gather_into_tensor``) without a size handshake.

Formats (N = shard length, C = chunk, n_c = ceil(N / C), round4(b) = b rounded up to a multiple of 4):

=========  ===================================================================  =================
name       payload, in order                                                     bytes
=========  ===================================================================  =================
int4       n_c fp32 scales | ceil(N/2) bytes of two 4-bit codes | zero pad      4 n_c + round4(ceil(N/2))
int8       n_c fp32 scales | N one-byte codes | zero pad                        4 n_c + round4(N)
int2       n_c fp32 scales | ceil(N/4) bytes of four 2-bit codes | zero pad     4 n_c + round4(ceil(N/4))
topk       k int32 indices (ascending) | k fp32 values                          8 k
=========  ===================================================================  =================

int2 (comm/compress_int2.py) scales four non-uniform levels by each chunk's RMS; the others are
here.

Why the pad to 4 bytes: receivers slice a payload out of one big receive buffer at offsets that
are multiples of the payload size; a multiple of 4 keeps every payload's fp32/int32 part aligned
so it can be read in place (``view``) rather than copied.

Decoding of the integer formats is exact arithmetic on the bytes (one fp32 multiply), so every
rank that decodes the same payload gets bit-identical values: the property compressed parameter
updates rely on (``model_copy += D(q)`` on all ranks).

Batched rows: a bucket is dp shards of equal length, i.e. a [dp, N] view, and its payloads are
a [dp, P] view of the send / receive buffer. ``compress_rows`` / ``decompress_rows`` /
``decompress_rows_sum`` handle R rows with a fixed number of tensor ops per block of rows (the
sum adds one op per level of a pairwise tree, ceil(log2 R)). Blocks hold up to 4 Mi elements
(_BLOCK_ELEMS, compress_base.py), so a bucket has about bucket / 2-4 Mi of them whatever dp
is, and one for small buckets: host overhead per bucket no longer grows with dp, where the per-shard Python loop
(~14 ops per shard) cost 3.4 ms per bucket at dp=8 and 260 ms at dp=512. ``compress`` and
``decompress`` are the R = 1 case of the same code, so a row of a batch is byte-identical to
the shard compressed alone (see TopKCompressor for the one CUDA caveat).

Only torch ops on the input's device are used (no Python loop over elements, nor over rows
within a block), so the same code runs on CPU and CUDA tensors.
"""

from __future__ import annotations

import math

import torch

from megatron_grpo.comm.compress_base import (  # noqa: F401 - Compressor and chunk_view re-exported
    _MIN_CHUNK_MAX, Compressor, _bytes_as, _round4, chunk_view)
from megatron_grpo.comm.compress_int2 import Int2Compressor

COMPRESSOR_NAMES = ("int4", "int8", "int2", "topk")

class _ChunkQuantizer(Compressor):
    """Symmetric per-chunk quantisation to ``bits``-bit offset-binary codes, fp32 scale per chunk.

    scale = max|x| / L with L = 2**(bits-1) - 1; q = round(x / scale) in [-L, L];
    code = q + 2**(bits-1) (so code 0 is never used); decode (code - 2**(bits-1)) * scale.
    Rounding is to nearest, halves away from -inf (deterministic; no stochastic rounding), so
    |x - D(C(x))| <= scale / 2 per element, up to fp32 rounding. A chunk holding a NaN or
    +-inf decodes to all NaN (its scale is non-finite; its codes are those of q = 0).

    Chunks restart at every row (shard), so rows are processed as a chunk-major [R, n_c, C]
    view; with N % C != 0 the rows are zero-padded to n_c * C first (one copy), unless N < C:
    then the one chunk is a [R, 1, N] view (small shards at large dp would otherwise do up to
    C / N times the work, e.g. 3.2x for 40,000 elements at dp = 512).
    """

    bits = 8

    def __init__(self, chunk: int = 256):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"{self.name}: chunk must be a positive int, got {chunk!r}")
        self.chunk = chunk
        self.level = 2 ** (self.bits - 1) - 1
        self.offset = 2 ** (self.bits - 1)

    def _code_bytes(self, numel: int) -> int:
        return numel * self.bits // 8 if self.bits == 8 else (numel + 1) // 2

    def payload_bytes(self, numel: int) -> int:
        if not isinstance(numel, int) or numel < 1:
            raise ValueError(f"payload_bytes: numel must be a positive int, got {numel!r}")
        n_chunks = -(-numel // self.chunk)
        return 4 * n_chunks + _round4(self._code_bytes(numel))

    def _encode_rows(self, x2d: torch.Tensor, payload2d: torch.Tensor) -> None:
        rows, numel = x2d.shape
        chunk = self.chunk
        xc, n_chunks, padded = chunk_view(x2d, chunk)  # zero padding doesn't change amax
        start, n_code_bytes = 4 * n_chunks, self._code_bytes(numel)
        lo, hi = torch.aminmax(xc, dim=2)  # no |x| temporary of the full size
        amax = torch.maximum(hi, lo.neg())
        small = amax < _MIN_CHUNK_MAX  # False for a NaN max: such a chunk counts as usable
        # The NaN that aminmax returns has a kernel-path dependent bit pattern (seen: 0x7fc00000
        # and 0xffffffff); writing one canonical NaN keeps batched and single payloads equal.
        # A tensor divisor: torch divides a CUDA tensor by a Python number as a multiply by the
        # number's rounded reciprocal, 1 ulp off the true quotient for some amax (seen on an
        # H200: 2,176 of 540,680 bytes of an int4 payload differed from the CPU's); tensor by
        # tensor is a true division on both devices, so CPU and GPU payloads are the same bytes.
        level = amax.new_full((1,), float(self.level))
        scale = torch.div(amax, level).masked_fill_(small, 0.0).nan_to_num_(
            nan=math.nan, posinf=math.inf, neginf=-math.inf)
        # reciprocal * level is how torch evaluates level / t: payloads stay as they were.
        inv = amax.masked_fill(small, 1.0).reciprocal_().mul_(self.level).masked_fill_(small, 0.0)
        _bytes_as(payload2d[:, :start], torch.float32).copy_(scale)
        # |x * inv| <= L (+ a few ulp), so x * inv + offset + 0.5 lies in [1.5, 2 * offset - 0.5]
        # and the float->uint8 cast (truncation) is round-to-nearest with no clamp needed.
        # Multiply and add stay two ops (not addcmul): a fused multiply-add could round
        # differently on another kernel path. NaN in w only comes from a chunk with a NaN or
        # inf (inv NaN, or inf * 0); its code is set to q = 0 because the float->uint8 cast of
        # NaN is undefined behaviour (free to differ between kernel paths and devices), and
        # batched rows must match single shards byte for byte. The chunk's scale is NaN or inf,
        # so the whole chunk decodes to NaN and megatron's NaN check after the reduce still
        # fires. (One in-place pass over w: ~4 ms of ~90 ms for 128 MiB on 2 CPU threads.)
        w = torch.mul(xc, inv.unsqueeze(2)).add_(self.offset + 0.5)
        off = float(self.offset)
        w = w.nan_to_num_(nan=off, posinf=off, neginf=off).view(rows, padded)
        if payload2d.shape[1] > start + n_code_bytes:
            payload2d[:, start + n_code_bytes:].zero_()
        dst = payload2d[:, start:start + n_code_bytes]
        if self.bits == 8:
            dst.copy_(w[:, :numel])  # the cast writes the codes straight into the payload
            return
        n_codes = 2 * n_code_bytes  # numel rounded up to even; codes past numel encode 0
        codes = torch.empty((rows, max(n_codes, padded)), dtype=torch.uint8, device=x2d.device)
        codes[:, :padded].copy_(w)
        if n_codes > padded:  # odd numel that is a multiple of an odd chunk, or < chunk
            codes[:, padded:].fill_(self.offset)
        pairs = codes[:, :n_codes].view(rows, n_code_bytes, 2)
        # Element 2j in the low nibble, 2j+1 in the high one (codes are in [1, 15]; the and
        # is the copy into the strided payload rows, and a guard against nibble spill).
        torch.bitwise_and(pairs[:, :, 0], 15, out=dst)
        dst.bitwise_or_(pairs[:, :, 1] << 4)

    def _decode_rows(self, payload2d: torch.Tensor, numel: int,
                     out2d: torch.Tensor) -> torch.Tensor:
        rows, chunk = payload2d.shape[0], self.chunk
        n_chunks = -(-numel // chunk)
        start, n_code_bytes = 4 * n_chunks, self._code_bytes(numel)
        scale = _bytes_as(payload2d[:, :start], torch.float32)
        raw = payload2d[:, start:start + n_code_bytes]
        # Subtracting the offset in uint8 wraps to the two's-complement bytes of q, so the signed
        # view converts straight to fp32 (cheaper than subtracting in fp32).
        if self.bits == 8:
            q = torch.sub(raw, self.offset)
        else:
            codes = torch.empty((rows, n_code_bytes, 2), dtype=torch.uint8, device=payload2d.device)
            torch.bitwise_and(raw, 15, out=codes[:, :, 0])
            torch.bitwise_right_shift(raw, 4, out=codes[:, :, 1])
            q = codes.sub_(self.offset).view(rows, 2 * n_code_bytes)[:, :numel]
        values = out2d
        values.copy_(q.view(torch.int8))
        # Whole chunks as a [R, full, C] view, the short last chunk (if any) on its own: no
        # padded buffer and a contiguous result. Each value is one exact fp32 product.
        full = numel // chunk
        if full == n_chunks:  # whole chunks only (the usual shard): no slicing
            values.view(rows, full, chunk).mul_(scale.unsqueeze(2))
            return values
        if full:
            values[:, :full * chunk].view(rows, full, chunk).mul_(scale[:, :full].unsqueeze(2))
        values[:, full * chunk:].mul_(scale[:, full:])
        return values


class Int4Compressor(_ChunkQuantizer):
    """4-bit symmetric quantisation, q in [-7, 7], fp32 scale per ``chunk`` elements (7.76:1 at 256)."""

    name = "int4"
    bits = 4


class Int8Compressor(_ChunkQuantizer):
    """8-bit symmetric quantisation, q in [-127, 127], fp32 scale per ``chunk`` elements (3.94:1 at 256)."""

    name = "int8"
    bits = 8


class TopKCompressor(Compressor):
    """Keeps the k = max(1, ceil(ratio * numel)) elements of largest |x|; the rest decode to 0.

    Ties in |x| are broken by ``torch.topk``: deterministic for a given device and torch build,
    but which of equal-magnitude elements wins is not specified (CPU and CUDA may differ). Only
    the sender runs it, and receivers decode the bytes they get, so ranks never disagree. Kept
    indices are sorted ascending so the payload depends only on the chosen set.

    Rows: ``torch.topk(dim=1)`` per row. On CPU each row runs the same selection as a 1-D call,
    so rows are byte-identical to ``compress`` even with ties. On CUDA the selection kernel
    depends on the batch shape, so with a tie at the k-th largest |x| a batched row may keep a
    different (equally valid) element than ``compress`` of that row; without such ties the
    kept set is unique and the bytes are identical.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.05):
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"topk: ratio must be in (0, 1], got {ratio!r}")
        self.ratio_kept = float(ratio)

    def k(self, numel: int) -> int:
        """Elements kept out of ``numel``."""
        # Rounded to 1e-6 first so float noise (0.07 * 100 = 7.000000000000001) adds no element.
        return min(numel, max(1, math.ceil(round(self.ratio_kept * numel, 6))))

    def payload_bytes(self, numel: int) -> int:
        if not isinstance(numel, int) or numel < 1:
            raise ValueError(f"payload_bytes: numel must be a positive int, got {numel!r}")
        if numel >= 2 ** 31:
            raise ValueError(f"topk: numel must be < 2**31 (indices are int32), got {numel}")
        return 8 * self.k(numel)

    def _encode_rows(self, x2d: torch.Tensor, payload2d: torch.Tensor) -> None:
        k = self.k(x2d.shape[1])
        if x2d.shape[0] == 1:
            # One row (compress, or a row longer than a block) in 1-D ops: the same selection
            # and values, but torch sorts a 1-D tensor with all threads and each row of a 2-D
            # one on one thread (128 MiB, 2 CPU threads: 128 vs 240 ms), and fewer views keep
            # a small shard's call at ~21 us instead of ~29 us.
            x, payload = x2d.view(-1), payload2d.view(-1)
            idx = torch.sort(torch.topk(x.abs(), k, sorted=False)[1])[0]
            _bytes_as(payload[:4 * k], torch.int32).copy_(idx)
            torch.index_select(x, 0, idx, out=_bytes_as(payload[4 * k:], torch.float32))
            return
        # Indices are unique, so any sort gives the same order.
        idx = torch.sort(torch.topk(x2d.abs(), k, dim=1, sorted=False)[1], dim=1)[0]
        _bytes_as(payload2d[:, :4 * k], torch.int32).copy_(idx)
        _bytes_as(payload2d[:, 4 * k:], torch.float32).copy_(torch.gather(x2d, 1, idx))

    def _decode_rows(self, payload2d: torch.Tensor, numel: int,
                     out2d: torch.Tensor) -> torch.Tensor:
        k = self.k(numel)
        # scatter_ bounds-checks the indices itself (an error on CPU, a device assert on CUDA).
        idx = _bytes_as(payload2d[:, :4 * k], torch.int32).long()
        out2d.zero_()
        return out2d.scatter_(1, idx, _bytes_as(payload2d[:, 4 * k:], torch.float32))


def build_compressor(name: str, chunk: int = 256, topk_ratio: float = 0.05) -> Compressor:
    """The compressor called ``name`` (GRPOConfig.compressor), with its settings."""
    if name == "int4":
        return Int4Compressor(chunk)
    if name == "int8":
        return Int8Compressor(chunk)
    if name == "int2":
        return Int2Compressor(chunk)
    if name == "topk":
        return TopKCompressor(topk_ratio)
    raise ValueError(f"compressor must be one of {', '.join(COMPRESSOR_NAMES)}, got {name!r}")
