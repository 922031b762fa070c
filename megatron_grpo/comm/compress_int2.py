"""int2: 2 bits per element, four levels per chunk placed for the chunk's RMS (the stable tier's
compressor in --grpo-stable-mode compressed; format and rules as in comm/compress.py).

Payload: n_c fp32 scales | ceil(N/4) bytes of four 2-bit codes | zero pad, 4 n_c + round4(ceil(N/4))
bytes (14.2:1 against fp32 at chunk 256).

Why not the symmetric max-scaled quantiser of int4/int8 at 2 bits: with a scale of max|x| it is
ternary, and every value under half its chunk's max sends 0. On gradients that is most of them:
a relative error of ~0.75, the values waiting many steps in the residual. Measured on the tiny
model (1,000 steps) it cost ~0.9 points of late loss on the least important 20 %. Here the scale
is the chunk's RMS s, and the four levels are the Lloyd-Max quantiser of a Gaussian:
+-0.4528 s and +-1.5104 s, thresholds 0 and +-0.9816 s (mean squared error 0.1175 s^2 for
Gaussian values, relative error ~0.34). Values past 1.51 s are clipped and what is clipped
waits in the error-feedback residual.

No level is 0, so a zero decodes to +-0.4528 s unless its whole chunk is zero. Where a bucket
sends zeros on purpose this is harmless: tensor-parallel replicated elements are overwritten by
their exact sync (comm/replicated.py), and the padding of a bucket or shard is never read by
the optimizer; their residuals stay bounded (error feedback on a zero signal). Every rank
decodes the same bytes, so the copies stay identical (tests/multiproc/test_stable_compressed.py).

Code of an element: 2 * (x > 0) + (|x| > 0.9816 s); element 4 j + i sits in bits 2 i, 2 i + 1
of code byte j. Decoding is one fp32 product (level * s), so every rank decoding the same
payload gets the same bits. A chunk whose sum of squares is not finite (a NaN or inf, or values
past ~1e19) gets a NaN scale and decodes to all NaN, so megatron's NaN check after the reduce
still fires; a chunk of zeros has scale 0 and decodes to (signed) zeros.
"""

from __future__ import annotations

import torch

from megatron_grpo.comm.compress_base import Compressor, _bytes_as, _round4, chunk_view

INNER, OUTER, THRESHOLD = 0.4528, 1.5104, 0.9816
"""Lloyd-Max levels and decision threshold of a unit Gaussian at 4 levels, in units of the RMS."""


class Int2Compressor(Compressor):
    """2-bit quantisation, four levels scaled by the RMS of each ``chunk`` elements."""

    name = "int2"

    def __init__(self, chunk: int = 256):
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"{self.name}: chunk must be a positive int, got {chunk!r}")
        self.chunk = chunk

    def payload_bytes(self, numel: int) -> int:
        if not isinstance(numel, int) or numel < 1:
            raise ValueError(f"payload_bytes: numel must be a positive int, got {numel!r}")
        return 4 * -(-numel // self.chunk) + _round4((numel + 3) // 4)

    def _encode_rows(self, x2d: torch.Tensor, payload2d: torch.Tensor) -> None:
        rows, numel = x2d.shape
        xc, n_chunks, padded = chunk_view(x2d, self.chunk)
        start, n_code_bytes = 4 * n_chunks, (numel + 3) // 4
        # The RMS over the chunk's real elements: the zero padding of a short last chunk adds
        # nothing to the sum of squares and is left out of the count.
        count = torch.full((n_chunks,), float(xc.shape[2]), dtype=torch.float32, device=x2d.device)
        if padded != numel:
            count[-1] = float(numel - (n_chunks - 1) * self.chunk)
        scale = torch.mul(xc, xc).sum(dim=2).div_(count).sqrt_()
        # One canonical NaN for a non-finite chunk (as int4/int8): it decodes to all NaN.
        scale.masked_fill_(~scale.isfinite(), float("nan"))
        _bytes_as(payload2d[:, :start], torch.float32).copy_(scale)
        if payload2d.shape[1] > start + n_code_bytes:
            payload2d[:, start + n_code_bytes:].zero_()
        # Comparisons with NaN are False: a non-finite chunk gets fixed codes (its scale decodes it).
        codes = torch.zeros((rows, n_chunks, xc.shape[2]), dtype=torch.uint8, device=x2d.device)
        codes.masked_fill_(xc > 0, 2)
        codes.add_(xc.abs() > scale.mul(THRESHOLD).unsqueeze(2))
        flat = codes.view(rows, padded)
        if 4 * n_code_bytes > padded:  # pad to whole bytes with code 0
            flat = torch.cat([flat, flat.new_zeros((rows, 4 * n_code_bytes - padded))], dim=1)
        packs = flat[:, :4 * n_code_bytes].view(rows, n_code_bytes, 4)
        dst = payload2d[:, start:start + n_code_bytes]
        dst.copy_(packs[:, :, 0])
        for i in range(1, 4):
            dst.bitwise_or_(packs[:, :, i] << (2 * i))

    def _decode_rows(self, payload2d: torch.Tensor, numel: int,
                     out2d: torch.Tensor) -> torch.Tensor:
        rows = payload2d.shape[0]
        n_chunks = -(-numel // self.chunk)
        start, n_code_bytes = 4 * n_chunks, (numel + 3) // 4
        scale = _bytes_as(payload2d[:, :start], torch.float32)
        raw = payload2d[:, start:start + n_code_bytes]
        codes = torch.empty((rows, n_code_bytes, 4), dtype=torch.uint8, device=payload2d.device)
        for i in range(4):
            torch.bitwise_and(raw >> (2 * i), 3, out=codes[:, :, i])
        levels = torch.tensor([-INNER, -OUTER, INNER, OUTER], dtype=torch.float32,
                              device=payload2d.device)
        out2d.copy_(levels[codes.view(rows, 4 * n_code_bytes)[:, :numel].long()])
        full = numel // self.chunk
        if full == n_chunks:
            out2d.view(rows, full, self.chunk).mul_(scale.unsqueeze(2))
            return out2d
        if full:
            out2d[:, :full * self.chunk].view(rows, full, self.chunk).mul_(scale[:, :full].unsqueeze(2))
        out2d[:, full * self.chunk:].mul_(scale[:, full:])
        return out2d
