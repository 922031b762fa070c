"""Gradient / update compressors for the dynamic tier, and the error-feedback residuals.

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
topk       k int32 indices (ascending) | k fp32 values                          8 k
=========  ===================================================================  =================

Why the pad to 4 bytes: receivers slice a payload out of one big receive buffer at offsets that
are multiples of the payload size; a multiple of 4 keeps every payload's fp32/int32 part aligned
so it can be read in place (``view``) rather than copied.

Decoding of the integer formats is exact arithmetic on the bytes (one fp32 multiply), so every
rank that decodes the same payload gets bit-identical values: the property compressed parameter
updates rely on (``model_copy += D(q)`` on all ranks).

Batched rows: a bucket is dp shards of equal length, i.e. a [dp, N] view, and its payloads are
a [dp, P] view of the send / receive buffer. ``compress_rows`` / ``decompress_rows`` /
``decompress_rows_sum`` handle all R rows with a fixed number of tensor ops (the sum: one add
per halving, ceil(log2 R)), so host overhead per bucket no longer grows with dp; a per-shard
Python loop costs ~14 ops per shard (3.4 ms per bucket at dp=8, 260 ms at dp=512). ``compress`` and
``decompress`` are the R = 1 case of the same code, so a row of a batch is byte-identical to
the shard compressed alone (see TopKCompressor for the one CUDA caveat). Price: temporaries
are sized for the whole [R, N] block (about one bucket of fp32) instead of one shard.

Only torch ops on the input's device are used (no Python loop over elements or rows), so the
same code runs on CPU and CUDA tensors.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Dict, Hashable, List, Optional

import torch

COMPRESSOR_NAMES = ("int4", "int8", "topk")

# A chunk whose max |x| is below this is sent as zeros: 7 / max|x| would overflow fp32 (and the
# scale would be subnormal). Such values are ~1e-36; error feedback keeps them in the residual.
_MIN_CHUNK_MAX = 2.0 ** -120


def _round4(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret payload bytes (last dim) as ``dtype``; copies only when misaligned."""
    try:
        return raw.view(dtype)
    except RuntimeError:  # storage offset or a row stride not a multiple of the element size
        return raw.clone().view(dtype)


def _describe(t) -> str:
    return f"{getattr(t, 'dtype', type(t).__name__)} with shape {tuple(getattr(t, 'shape', ()))}"


def _sum_rows_(values: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """Sum the rows of ``values`` [R, N] (clobbered) by pairwise halving (decompress_rows_sum)."""
    rows = values.shape[0]
    while rows > 2:
        half = (rows + 1) // 2
        # Rows [half, rows) fold onto rows [0, rows - half); with rows odd, row half-1 waits.
        values[:rows - half].add_(values[half:rows])
        rows = half
    if out is None:
        return values[0] + values[1] if rows == 2 else values[0].clone()
    if rows == 2:
        return torch.add(values[0], values[1], out=out)
    return out.copy_(values[0])


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
    def _decode_rows(self, payload2d: torch.Tensor, numel: int) -> torch.Tensor:
        """Return a new contiguous fp32 [R, numel] tensor of the rows' decoded values."""

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
    def _check_out(fn: str, out: Optional[torch.Tensor], numel: int, device: torch.device) -> None:
        if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32
                                or out.dim() != 1 or out.numel() != numel or out.device != device):
            raise ValueError(f"{fn}: out must be a 1-D torch.float32 tensor of {numel} elements "
                             f"on {device}, got {_describe(out)} on {getattr(out, 'device', None)}")

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
        values = self._decode_rows(payload.view(1, -1), numel).view(-1)
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
        self._encode_rows(x2d, payload2d)
        return payload2d

    def decompress_rows(self, payload2d: torch.Tensor, numel: int) -> torch.Tensor:
        """Decode every row of ``payload2d`` (2-D uint8 [R, payload_bytes(numel)], e.g. a
        ``.view(R, -1)`` of a receive buffer) to a new contiguous float32 [R, numel]; row r is
        bit-identical to ``decompress(payload2d[r], numel)``."""
        self._check_payload("decompress_rows", payload2d, numel, 2)
        return self._decode_rows(payload2d, numel)

    def decompress_rows_sum(self, payload2d: torch.Tensor, numel: int,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sum over rows of the decoded ``payload2d`` (as in ``decompress_rows``): float32
        [numel], written into ``out`` (overwritten, not added to) when given. This is a
        reduce-scatter receiver's step: R = dp payloads for its own shard.

        Summation order (fixed, element-wise, so identical run to run, for any thread count
        and on CPU and CUDA alike): pairwise halving. With R rows and h = ceil(R / 2), rows
        [h, R) are added onto rows [0, R - h) (row i += row i + h; with R odd, row h - 1
        waits), then the same on the first h rows, until one row is left; e.g. R = 4 gives
        (v0 + v2) + (v1 + v3). R = 1 returns v0 exactly, R = 2 v0 + v1. This is not the
        sequential ((v0 + v1) + v2) + ..., so the result may differ from a row-by-row
        ``decompress(..., accumulate=True)`` loop in the last bits (pairwise rounding error
        grows with log2 R instead of R). Needs a temporary of R * numel fp32.
        """
        self._check_payload("decompress_rows_sum", payload2d, numel, 2)
        self._check_out("decompress_rows_sum", out, numel, payload2d.device)
        return _sum_rows_(self._decode_rows(payload2d, numel), out)

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
        n_chunks = -(-numel // chunk)
        padded = n_chunks * chunk if numel > chunk else numel  # zero padding doesn't change amax
        start, n_code_bytes = 4 * n_chunks, self._code_bytes(numel)
        if padded == numel:
            xc = x2d.view(rows, n_chunks, padded // n_chunks)  # whole chunks, or N < C: no copy
        else:
            xp = x2d.new_zeros((rows, padded))
            xp[:, :numel].copy_(x2d)
            xc = xp.view(rows, n_chunks, chunk)
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

    def _decode_rows(self, payload2d: torch.Tensor, numel: int) -> torch.Tensor:
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
        values = torch.empty((rows, numel), dtype=torch.float32, device=payload2d.device)
        values.copy_(q.view(torch.int8))
        # Whole chunks as a [R, full, C] view, the short last chunk (if any) on its own: no
        # padded buffer and a contiguous result. Each value is one exact fp32 product.
        full = numel // chunk
        if full:
            values[:, :full * chunk].view(rows, full, chunk).mul_(scale[:, :full].unsqueeze(2))
        if full < n_chunks:
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
        _, idx = torch.topk(x2d.abs(), k, dim=1, sorted=False)
        # Indices are unique, so any sort gives the same order. A single row is sorted as 1-D:
        # torch sorts a 1-D tensor with all threads but each row of a 2-D one on one thread
        # (128 MiB on 2 CPU threads: 128 ms vs 240 ms).
        if idx.shape[0] == 1:
            idx = torch.sort(idx.view(-1))[0].view(1, k)
        else:
            idx = torch.sort(idx, dim=1)[0]
        _bytes_as(payload2d[:, :4 * k], torch.int32).copy_(idx)
        _bytes_as(payload2d[:, 4 * k:], torch.float32).copy_(torch.gather(x2d, 1, idx))

    def _decode_rows(self, payload2d: torch.Tensor, numel: int) -> torch.Tensor:
        k = self.k(numel)
        # scatter_ bounds-checks the indices itself (an error on CPU, a device assert on CUDA).
        idx = _bytes_as(payload2d[:, :4 * k], torch.int32).long()
        values = torch.zeros((payload2d.shape[0], numel), dtype=torch.float32,
                             device=payload2d.device)
        values.scatter_(1, idx, _bytes_as(payload2d[:, 4 * k:], torch.float32))
        return values


def build_compressor(name: str, chunk: int = 256, topk_ratio: float = 0.05) -> Compressor:
    """The compressor called ``name`` (GRPOConfig.compressor), with its settings."""
    if name == "int4":
        return Int4Compressor(chunk)
    if name == "int8":
        return Int8Compressor(chunk)
    if name == "topk":
        return TopKCompressor(topk_ratio)
    raise ValueError(f"compressor must be one of {', '.join(COMPRESSOR_NAMES)}, got {name!r}")


class ErrorFeedback:
    """Per-bucket residuals of error feedback: what compression has not delivered yet.

    Each step sends q = C(g + r) and keeps r = (g + r) - D(q), so over T steps the receivers get
    sum D(q_t) = sum g_t - r_T (up to fp32 rounding): nothing is lost, only delayed.
    """

    def __init__(self):
        self._residuals: Dict[Hashable, torch.Tensor] = {}

    def compress(self, key: Hashable, grad: torch.Tensor, compressor: Compressor,
                 shards: int) -> List[torch.Tensor]:
        """Compress ``grad + residual(key)`` as ``shards`` equal contiguous shards; update the residual."""
        if not isinstance(grad, torch.Tensor) or grad.dim() != 1 or grad.dtype != torch.float32:
            raise ValueError(f"ErrorFeedback.compress: grad must be a 1-D torch.float32 tensor, got "
                             f"{getattr(grad, 'dtype', type(grad))} with shape "
                             f"{tuple(getattr(grad, 'shape', ()))}")
        if not isinstance(shards, int) or shards < 1 or grad.numel() % shards:
            raise ValueError(f"ErrorFeedback.compress: shards must be a positive int dividing "
                             f"grad.numel()={grad.numel()}, got {shards!r}")
        residual = self._residuals.get(key)
        if residual is None:
            residual = torch.zeros_like(grad)
        elif residual.numel() != grad.numel():
            raise ValueError(f"ErrorFeedback.compress: residual for key {key!r} has {residual.numel()} "
                             f"elements but grad has {grad.numel()}; drop(key) when a bucket changes")
        elif residual.device != grad.device:  # e.g. loaded from a checkpoint onto the CPU
            residual = residual.to(grad.device)
        self._residuals[key] = residual
        # The residual buffer becomes c = g + r in place, then c - D(q) shard by shard: no
        # second bucket-sized buffer.
        residual.add_(grad)
        shard_len = grad.numel() // shards
        payloads = []
        for s in range(shards):
            c = residual[s * shard_len:(s + 1) * shard_len]
            q = compressor.compress(c)
            c.sub_(compressor.decompress(q, shard_len))
            payloads.append(q)
        return payloads

    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """The residual of ``key`` (None before its first compress)."""
        return self._residuals.get(key)

    def reset(self, key: Hashable) -> None:
        """Zero the residual of ``key`` (e.g. after it was sent exactly); keeps the buffer."""
        if key in self._residuals:
            self._residuals[key].zero_()

    def drop(self, key: Hashable) -> None:
        """Free the residual of ``key`` (bucket left the dynamic tier)."""
        self._residuals.pop(key, None)

    def keys(self) -> List[Hashable]:
        return list(self._residuals)

    def nbytes(self) -> int:
        """Memory held by the residuals, in bytes."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def state_dict(self) -> Dict[str, Dict[Hashable, torch.Tensor]]:
        """Residuals copied to the CPU, for checkpoints."""
        return {"residuals": {k: r.detach().to("cpu", copy=True) for k, r in self._residuals.items()}}

    def load_state_dict(self, state: Dict[str, Dict[Hashable, torch.Tensor]]) -> None:
        """Replace all residuals; they stay on the CPU until the next compress moves them."""
        if not isinstance(state, dict) or "residuals" not in state:
            raise ValueError("ErrorFeedback.load_state_dict: state must be a dict from state_dict() "
                             "with key 'residuals'")
        self._residuals = {k: v.detach().clone() for k, v in state["residuals"].items()}
