"""Error feedback of the compressed tiers, with residual updates that take effect only on a good
step, stored in fp32, bf16 or int8 (``GRPOConfig.residual_dtype``).

Each step a compressed bucket sends q = C(g + r) and keeps r' = (g + r) - D(q), so over T steps
the receivers get sum D(q_t) = sum g_t - r_T (up to rounding): nothing is lost, only delayed.

Why the update is staged rather than applied at once: a step can be skipped after the
gradients were sent (a non-finite gradient anywhere in the replica, found by the optimizer).
On a skipped step nothing was applied, so the residual must stay what it was. So ``owed`` adds
r into the gradient buffer (which becomes c = g + r, the buffer megatron reduces anyway), the
payloads are computed from it, and ``stage`` computes r' = c - D(q) at once, from the buffer and
this rank's own payload, before the exchange overwrites anything; ``commit`` (after the
optimizer step succeeded) makes the staged r' the residual, ``discard`` drops it and keeps r.

Why at stage time and not at commit: the megatron glue frees a unit's full gradient
as soon as its sync has finished, so nothing may read the bucket's gradient buffer after the
exchange. D(q) is decoded a block of shards at a time (``block_elements``), so the only
bucket-sized tensor made is the new residual itself, in its storage dtype. The cost: from a
bucket's stage to ``commit`` the old and the new residual both exist (the old one for a
skipped step); an offloading store keeps the old one in its file.

Storage dtypes (one per ErrorFeedback):

* ``fp32``: the residual as computed; bit for bit what it was before int8 residuals.
* ``bf16``: rounded to bfloat16 (to nearest even) when staged; ``owed`` adds it into the fp32
  gradient exactly (bf16 -> fp32 is exact). 2 bytes per element.
* ``int8``: ``QuantisedResidual``: the flat residual cut into chunks of ``chunk`` elements
  (GRPOConfig.compress_chunk) from element 0, one fp32 scale per chunk, symmetric absmax/127
  rounding to nearest: the int8 compressor's own format (comm/compress.py), one payload row per
  chunk. 1 + 4/chunk bytes per element (plus the zero padding of a short last chunk).

What is lost to the residual's own rounding is not fed back: bf16 and int8 residuals trade a
little of error feedback's exactness for memory (docs/studies/2026-12-03-residual-dtype.md
measures what it costs in loss).
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Union

import torch

from megatron_grpo.comm import streams
from megatron_grpo.comm.compress import Int8Compressor
from megatron_grpo.comm.residual_dtypes import RESIDUAL_DTYPES

STAGE_BLOCK_ELEMENTS = 1 << 22
"""Most elements of D(q) decoded at once when a residual is staged, and of an int8 residual
decoded at once when it is added into a gradient (16 MiB of fp32); a stage block holds whole
shards, at least one."""


class QuantisedResidual:
    """An int8 residual of ``numel`` values: one fp32 scale per ``chunk`` elements counted from
    element 0, symmetric absmax/127 quantisation rounded to nearest (comm/compress.py's int8).

    ``payload`` is uint8 [number of chunks, 4 + chunk rounded up to 4]: row i is chunk i as the
    int8 compressor encodes it (its fp32 scale, then one offset-binary code per element; a short
    last chunk is zero-padded, and zeros encode exactly). ``nbytes()`` is the payload's size.
    Everything is done a block of chunks at a time, so no fp32 copy of the whole residual is
    ever made except by ``float()``."""

    def __init__(self, payload: torch.Tensor, numel: int, chunk: int) -> None:
        codec = Int8Compressor(chunk)
        rows = -(-numel // chunk)
        if payload.dtype != torch.uint8 or tuple(payload.shape) != (rows, codec.payload_bytes(chunk)):
            raise ValueError(f"QuantisedResidual: payload must be uint8 [{rows}, "
                             f"{codec.payload_bytes(chunk)}] for {numel} elements in chunks of "
                             f"{chunk}, got {payload.dtype} {tuple(payload.shape)}")
        self.payload, self._numel, self.chunk, self._codec = payload, numel, chunk, codec

    @classmethod
    def empty(cls, numel: int, chunk: int, device) -> "QuantisedResidual":
        rows = -(-numel // chunk)
        width = Int8Compressor(chunk).payload_bytes(chunk)
        return cls(torch.empty((rows, width), dtype=torch.uint8, device=device), numel, chunk)

    @classmethod
    def quantise(cls, x: torch.Tensor, chunk: int) -> "QuantisedResidual":
        """The int8 residual of the flat fp32 tensor ``x``."""
        out = cls.empty(x.numel(), chunk, x.device)
        step = out._block_elements()
        for start in range(0, x.numel(), step):
            out.write(start, x[start:start + step])
        return out

    # ---- what ErrorFeedback and the stores use --------------------------------------------
    def numel(self) -> int:
        return self._numel

    @property
    def device(self) -> torch.device:
        return self.payload.device

    def nbytes(self) -> int:
        return self.payload.numel()

    def _block_elements(self) -> int:
        return max(1, STAGE_BLOCK_ELEMENTS // self.chunk) * self.chunk

    def write(self, start: int, x: torch.Tensor) -> None:
        """Quantise the fp32 values ``x`` into elements [start, start + len(x)): ``start`` is a
        multiple of ``chunk`` and the end is one too, or the residual's end."""
        n, chunk = x.numel(), self.chunk
        end = start + n
        if start % chunk or (end % chunk and end != self._numel) or end > self._numel:
            raise ValueError(f"QuantisedResidual.write: [{start}, {end}) of {self._numel} is not "
                             f"aligned to chunks of {chunk}")
        full = n // chunk * chunk
        row = start // chunk
        if full:
            self.payload[row:row + full // chunk].copy_(self._codec.compress_rows(x[:full].view(-1, chunk)))
        if full < n:  # the short last chunk, zero-padded (the zeros do not change its scale)
            last = x.new_zeros((1, chunk))
            last[0, :n - full].copy_(x[full:])
            self.payload[row + full // chunk:row + full // chunk + 1].copy_(self._codec.compress_rows(last))

    def _decoded_blocks(self):
        """(start, fp32 values of elements [start, start + len)) a block at a time; the values
        live in one reused buffer."""
        chunk, rows = self.chunk, self.payload.shape[0]
        per = self._block_elements() // chunk
        buf = torch.empty((min(per, rows), chunk), dtype=torch.float32, device=self.device)
        for first in range(0, rows, per):
            n = min(per, rows - first)
            values = self._codec.decompress_rows(self.payload[first:first + n], chunk, out=buf[:n])
            start = first * chunk
            yield start, values.view(-1)[:min(n * chunk, self._numel - start)]

    def add_into(self, target: torch.Tensor) -> torch.Tensor:
        """target += the residual's values (target: flat fp32 of ``numel()`` elements)."""
        for start, values in self._decoded_blocks():
            target[start:start + values.numel()].add_(values)
        return target

    def float(self) -> torch.Tensor:
        """The residual's values as a new flat fp32 tensor."""
        out = torch.empty(self._numel, dtype=torch.float32, device=self.device)
        for start, values in self._decoded_blocks():
            out[start:start + values.numel()].copy_(values)
        return out

    def zero_(self) -> "QuantisedResidual":
        """All values 0 (scale 0, code of q = 0), in place: what quantising zeros gives."""
        self.payload.zero_()
        self.payload[:, 4:4 + self.chunk].fill_(self._codec.offset)
        return self

    def clone(self) -> "QuantisedResidual":
        return QuantisedResidual(self.payload.clone(), self._numel, self.chunk)

    def to(self, device) -> "QuantisedResidual":
        if torch.device(device) == self.device:
            return self
        return QuantisedResidual(self.payload.to(device), self._numel, self.chunk)

    def empty_like(self) -> "QuantisedResidual":
        return QuantisedResidual(torch.empty_like(self.payload), self._numel, self.chunk)

    def copy_(self, other: "QuantisedResidual") -> "QuantisedResidual":
        self.payload.copy_(other.payload)
        return self

    def same_layout(self, other) -> bool:
        return (isinstance(other, QuantisedResidual) and other._numel == self._numel
                and other.chunk == self.chunk and other.device == self.device)

    def state_dict(self) -> Dict:
        """Plain tensors and ints (checkpoints load with or without weights_only)."""
        return {"int8_payload": self.payload.detach().to("cpu", copy=True), "numel": self._numel,
                "chunk": self.chunk}

    @classmethod
    def from_state_dict(cls, state: Dict) -> "QuantisedResidual":
        return cls(state["int8_payload"].clone(), int(state["numel"]), int(state["chunk"]))


Residual = Union[torch.Tensor, QuantisedResidual]


def backing_tensor(value: Residual) -> torch.Tensor:
    """The one tensor that holds a residual's bytes (what a store moves and frees)."""
    return value.payload if isinstance(value, QuantisedResidual) else value


def residual_nbytes(numel: int, dtype: str, chunk: int = 256) -> int:
    """Bytes of one residual of ``numel`` elements stored as ``dtype`` (for planning)."""
    if dtype == "fp32":
        return 4 * numel
    if dtype == "bf16":
        return 2 * numel
    if dtype == "int8":
        return -(-numel // chunk) * Int8Compressor(chunk).payload_bytes(chunk)
    raise ValueError(f"residual dtype must be one of {', '.join(RESIDUAL_DTYPES)}, got {dtype!r}")


def _as_fp32(value: Residual) -> torch.Tensor:
    if isinstance(value, QuantisedResidual):
        return value.float()
    return value if value.dtype == torch.float32 else value.float()


def _to_state(value: Residual):
    if isinstance(value, QuantisedResidual):
        return value.state_dict()
    return value.detach().to("cpu", copy=True)


def _from_state(value) -> Residual:
    if isinstance(value, dict):
        return QuantisedResidual.from_state_dict(value)
    return value.detach().clone()


class _ChunkWriter:
    """Feeds consecutive fp32 pieces of a residual into a QuantisedResidual whole chunks at a
    time. A chunk cut by a piece's end waits (a copy of fewer than ``chunk`` values) for the
    next piece, so pieces need not be aligned to chunks (shards rarely are)."""

    def __init__(self, target: QuantisedResidual) -> None:
        self.target, self.pos, self.tail = target, 0, None

    def push(self, values: torch.Tensor) -> None:
        chunk, numel = self.target.chunk, self.target.numel()
        if self.tail is not None:
            head = torch.cat([self.tail, values[:chunk - self.tail.numel()]])
            values = values[chunk - self.tail.numel():]
            if head.numel() < chunk and self.pos + head.numel() < numel:
                self.tail = head  # the piece was shorter than what the chunk lacked
                return
            self.target.write(self.pos, head)
            self.pos, self.tail = self.pos + head.numel(), None
        full = values.numel() // chunk * chunk
        if self.pos + values.numel() == numel:
            full = values.numel()  # the residual's end: a short last chunk is written as is
        if full:
            self.target.write(self.pos, values[:full])
            self.pos += full
        if full < values.numel():
            self.tail = values[full:].clone()


class ErrorFeedback:
    """Per-bucket residuals of error feedback (keys: (unit, bucket index in its group)).

    ``dtype`` (fp32, bf16 or int8: --grpo-residual-dtype) is how residuals are stored between
    steps and ``chunk`` (--grpo-compress-chunk) the int8 scale's span; see the module docstring.
    Residuals live in a mapping: a dict by default, or the memory tier's OffloadedResiduals
    (``use_store``), which keeps them in host memory or on SSD between their read in ``owed``
    and their write in ``commit``; its ``release`` and ``buffer`` hooks are called when present."""

    def __init__(self, dtype: str = "fp32", chunk: int = 256) -> None:
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"ErrorFeedback: residual dtype (--grpo-residual-dtype, "
                             f"GRPOConfig.residual_dtype) must be one of {', '.join(RESIDUAL_DTYPES)}, "
                             f"got {dtype!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"ErrorFeedback: chunk (--grpo-compress-chunk) must be a positive "
                             f"int, got {chunk!r}")
        self.dtype, self.chunk = dtype, chunk
        self._residuals = {}
        self._staged: Dict[Hashable, Residual] = {}

    def use_store(self, store) -> None:
        """Keep residuals in ``store`` (a mapping with release/buffer, see above); the current
        ones move into it."""
        for key, value in list(self._residuals.items()):
            store[key] = value
        self._residuals = store

    # ------------------------------------------------------------------ one step
    def owed(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """Add the residual of ``key`` into ``grad`` in place (grad becomes c = g + r); returns it."""
        residual = self.residual_to_add(key, grad)
        if residual is not None:
            if isinstance(residual, QuantisedResidual):
                residual.add_into(grad)
            else:
                grad.add_(residual)  # a bf16 residual is widened exactly inside the add
            self.residual_added(key, residual)
        return grad

    def residual_to_add(self, key: Hashable, grad: torch.Tensor) -> Optional[Residual]:
        """The residual of ``key`` as stored, on ``grad``'s device, checked against ``grad``
        (None before its first commit): what ``owed`` adds. A caller that adds it itself (the
        fused CUDA kernel, comm/fused_codec.py) calls ``residual_added`` once its kernel is issued."""
        if not isinstance(grad, torch.Tensor) or grad.dim() != 1 or grad.dtype != torch.float32:
            raise ValueError(f"ErrorFeedback.owed: grad must be a 1-D torch.float32 tensor, got "
                             f"{getattr(grad, 'dtype', type(grad))} with shape "
                             f"{tuple(getattr(grad, 'shape', ()))}")
        residual = self._residuals.get(key)
        if residual is not None:
            if residual.numel() != grad.numel():
                raise ValueError(f"ErrorFeedback.owed: residual for key {key!r} has {residual.numel()} "
                                 f"elements but grad has {grad.numel()}; drop(key) when a bucket changes")
            if residual.device != grad.device:  # loaded from a checkpoint onto the CPU
                residual = residual.to(grad.device)
                self._residuals[key] = residual
        return residual

    def residual_added(self, key: Hashable, residual: Residual) -> None:
        """The residual of ``key`` was read this step (its add issued): protect its memory on
        this stream and let an offloading store release it."""
        # On GPU this add is queued on GRPO's side stream, and an offloading store frees the
        # residual's memory right below; a residual it fetched on the main stream would go
        # back to the main stream's pool with the add still pending (comm/streams.py).
        streams.used_on_current_stream(backing_tensor(residual))
        release = getattr(self._residuals, "release", None)
        if release is not None:  # read once per step; commit writes a new one
            release(key)

    def stage(self, key: Hashable, grad: torch.Tensor, payload: torch.Tensor, rank: int,
              compressor, zero_index: Optional[torch.Tensor] = None, stats=None,
              block_elements: Optional[int] = None) -> None:
        """Compute the new residual r' = c - D(q) of ``key`` now, from c in ``grad`` and what this
        rank sends for every shard (``payload``, uint8 [dp, payload bytes]), a block of shards
        at a time; it becomes the residual on ``commit``. Call right after compressing, before
        the exchange writes this rank's shard: afterwards ``grad`` is not read again.
        ``zero_index``: elements sent exactly (replicated parameters), whose residual stays 0.
        ``stats(applied, owed)``, when given, receives each block's D(q) and c (flat), for the
        health sums of a monitoring step (one decode serves both). ``rank`` is not needed
        any more (every shard's c is still in ``grad``); kept for the callers' signature."""
        del rank
        dp = payload.shape[0]
        shard = grad.numel() // dp
        owed = grad.view(dp, shard)
        block = STAGE_BLOCK_ELEMENTS if block_elements is None else block_elements
        rows = max(1, min(dp, block // max(shard, 1)))
        if self.dtype == "fp32":
            # Decoded straight into the new residual and subtracted in place: the same fp32
            # elementwise c - D(q) as with fp32 residuals, so the same bits.
            new = torch.empty_like(grad)
            out = new.view(dp, shard)
            for first in range(0, dp, rows):
                n = min(rows, dp - first)
                decoded = compressor.decompress_rows(payload[first:first + n], shard, out=out[first:first + n])
                if stats is not None:
                    stats(decoded.view(-1), owed[first:first + n].reshape(-1))
                torch.sub(owed[first:first + n], decoded, out=decoded)
            if zero_index is not None and zero_index.numel():
                new.index_fill_(0, zero_index, 0.0)
            self._staged[key] = new
            return
        new = (torch.empty(grad.numel(), dtype=torch.bfloat16, device=grad.device) if self.dtype == "bf16"
               else QuantisedResidual.empty(grad.numel(), self.chunk, grad.device))
        # One spare element past the block: exact elements outside the block are pointed at it
        # (index arithmetic only, no host sync on a data-dependent count).
        buf = torch.empty(rows * shard + 1, dtype=torch.float32, device=grad.device)
        has_zero = zero_index is not None and zero_index.numel() > 0
        writer = _ChunkWriter(new) if self.dtype == "int8" else None
        for first in range(0, dp, rows):
            n = min(rows, dp - first)
            size = n * shard
            decoded = compressor.decompress_rows(payload[first:first + n], shard,
                                                 out=buf[:size].view(n, shard))
            if stats is not None:
                stats(decoded.view(-1), owed[first:first + n].reshape(-1))
            torch.sub(owed[first:first + n], decoded, out=decoded)
            start = first * shard
            if has_zero:
                rel = zero_index - start
                rel = torch.where((rel >= 0) & (rel < size), rel, torch.full_like(rel, size))
                buf[:size + 1].index_fill_(0, rel, 0.0)
            if writer is None:
                new[start:start + size].copy_(buf[:size])
            else:
                writer.push(buf[:size])
        self._staged[key] = new

    def stage_residual(self, key: Hashable, residual: torch.Tensor,
                       zero_index: Optional[torch.Tensor] = None) -> None:
        """Stage the new residual itself (flat fp32), for compressors whose loss is not
        c - D(own payload) (PowerSGD: c - P_hat Q_i^T, known only after the first all-reduce;
        the inter-instance all-reduce: two losses). Converted to the storage dtype now."""
        if zero_index is not None and zero_index.numel():
            residual.index_fill_(0, zero_index, 0.0)
        self._staged[key] = self._stored_as(residual)

    def _stored_as(self, value: Residual) -> Residual:
        """``value`` in this ErrorFeedback's storage dtype (itself when it already is)."""
        if self.dtype == "int8":
            if isinstance(value, QuantisedResidual):
                return value
            return QuantisedResidual.quantise(_as_fp32(value), self.chunk)
        target = torch.float32 if self.dtype == "fp32" else torch.bfloat16
        if isinstance(value, QuantisedResidual):
            value = value.float()
        return value if value.dtype == target else value.to(target)

    def commit(self) -> None:
        """The step was applied: every staged residual becomes its bucket's residual. With an
        offloading store it is copied into the key's own registered storage (``buffer``), which
        the store then writes out."""
        buffer = getattr(self._residuals, "buffer", None)
        for key in list(self._staged):
            new = self._staged.pop(key)  # freed as it goes: one extra copy at a time
            if buffer is not None:
                dst = buffer(key, new)
                if dst is not new:
                    dst.copy_(new)
                new = dst
            self._residuals[key] = new  # an offloading store sends it out now

    def discard(self) -> None:
        """The step was skipped: residuals stay as they were before it."""
        self._staged.clear()

    @property
    def pending(self) -> bool:
        return bool(self._staged)

    def references_grad(self, key: Hashable) -> bool:
        """Does the staged step of ``key`` still read the bucket's gradient buffer? Never now:
        ``stage`` computes the new residual at once; the megatron glue asks before it
        frees a unit's gradient after its sync."""
        return False

    # ------------------------------------------------------------------ bookkeeping
    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """The committed residual of ``key`` as fp32 (None before its first commit): the stored
        tensor itself for fp32, a decoded copy for bf16 and int8."""
        value = self._residuals.get(key)
        return None if value is None else _as_fp32(value)

    def stored(self, key: Hashable) -> Optional[Residual]:
        """The committed residual of ``key`` as stored (fp32 or bf16 tensor, QuantisedResidual)."""
        return self._residuals.get(key)

    def staged(self, key: Hashable) -> Optional[Residual]:
        """The staged residual of ``key`` (None when nothing is staged for it)."""
        return self._staged.get(key)

    def reset(self, key: Hashable) -> None:
        """Zero the residual of ``key``; keeps the buffer."""
        residual = self._residuals.get(key)
        if residual is not None:
            residual.zero_()
            self._residuals[key] = residual  # changed: an offloading store writes it again

    def drop(self, key: Hashable) -> None:
        """Free the residual of ``key`` (bucket left the dynamic tier); an offloading store
        forgets it without reading it back."""
        if key in self._residuals:
            del self._residuals[key]

    def keys(self) -> List[Hashable]:
        return list(self._residuals)

    def device_bytes_by_key(self) -> Dict[Hashable, int]:
        """Committed residuals' bytes per key on the device (an offloading store's own count)."""
        own = getattr(self._residuals, "device_bytes_by_key", None)
        if own is not None:
            return own()
        return {k: backing_tensor(r).numel() * backing_tensor(r).element_size()
                for k, r in self._residuals.items()}

    def nbytes(self) -> int:
        """Memory held by the residuals, in bytes: the committed ones (only the resident ones,
        with an offloading store) and the staged ones."""
        staged = sum(backing_tensor(v).untyped_storage().nbytes() for v in self._staged.values())
        own = getattr(self._residuals, "nbytes", None)
        if own is not None:
            return own() + staged
        return staged + sum(backing_tensor(r).numel() * backing_tensor(r).element_size()
                            for r in self._residuals.values())

    def state_dict(self) -> Dict:
        """Residuals copied to the CPU as stored (int8: payload bytes, numel and chunk), for
        checkpoints (taken between steps: nothing staged). An offloading store's residuals are
        read back one at a time and released once copied (its file still holds each), so a save
        leaves none resident: kept, they stayed on the device until the next backward."""
        if self._staged:
            raise RuntimeError("ErrorFeedback.state_dict: a step is staged (commit or discard first)")
        release = getattr(self._residuals, "release", None)
        residuals = {}
        for key in self.keys():
            residuals[key] = _to_state(self._residuals.get(key))  # a copy on the CPU
            if release is not None:
                release(key)
        return {"dtype": self.dtype, "residuals": residuals}

    def load_state_dict(self, state: Dict) -> None:
        """Replace all residuals; they stay on the CPU until the next ``owed`` moves them. Saved
        in another dtype (a checkpoint before --grpo-residual-dtype, or a changed flag), they
        are converted to this one; in the same dtype they come back bit for bit."""
        if not isinstance(state, dict) or "residuals" not in state:
            raise ValueError("ErrorFeedback.load_state_dict: state must be a dict from state_dict() "
                             "with key 'residuals'")
        self._residuals.clear()
        for k, v in state["residuals"].items():
            self._residuals[k] = self._stored_as(_from_state(v))
        self._staged.clear()
