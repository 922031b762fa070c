"""What every gradient compressor shares (comm/compress.py has the formats and the rules): the
``Compressor`` interface with its batched-rows helpers, and the byte helpers its payloads use.

Its own module so that compress.py (int4, int8, topk, ``build_compressor``) and
compress_int2.py both build on it, and neither imports the other's module back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional

import torch

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
