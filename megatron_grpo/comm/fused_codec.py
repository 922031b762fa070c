"""The dynamic tier's codec steps, fused for CUDA (Triton kernels: comm/triton_codec.py) or eager.

Each step below picks the fused kernels when its tensors are on CUDA, triton imports and the
case is one the kernels cover (``fused_enabled``, ``_codec_fits``, ``_feedback_fits``), and otherwise runs
the eager codec exactly as before, so nothing changes on the CPU. The fused kernels reproduce
the eager bytes: payloads and int8 residuals byte for byte, decoded sums bit for bit
(tests/unit/test_triton_codec.py, under Triton's interpreter).

=================================  ======================================  ====================
step                               eager (reference, CPU path)             fused (CUDA)
=================================  ======================================  ====================
``compress_with_feedback``         ErrorFeedback.owed, compress_rows,      1 kernel: payload
                                   ErrorFeedback.stage                     and int8 residual
``sum_rows``                       decompress_rows_sum                     1 kernel
``compress_delta``                 (master - copy), compress_rows          1 kernel
``add_decoded``                    rows += decompress_rows(...)            1 kernel
=================================  ======================================  ====================

Fused only where: int4 / int8 compressors (int4 with an even chunk, or one chunk a row), the
int8 residual dtype for the feedback step, no monitoring-step statistics, fewer than 2**12 rows
summed, and tensors small enough for int32 offsets. Everything else is eager. Elements sent
exactly (tensor-parallel replicated ones, ``zero_index``) are fused: a bit mask made once per
bucket (numel / 8 bytes, kept while the bucket's index lives) zeroes their residual.
``MEGATRON_GRPO_FUSED_CODEC=0`` turns the fused kernels off (nothing has been measured on a GPU
yet: docs/compression.md, "Fused kernels on CUDA (Triton)").

One difference on the fused feedback path: the eager ``owed`` leaves c = g + r in the gradient
buffer; the kernel reads g and never writes it back (4 bytes per element saved). The buffer's
own shard is overwritten by the reduced sum either way, and nothing reads its other shards.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Dict, Hashable, Optional, Tuple

import torch

from megatron_grpo.comm.compress import Compressor, Int4Compressor, Int8Compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback, QuantisedResidual

SWITCH = "MEGATRON_GRPO_FUSED_CODEC"
_INT32 = 2 ** 31 - 1
_BLOCK = 1024  # elements per program of the decode kernels
SUM_LEVELS = 12
"""Levels of partial sums the decode-and-sum kernel keeps (triton_codec.decode_sum_kernel):
it sums fewer than 2**12 rows; more go to the eager codec."""


@functools.lru_cache(maxsize=None)
def kernels():
    """comm/triton_codec.py, or None where triton does not import. Set TRITON_INTERPRET=1
    before the first call to get interpreted kernels (how the CPU tests run them)."""
    try:
        from megatron_grpo.comm import triton_codec
    except Exception:  # no triton, or a triton that cannot load here: the eager codec it is
        return None
    return triton_codec


def fused_enabled(*tensors: torch.Tensor) -> bool:
    """Fused kernels for these tensors: all on CUDA, triton imports, not switched off."""
    return (all(t.is_cuda for t in tensors) and os.environ.get(SWITCH, "1") != "0"
            and kernels() is not None)


def _launch(kernel, grid, *args, **constexprs) -> None:
    """Every kernel launch of this module (the tests count them here). No fp contraction: the
    eager codec rounds each product and each sum on its own."""
    kernel[grid](*args, **constexprs, num_warps=4, enable_fp_fusion=False)


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def _codec_fits(compressor: Compressor, numel: int, rows: int) -> bool:
    if type(compressor) not in (Int4Compressor, Int8Compressor):
        return False
    chunk = compressor.chunk
    return ((compressor.bits == 8 or chunk % 2 == 0 or numel <= chunk) and chunk <= 1 << 16
            and rows * max(numel, compressor.payload_bytes(numel)) < _INT32)


def _layout(compressor, numel: int) -> Tuple[int, int, int]:
    """Chunks a row, code bytes a row, payload bytes a row."""
    return (-(-numel // compressor.chunk), compressor._code_bytes(numel),
            compressor.payload_bytes(numel))


# ---- the CUDA-shaped path: allocations, views and one launch each --------------------------

def encode_rows(compressor, a2d: torch.Tensor, b2d: Optional[torch.Tensor] = None) -> torch.Tensor:
    """compress_rows(a2d) (or of a2d - b2d, each widened to fp32) as one kernel: [R, P] uint8."""
    rows, numel = a2d.shape
    n_c, code_bytes, width = _layout(compressor, numel)
    payload = torch.empty((rows, width), dtype=torch.uint8, device=a2d.device)
    _launch(kernels().encode_rows_kernel, (n_c, rows), a2d, a2d if b2d is None else b2d,
            payload, payload.view(torch.float32), numel, n_c, code_bytes, width, width // 4,
            C=compressor.chunk, BITS=compressor.bits,
            BLOCK_H=_pow2(-(-min(compressor.chunk, numel) // 2)), SUB=b2d is not None)
    return payload


def encode_feedback(grad: torch.Tensor, dp: int, compressor,
                    residual: Optional[QuantisedResidual], chunk: int,
                    zero_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, QuantisedResidual]:
    """(payload [dp, P] of c = grad + residual as dp rows, new residual c - D(q) as int8 in
    chunks of ``chunk``, 0 where the uint8 ``zero_mask`` is set) as one kernel: what owed,
    compress_rows and stage compute."""
    numel = grad.numel() // dp
    n_c, code_bytes, width = _layout(compressor, numel)
    payload = torch.empty((dp, width), dtype=torch.uint8, device=grad.device)
    new = QuantisedResidual.empty(grad.numel(), chunk, grad.device)
    old = new.payload if residual is None else residual.payload  # not read without a residual
    _launch(kernels().encode_feedback_kernel, (new.payload.shape[0],), grad,
            old, old.view(torch.float32), payload, payload.view(torch.float32),
            new.payload, new.payload.view(torch.float32), grad if zero_mask is None else zero_mask,
            grad.numel(), numel, n_c, code_bytes, width, width // 4,
            C=compressor.chunk, BITS=compressor.bits,
            BLOCK_H=_pow2(-(-min(compressor.chunk, numel) // 2)),
            RC=chunk, BLOCK_R=_pow2(chunk), W=new.payload.shape[1], HAS_RES=residual is not None,
            HAS_ZERO=zero_mask is not None)
    return payload, new


def decode_sum(compressor, payload2d: torch.Tensor, numel: int,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """decompress_rows_sum as one kernel (into ``out`` when given)."""
    rows = payload2d.shape[0]
    n_c, _, width = _layout(compressor, numel)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=payload2d.device)
    _launch(kernels().decode_sum_kernel, (-(-numel // _BLOCK),), payload2d,
            payload2d.view(torch.float32), out, rows, numel, n_c, width, width // 4,
            C=compressor.chunk, BITS=compressor.bits, BLOCK=_BLOCK)
    return out


def decode_add(compressor, payload2d: torch.Tensor, dst2d: torch.Tensor) -> torch.Tensor:
    """dst2d += decompress_rows(payload2d).to(dst2d.dtype) as one kernel (dst2d contiguous)."""
    rows, numel = dst2d.shape
    n_c, _, width = _layout(compressor, numel)
    _launch(kernels().decode_add_kernel, (-(-numel // _BLOCK), rows), payload2d,
            payload2d.view(torch.float32), dst2d, numel, n_c, width, width // 4,
            C=compressor.chunk, BITS=compressor.bits, BLOCK=_BLOCK)
    return dst2d


# ---- what comm/dynamic.py calls: fused where it fits, the eager codec elsewhere -----------

_ZERO_MASKS: Dict[int, tuple] = {}  # id(zero_index) -> (weak ref to it, numel, its bit mask)


def _zero_mask(zero_index: Optional[torch.Tensor], numel: int) -> Optional[torch.Tensor]:
    """A bit mask of the elements ``zero_index`` lists (element e: bit e % 8 of byte e // 8;
    None for none), made once per index tensor, as a bucket's replicated elements do not change
    (marking them in the kernel's input each step would be eager ops). It holds numel / 8
    bytes for as long as the index tensor lives."""
    if zero_index is None or zero_index.numel() == 0:
        return None
    held = _ZERO_MASKS.get(id(zero_index))
    if held is not None and held[0]() is zero_index and held[1] == numel:
        return held[2]
    for key in [k for k, (ref, _, _) in _ZERO_MASKS.items() if ref() is None]:
        del _ZERO_MASKS[key]
    dense = torch.zeros(-(-numel // 8) * 8, dtype=torch.uint8, device=zero_index.device)
    dense.index_fill_(0, zero_index, 1)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=dense.device)
    mask = dense.view(-1, 8).mul_(weights).sum(dim=1, dtype=torch.uint8)
    _ZERO_MASKS[id(zero_index)] = (weakref.ref(zero_index), numel, mask)
    return mask


def _feedback_fits(grad, dp, ef, compressor, zero_index, stats) -> bool:
    return (stats is None and (zero_index is None or zero_index.device == grad.device)
            and ef.dtype == "int8" and ef.chunk <= 1 << 16 and grad.is_contiguous()
            and grad.numel() % dp == 0 and grad.numel() < _INT32
            and _codec_fits(compressor, grad.numel() // dp, dp) and fused_enabled(grad))


def compress_with_feedback(key: Hashable, grad: torch.Tensor, dp: int, ef: ErrorFeedback,
                           compressor: Compressor, rank: int,
                           zero_index: Optional[torch.Tensor] = None, stats=None,
                           block_elements: Optional[int] = None) -> torch.Tensor:
    """The send payload [dp, P] of c = grad + the residual of ``key``, with the new residual
    c - D(q) staged in ``ef``: ``ef.owed``, ``compress_rows`` and ``ef.stage`` (arguments as
    there), or the fused kernel."""
    if _feedback_fits(grad, dp, ef, compressor, zero_index, stats):
        residual = ef.residual_to_add(key, grad)
        # An int8 store holds QuantisedResidual; one loaded with another chunk goes eager.
        if residual is None or (isinstance(residual, QuantisedResidual) and residual.chunk == ef.chunk):
            send, new = encode_feedback(grad, dp, compressor, residual, ef.chunk,
                                        _zero_mask(zero_index, grad.numel()))
            if residual is not None:
                ef.residual_added(key, residual)
            ef.stage_residual(key, new)
            return send
    owed = ef.owed(key, grad).view(dp, grad.numel() // dp)
    send = compressor.compress_rows(owed)
    ef.stage(key, grad, send, rank, compressor, zero_index, stats=stats,
             block_elements=block_elements)
    return send


def sum_rows(compressor: Compressor, payload2d: torch.Tensor, numel: int,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``compressor.decompress_rows_sum(payload2d, numel, out=out)``, fused where it fits."""
    rows = payload2d.shape[0]
    if (rows < 2 ** SUM_LEVELS and payload2d.is_contiguous() and _codec_fits(compressor, numel, rows)
            and (out is None or (out.is_contiguous() and out.dtype == torch.float32))
            and fused_enabled(payload2d, *(() if out is None else (out,)))):
        return decode_sum(compressor, payload2d, numel, out)
    return compressor.decompress_rows_sum(payload2d, numel, out=out)


def compress_delta(compressor: Compressor, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """Payload [1, P] of master - copy (both widened to fp32): prepare_param_delta's."""
    numel = master.numel()
    if (_codec_fits(compressor, numel, 1) and master.is_contiguous() and copy.is_contiguous()
            and fused_enabled(master, copy)):
        return encode_rows(compressor, master.view(1, numel), copy.view(1, numel))
    delta = master.to(torch.float32) - copy.to(torch.float32)
    return compressor.compress_rows(delta.view(1, numel))


def add_decoded(compressor: Compressor, payload2d: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [R, N] += each payload row decoded, in rows' dtype: gather_param_delta's."""
    count, numel = rows.shape
    if (_codec_fits(compressor, numel, count) and rows.is_contiguous() and payload2d.is_contiguous()
            and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and fused_enabled(payload2d, rows)):
        decode_add(compressor, payload2d, rows)
        return
    rows.add_(compressor.decompress_rows(payload2d, numel).to(rows.dtype))
