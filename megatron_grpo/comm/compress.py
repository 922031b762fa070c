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

Only torch ops on the input's device are used (no Python loop over elements), so the same code
runs on CPU and CUDA tensors.
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
    """Reinterpret payload bytes as ``dtype``; copies only when the slice is misaligned."""
    try:
        return raw.view(dtype)
    except RuntimeError:  # storage offset not a multiple of the element size
        return raw.clone().view(dtype)


class Compressor(ABC):
    """Turns a 1-D fp32 tensor into a uint8 payload whose size depends only on its length."""

    name: str = ""

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Exact size in bytes of the payload for ``numel`` elements."""

    @abstractmethod
    def _encode(self, x: torch.Tensor, payload: torch.Tensor) -> None:
        """Fill ``payload`` (fresh, aligned, right size) from the validated input ``x``."""

    @abstractmethod
    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """Return a new fp32 tensor of ``numel`` decoded values."""

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """Compress ``x`` (contiguous 1-D float32, >= 1 element) to a uint8 payload."""
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
            raise ValueError(f"compress: x must be a 1-D torch.float32 tensor, got "
                             f"{getattr(x, 'dtype', type(x))} with shape {tuple(getattr(x, 'shape', ()))}")
        if x.numel() < 1:
            raise ValueError("compress: x must have at least 1 element, got 0")
        x = x.contiguous()
        payload = torch.empty(self.payload_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        self._encode(x, payload)
        return payload

    def decompress(self, payload: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None,
                   accumulate: bool = False) -> torch.Tensor:
        """Decode ``payload`` to ``numel`` fp32 values; into ``out`` (added when ``accumulate``)."""
        if not isinstance(numel, int) or numel < 1:
            raise ValueError(f"decompress: numel must be a positive int, got {numel!r}")
        expected = self.payload_bytes(numel)
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expected:
            raise ValueError(f"decompress: payload must be a 1-D torch.uint8 tensor of "
                             f"{expected} bytes for {self.name} with numel={numel}, got "
                             f"{payload.dtype} with shape {tuple(payload.shape)}")
        if accumulate and out is None:
            raise ValueError("decompress: accumulate=True needs out= (the tensor to add into)")
        if out is not None and (out.dtype != torch.float32 or out.dim() != 1 or out.numel() != numel
                                or out.device != payload.device):
            raise ValueError(f"decompress: out must be a 1-D torch.float32 tensor of {numel} elements "
                             f"on {payload.device}, got {out.dtype} with shape {tuple(out.shape)} "
                             f"on {out.device}")
        values = self._decode(payload, numel)
        if out is None:
            return values
        # Decoding into a temporary and then adding keeps ``out + D(q)`` bit-identical to adding
        # a separately decoded tensor (no fused multiply-add with a device-dependent rounding).
        if accumulate:
            out.add_(values)
        else:
            out.copy_(values)
        return out

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
    |x - D(C(x))| <= scale / 2 per element, up to fp32 rounding.
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

    def _codes(self, x: torch.Tensor, payload: torch.Tensor, n_codes: int) -> torch.Tensor:
        """Write the scales into ``payload``; return uint8 codes for the first ``n_codes``
        elements (``n_codes`` >= numel; codes past numel encode 0)."""
        numel, chunk = x.numel(), self.chunk
        n_chunks = -(-numel // chunk)
        padded = n_chunks * chunk
        if padded == numel:
            xc = x.view(n_chunks, chunk)  # common case (bucket shards of whole chunks): no copy
        else:
            xp = torch.zeros(padded, dtype=x.dtype, device=x.device)
            xp[:numel].copy_(x)
            xc = xp.view(n_chunks, chunk)
        lo, hi = torch.aminmax(xc, dim=1)  # no |x| temporary of the full size
        amax = torch.maximum(hi, lo.neg())
        usable = ~(amax < _MIN_CHUNK_MAX)  # written so that a NaN max counts as usable
        scale = torch.where(usable, amax / self.level, torch.zeros_like(amax))
        inv = torch.where(usable, self.level / torch.where(usable, amax, torch.ones_like(amax)),
                          torch.zeros_like(amax))
        _bytes_as(payload[:4 * n_chunks], torch.float32).copy_(scale)
        # |x * inv| <= L (+ a few ulp), so x * inv + offset + 0.5 lies in [1.5, 2 * offset - 0.5]
        # and the float->uint8 cast (truncation) is round-to-nearest with no clamp needed.
        # A non-finite x makes its chunk's scale non-finite, so the chunk decodes non-finite and
        # megatron's NaN check after the reduce still fires.
        w = torch.mul(xc, inv.unsqueeze(1)).add_(self.offset + 0.5)
        codes = torch.empty(max(n_codes, padded), dtype=torch.uint8, device=x.device)
        codes[:padded].copy_(w.view(-1))
        codes[padded:].fill_(self.offset)
        return codes[:n_codes]

    def _encode(self, x: torch.Tensor, payload: torch.Tensor) -> None:
        numel = x.numel()
        n_chunks = -(-numel // self.chunk)
        start, n_code_bytes = 4 * n_chunks, self._code_bytes(numel)
        payload[start + n_code_bytes:].zero_()
        dst = payload[start:start + n_code_bytes]
        if self.bits == 8:
            dst.copy_(self._codes(x, payload, numel))
            return
        pairs = self._codes(x, payload, 2 * n_code_bytes).view(n_code_bytes, 2)
        # Element 2j in the low nibble, 2j+1 in the high one. The mask only matters for codes of
        # NaN inputs (undefined cast), which must not spill into the neighbour's nibble.
        torch.bitwise_and(pairs[:, 0], 15, out=dst)
        dst.bitwise_or_(pairs[:, 1] << 4)

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        chunk = self.chunk
        n_chunks = -(-numel // chunk)
        padded = n_chunks * chunk
        start, n_code_bytes = 4 * n_chunks, self._code_bytes(numel)
        scale = _bytes_as(payload[:start], torch.float32)
        raw = payload[start:start + n_code_bytes]
        codes = torch.empty(max(padded, 2 * n_code_bytes), dtype=torch.uint8, device=payload.device)
        if self.bits == 8:
            codes[:numel].copy_(raw)
            filled = numel
        else:
            pairs = codes[:2 * n_code_bytes].view(n_code_bytes, 2)
            torch.bitwise_and(raw, 15, out=pairs[:, 0])
            torch.bitwise_right_shift(raw, 4, out=pairs[:, 1])
            filled = 2 * n_code_bytes
        codes[filled:].fill_(self.offset)
        # Subtracting the offset in uint8 wraps to the two's-complement bytes of q, so the signed
        # view converts straight to fp32 (cheaper than subtracting in fp32).
        q = codes[:padded].sub_(self.offset).view(torch.int8).to(torch.float32)
        q.view(n_chunks, chunk).mul_(scale.unsqueeze(1))
        return q[:numel]


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

    def _encode(self, x: torch.Tensor, payload: torch.Tensor) -> None:
        k = self.k(x.numel())
        _, idx = torch.topk(x.abs(), k, sorted=False)
        idx, _ = torch.sort(idx)
        _bytes_as(payload[:4 * k], torch.int32).copy_(idx)
        torch.index_select(x, 0, idx, out=_bytes_as(payload[4 * k:], torch.float32))

    def _decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        k = self.k(numel)
        # index_copy_ bounds-checks the indices itself (an error on CPU, a device assert on CUDA).
        idx = _bytes_as(payload[:4 * k], torch.int32).long()
        values = torch.zeros(numel, dtype=torch.float32, device=payload.device)
        values.index_copy_(0, idx, _bytes_as(payload[4 * k:], torch.float32))
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
