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
(_BLOCK_ELEMS), so a bucket has about bucket / 2-4 Mi of them whatever dp is, and one for small
buckets: host overhead per bucket no longer grows with dp, where the per-shard Python loop
(~14 ops per shard) cost 3.4 ms per bucket at dp=8 and 260 ms at dp=512. ``compress`` and
``decompress`` are the R = 1 case of the same code, so a row of a batch is byte-identical to
the shard compressed alone (see TopKCompressor for the one CUDA caveat).

Only torch ops on the input's device are used (no Python loop over elements, nor over rows
within a block), so the same code runs on CPU and CUDA tensors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import List, Optional

import torch

COMPRESSOR_NAMES = ("int4", "int8", "int2", "topk")

# A chunk whose max |x| is below this is sent as zeros: 7 / max|x| would overflow fp32 (and the
# scale would be subnormal). Such values are ~1e-36; error feedback keeps them in the residual.
_MIN_CHUNK_MAX = 2.0 ** -120


def _round4(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


def chunk_view(x2d: torch.Tensor, chunk: int):
    """Rows [R, N] as a chunk-major [R, n_c, C] view, zero-padded to n_c * C (one copy) when C
    does not divide N; N < C is one chunk of N, no copy. Returns (view, n_c, padded length)."""
    rows, numel = x2d.shape
    n_chunks = -(-numel // chunk)
    padded = n_chunks * chunk if numel > chunk else numel
    if padded == numel:
        return x2d.view(rows, n_chunks, padded // n_chunks), n_chunks, padded
    xp = x2d.new_zeros((rows, padded))
    xp[:, :numel].copy_(x2d)
    return xp.view(rows, n_chunks, chunk), n_chunks, padded


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret payload bytes (last dim) as ``dtype``; copies only when misaligned."""
    try:
        return raw.view(dtype)
    except RuntimeError:  # storage offset or a row stride not a multiple of the element size
        return raw.clone().view(dtype)


def _describe(t) -> str:
    return f"{getattr(t, 'dtype', type(t).__name__)} with shape {tuple(getattr(t, 'shape', ()))}"


# Rows are processed in blocks of at most this many elements (but at least one row, and a power
# of 2 rows). A bucket-sized fp32 temporary on the CPU is a fresh mmap from glibc on every call
# (it is above the 32 MiB ceiling of malloc's adaptive mmap threshold), and its page faults cost
# more than the per-shard loop saved (128 MiB int4 at dp=8, unblocked: 42,600 page faults per
# compress_rows, error-feedback step 145 ms against 83 ms for the shard loop). At 16 MiB the
# temporaries are reused heap. A block holds 2 to 4 Mi elements (or one longer row, or all rows
# of a smaller input), so a bucket takes bucket / 2-4 Mi blocks whatever dp is, and per-block op
# overhead (~0.1 ms) stays small against the work; a 40,000-element bucket is one block.
_BLOCK_ELEMS = 1 << 22


def _row_blocks(rows: int, numel: int) -> List[slice]:
    """Consecutive row slices of 2**k rows each (the last may be shorter), 2**k * numel
    <= _BLOCK_ELEMS or k = 0. Power-of-2 blocks start at multiples of their size, so they are
    whole subtrees of the pairwise sum (see decompress_rows_sum)."""
    step = 1 << max(0, (_BLOCK_ELEMS // numel).bit_length() - 1)
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def _pairwise_rows_(values: torch.Tensor) -> torch.Tensor:
    """Pairwise sum of the rows of ``values`` [R, N] in row order, in place: adjacent rows
    added, an odd last row carried, until one row is left; returns the view of row 0. One add
    per level: even rows += odd rows, then the even rows (an odd last row is one of them) are
    the next level, as a strided view, so nothing is allocated or copied."""
    while values.shape[0] > 1:
        pairs = values.shape[0] // 2
        values[0:2 * pairs:2].add_(values[1:2 * pairs:2])
        values = values[0::2]
    return values[0]


class Compressor(ABC):
    """Turns a 1-D fp32 tensor into a uint8 payload whose size depends only on its length;
    the ``*_rows`` methods do the same for every row of a 2-D tensor at once."""

    name: str = ""

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Exact size in bytes of the payload for ``numel`` elements."""

    @abstractmethod
    def _encode_rows(self, x2d: torch.Tensor, payload2d: torch.Tensor) -> None:
        """Fill ``payload2d`` [R, payload_bytes(N)] (fresh, contiguous) from the validated,
        contiguous ``x2d`` [R, N], each row on its own."""

    @abstractmethod
    def _decode_rows(self, payload2d: torch.Tensor, numel: int,
                     out2d: torch.Tensor) -> torch.Tensor:
        """Write the rows' decoded values into ``out2d`` (contiguous fp32 [R, numel]); return it."""

    # -- validation (shared by the 1-D and the batched entry points) --------------------------

    def _check_payload(self, fn: str, payload: torch.Tensor, numel: int, dims: int) -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"{fn}: numel must be a positive int, got {numel!r}")
        expected = self.payload_bytes(numel)
        shape_ok = (isinstance(payload, torch.Tensor) and payload.dim() == dims
                    and payload.shape[-1] == expected and (dims == 1 or payload.shape[0] >= 1))
        if not shape_ok or payload.dtype != torch.uint8:
            want = f"1-D torch.uint8 tensor of {expected} bytes" if dims == 1 else \
                f"2-D torch.uint8 tensor [R >= 1, {expected}] ({expected} bytes per row)"
            raise ValueError(f"{fn}: payload{'2d' if dims == 2 else ''} must be a {want} for "
                             f"{self.name} with numel={numel}, got {_describe(payload)}")

    @staticmethod
    def _check_out(fn: str, out: Optional[torch.Tensor], numel: int, device: torch.device,
                   rows: Optional[int] = None) -> None:
        if out is None:
            return
        shape = (numel,) if rows is None else (rows, numel)
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.float32
                or tuple(out.shape) != shape or out.device != device
                or (rows is not None and not out.is_contiguous())):
            want = f"1-D torch.float32 tensor of {numel} elements" if rows is None else \
                f"contiguous torch.float32 tensor of shape {shape}"
            raise ValueError(f"{fn}: out must be a {want} on {device}, got {_describe(out)} on "
                             f"{getattr(out, 'device', None)}")

    # -- one tensor -------------------------------------------------------------------------

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """Compress ``x`` (contiguous 1-D float32, >= 1 element) to a uint8 payload."""
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
            raise ValueError(f"compress: x must be a 1-D torch.float32 tensor, got {_describe(x)}")
        if x.numel() < 1:
            raise ValueError("compress: x must have at least 1 element, got 0")
        x = x.contiguous()
        payload = torch.empty(self.payload_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        self._encode_rows(x.view(1, -1), payload.view(1, -1))
        return payload

    def decompress(self, payload: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None,
                   accumulate: bool = False) -> torch.Tensor:
        """Decode ``payload`` to ``numel`` fp32 values; into ``out`` (added when ``accumulate``)."""
        self._check_payload("decompress", payload, numel, 1)
        if accumulate and out is None:
            raise ValueError("decompress: accumulate=True needs out= (the tensor to add into)")
        self._check_out("decompress", out, numel, payload.device)
        if out is not None and not accumulate and out.is_contiguous():
            self._decode_rows(payload.view(1, -1), numel, out.view(1, -1))
            return out
        values = torch.empty((1, numel), dtype=torch.float32, device=payload.device)
        values = self._decode_rows(payload.view(1, -1), numel, values).view(-1)
        if out is None:
            return values
        # Decoding into a temporary and then adding keeps ``out + D(q)`` bit-identical to adding
        # a separately decoded tensor (no fused multiply-add with a device-dependent rounding).
        if accumulate:
            out.add_(values)
        else:
            out.copy_(values)
        return out

    # -- R rows at once ---------------------------------------------------------------------

    def compress_rows(self, x2d: torch.Tensor) -> torch.Tensor:
        """Compress every row of ``x2d`` (2-D float32 [R, N], R >= 1, N >= 1; made contiguous
        if it is not) to a uint8 tensor [R, payload_bytes(N)]; row r is byte-identical to
        ``compress(x2d[r])``. The result is contiguous, i.e. it already is the flat send buffer
        of R payloads (``.view(-1)``)."""
        if not isinstance(x2d, torch.Tensor) or x2d.dtype != torch.float32 or x2d.dim() != 2:
            raise ValueError(f"compress_rows: x2d must be a 2-D torch.float32 tensor [R, N], got "
                             f"{_describe(x2d)}")
        rows, numel = x2d.shape
        if rows < 1 or numel < 1:
            raise ValueError(f"compress_rows: x2d must have at least 1 row and 1 column, got shape "
                             f"{tuple(x2d.shape)}")
        x2d = x2d.contiguous()
        payload2d = torch.empty((rows, self.payload_bytes(numel)), dtype=torch.uint8,
                                device=x2d.device)
        for block in _row_blocks(rows, numel):
            self._encode_rows(x2d[block], payload2d[block])
        return payload2d

    def decompress_rows(self, payload2d: torch.Tensor, numel: int,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode every row of ``payload2d`` (2-D uint8 [R, payload_bytes(numel)], e.g. a
        ``.view(R, -1)`` of a receive buffer) to float32 [R, numel]: a new contiguous tensor, or
        ``out`` (contiguous float32 [R, numel], overwritten; a reused workspace saves the page
        faults of a fresh bucket-sized tensor on the CPU). Row r is bit-identical to
        ``decompress(payload2d[r], numel)``."""
        self._check_payload("decompress_rows", payload2d, numel, 2)
        rows = payload2d.shape[0]
        self._check_out("decompress_rows", out, numel, payload2d.device, rows)
        if out is None:
            out = torch.empty((rows, numel), dtype=torch.float32, device=payload2d.device)
        for block in _row_blocks(rows, numel):
            self._decode_rows(payload2d[block], numel, out[block])
        return out

    def decompress_rows_sum(self, payload2d: torch.Tensor, numel: int,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum over rows of the decoded ``payload2d`` (as in ``decompress_rows``): float32
        [numel], written into ``out`` (overwritten, not added to) when given. This is a
        reduce-scatter receiver's step: R = dp payloads for its own shard.

        Summation order (fixed, element-wise adds only, so identical run to run, for any
        thread count and on CPU and CUDA alike): pairwise over rows in row order. Adjacent
        rows are added (v0 + v1, v2 + v3, ...), an odd last row is carried to the next level
        unchanged, and so on until one row is left: R = 3 gives (v0 + v1) + v2, R = 4
        (v0 + v1) + (v2 + v3), R = 5 ((v0 + v1) + (v2 + v3)) + v4; R = 1 returns v0 exactly.
        Rows are decoded in blocks of 2**k rows (bounded temporaries); such blocks are whole
        subtrees and their sums are merged like a binary counter, which is the same tree, so
        blocking never changes the result. This is not the sequential ((v0 + v1) + v2) + ...,
        so the result may differ from a row-by-row ``decompress(..., accumulate=True)`` loop
        in the last bits (pairwise rounding error grows with log2 R instead of R).
        """
        self._check_payload("decompress_rows_sum", payload2d, numel, 2)
        self._check_out("decompress_rows_sum", out, numel, payload2d.device)
        rows, device = payload2d.shape[0], payload2d.device
        blocks = _row_blocks(rows, numel)
        step = blocks[0].stop
        work = torch.empty((step, numel), dtype=torch.float32, device=device) if step > 1 else None
        spare: List[torch.Tensor] = []  # freed [numel] partials, reused: few live buffers

        def fresh() -> torch.Tensor:
            return spare.pop() if spare else torch.empty(numel, dtype=torch.float32, device=device)

        # (level, partial sum) of whole subtrees, levels strictly decreasing: merging the top
        # two whenever they are equal, then right to left at the end, rebuilds the global tree
        # (a short last block has a lower level than every full one, so it only merges last).
        # Merges add in place into the left partial (a + b is commutative in IEEE arithmetic).
        stack: List[tuple] = []
        for block in blocks:
            n_rows = block.stop - block.start
            if n_rows == 1:  # its sum is its decoded row
                part = self._decode_rows(payload2d[block], numel, fresh().view(1, numel))[0]
            else:
                part = _pairwise_rows_(self._decode_rows(payload2d[block], numel, work[:n_rows]))
                if len(blocks) > 1:  # the next block reuses work
                    part = fresh().copy_(part)
            level = n_rows.bit_length() - 1  # exact for every block but a short last one
            while stack and stack[-1][0] == level:
                left = stack.pop()[1]
                spare.append(part)
                level, part = level + 1, left.add_(part)
            stack.append((level, part))
        total = stack.pop()[1]
        while stack:
            total = stack.pop()[1].add_(total)
        if out is not None:
            return out.copy_(total)
        return total.clone() if work is not None and len(blocks) == 1 else total

    def ratio(self, numel: int) -> float:
        """fp32 bytes over payload bytes for ``numel`` elements."""
        return 4 * numel / self.payload_bytes(numel)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


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
        scale = (amax / self.level).masked_fill_(small, 0.0).nan_to_num_(
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
        from megatron_grpo.comm.compress_int2 import Int2Compressor  # it builds on this module

        return Int2Compressor(chunk)
    if name == "topk":
        return TopKCompressor(topk_ratio)
    raise ValueError(f"compressor must be one of {', '.join(COMPRESSOR_NAMES)}, got {name!r}")
