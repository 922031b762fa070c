"""OffloadedResiduals: the dynamic tier's error-feedback residuals on host memory or SSD between
their two uses in a step.

A residual is read once per step, when its bucket's gradients are ready in backward
(``ErrorFeedback.owed`` adds it into the gradient buffer), and written once, after the
optimizer step (``commit``). In between and until the next step's backward it is not needed, so
it lives in the chunk store's file and only a few are resident at a time:

* read: ``get`` brings a residual back (waiting if it has not arrived: stall time) and asks for
  the next ``lookahead`` ones in the order the previous step used them, so the copies overlap
  backward. It is read with ``keep``: the file keeps the same bytes, and ``release`` (right
  after the residual is added into the gradient) frees the memory at once with no write. If
  the step is then skipped, the committed residual is still in the file: nothing is lost.
* write: ``buffer`` hands ``commit`` the key's tensor to write the new residual into, and
  ``__setitem__`` sends it out; at most ``lookahead + 1`` writes are in flight, so memory stays
  bounded when the disk is slower than the step.

It is a mapping for ``ErrorFeedback`` (get / [] / pop / keys / items / clear, plus release,
buffer and nbytes): the comm layer does not know where residuals live.

Residuals of every storage dtype (``--grpo-residual-dtype``) go through it as their raw bytes:
fp32 and bf16 tensors as they are, an int8 ``QuantisedResidual`` as its one payload tensor (per
chunk its fp32 scale and its codes), so the file holds 4, 2 or about 1 byte per element. A
staged residual (``ErrorFeedback.stage``) stays resident until ``commit`` copies it into the
key's registered storage here; the committed one it replaces stays in the file meanwhile, so a
skipped step loses nothing.
"""

from __future__ import annotations

import time
from typing import Dict, Hashable, Iterator, List, Optional, Tuple

import torch

from megatron_grpo.comm.error_feedback import QuantisedResidual, Residual, backing_tensor

from .store import ChunkStore

RESIDENT, EVICTING, AWAY, FETCHING = "resident", "evicting", "away", "fetching"


class OffloadedResiduals:
    """Residuals keyed like ErrorFeedback's ((unit, bucket index)), kept in ``store``."""

    def __init__(self, store: ChunkStore, target: str = "ssd", lookahead: int = 2,
                 prefix: str = "ef"):
        if target not in ("cpu", "ssd"):
            raise ValueError(f"offload: OffloadedResiduals target must be cpu or ssd, got {target!r}")
        self.store, self.target, self.lookahead = store, target, lookahead
        self._tensors: Dict[Hashable, Residual] = {}  # fp32/bf16 tensors or QuantisedResidual
        self._ids: Dict[Hashable, List[int]] = {}
        self._state: Dict[Hashable, str] = {}
        self._futures: Dict[Hashable, list] = {}
        self._order: List[Hashable] = []  # the order of reads last step
        self._seen: List[Hashable] = []
        self._writes: List[Hashable] = []  # keys whose write-out is in flight, oldest first
        self._names = 0
        self.prefix = prefix  # of the names it registers: unique per store user
        self.stall_s = 0.0
        self.resident_at_start = 0

    # ---- the step -----------------------------------------------------------------------
    def begin_step(self, prefetch: bool = True, drain: bool = False) -> None:
        """Free finished writes; start reading the residuals backward will want first.
        ``prefetch`` False: this step's backward reads none (delayed accumulators between
        stable updates: read only after the optimizer step), so none is read ahead now.
        ``drain``: wait for every write still in flight (stall time) and free it, so nothing
        written last step is resident during this one. ``resident_at_start`` is what is
        resident after that (the bytes held through forward and backward)."""
        self.stall_s = 0.0
        if drain:
            for key in self._writes:
                self._free_when_written(key)
            self._writes.clear()
        self.settle()
        if self._seen:
            # A key read twice (a checkpoint read every residual after backward) keeps its
            # first place.
            self._order, self._seen = list(dict.fromkeys(self._seen)), []
        if prefetch:
            for key in self._order[:self.lookahead]:
                self._fetch(key)
        self.resident_at_start = self.nbytes()

    def expect(self, keys) -> None:
        """This step reads ``keys`` in this order: ``get`` looks ahead in it instead of in last
        step's order."""
        self._order = list(keys)

    def prefetch(self, keys) -> None:
        """Start reading these back now (the first reads of a step whose writes happen in
        the same step, so ``begin_step`` had nothing to read ahead: gradient shards)."""
        for key in keys:
            if key in self._tensors:
                self._fetch(key)

    def get(self, key: Hashable, default=None) -> Optional[Residual]:
        tensor = self._tensors.get(key)
        if tensor is None:
            return default
        self._seen.append(key)
        self._fetch(key)
        self._wait(key)
        if key in self._order:
            i = self._order.index(key)
            for nxt in self._order[i + 1:i + 1 + self.lookahead]:
                # Not one read already since the step began: it was used (and released), and a
                # read-ahead of it would stay resident (a checkpoint reads in another order).
                if nxt not in self._seen:
                    self._fetch(nxt)
        return tensor

    def __getitem__(self, key: Hashable) -> Residual:
        if key not in self._tensors:
            raise KeyError(key)
        return self.get(key)

    def release(self, key: Hashable) -> None:
        """The residual was read and is not changed before ``commit`` writes a new one: drop
        its memory now; the file still holds it. On GPU the read (``ErrorFeedback.owed``'s add)
        may still be queued on the side stream: the caller has recorded that use
        (comm/streams.py), so the allocator reuses the block only after it ran.

        A read ahead that nobody used (a skipped step: GradShards.expect reads gradient shards
        ahead before the step is found non-finite) is waited for and dropped the same way;
        left alone, it stayed resident through the next forward."""
        if self._state.get(key) == FETCHING:
            self._wait(key)  # stall time; read with keep, so the file copy stays current
        if self._state.get(key) != RESIDENT:
            return
        ids = self._ids[key]
        if all(self.store.drop_device(i) for i in ids):
            backing_tensor(self._tensors[key]).untyped_storage().resize_(0)
            self._state[key] = AWAY
        # else: some chunk had no file copy (a residual set but never read back); it stays
        # resident and is sent out with the next write.

    def buffer(self, key: Hashable, like: Residual) -> Residual:
        """Where the new residual ``like`` of ``key`` goes (``commit`` copies all of it there):
        the key's registered residual when it has the same layout, else a new one allocated
        here, on the caller's stream (``like`` was made on GRPO's side stream on GPU; the store
        frees what it registers from the main stream, comm/streams.py)."""
        value = self._tensors.get(key)
        if value is None or not _same_layout(value, like):
            return like.empty_like() if isinstance(like, QuantisedResidual) else torch.empty_like(like)
        for i in self._ids[key]:
            self.store.overwrite(i)  # waits for its pending move; drops the old copies
        tensor = backing_tensor(value)
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        self._state[key], self._futures[key] = RESIDENT, []
        return value

    def __setitem__(self, key: Hashable, value: Residual) -> None:
        """The committed residual of ``key``: sent out now (in the background)."""
        if self._tensors.get(key) is not value:
            if key in self._tensors:  # replaced by another layout: the old one is not read back
                del self[key]
            if not isinstance(value, QuantisedResidual):
                value = value.contiguous()
            self._names += 1
            self._ids[key] = self.store.register(f"{self.prefix}{self._names}/{key}", backing_tensor(value))
            self._tensors[key] = value
        self._state[key] = RESIDENT
        self._evict(key)
        self._writes.append(key)
        while len(self._writes) > self.lookahead + 1:  # bound the memory held by writes
            self._free_when_written(self._writes.pop(0))

    # ---- mapping ------------------------------------------------------------------------
    def pop(self, key: Hashable, default=None):
        tensor = self._tensors.get(key)
        if tensor is None:
            return default
        out = self.get(key).clone()
        del self[key]
        return out

    def __delitem__(self, key: Hashable) -> None:
        """Forget ``key`` without reading it back (a bucket that left the dynamic tier)."""
        if key not in self._tensors:
            raise KeyError(key)
        value = self._tensors[key]
        for i in self._ids[key]:
            self.store.overwrite(i)  # gives its file extent back: the key may come back later
        del self._tensors[key], self._ids[key], self._state[key]
        self._futures.pop(key, None)
        if key in self._writes:
            self._writes.remove(key)
        backing_tensor(value).untyped_storage().resize_(0)  # the store keeps a zero-byte registration

    def keys(self) -> List[Hashable]:
        return list(self._tensors)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._tensors))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def items(self) -> Iterator[Tuple[Hashable, Residual]]:
        for key in list(self._tensors):
            yield key, self.get(key)

    def values(self) -> Iterator[Residual]:
        for _, value in self.items():
            yield value

    def clear(self) -> None:
        for key in list(self._tensors):
            self.pop(key)

    def nbytes(self) -> int:
        """Bytes of residuals resident now (the rest is in the store)."""
        return sum(backing_tensor(v).untyped_storage().nbytes() for v in self._tensors.values())

    def device_bytes_by_key(self) -> Dict[Hashable, int]:
        """Bytes per key on the device: resident or on their way back (a write in flight
        counts as away, where it goes, as TierPlacement.resident_bytes counts)."""
        out = {}
        for key, value in self._tensors.items():
            t = backing_tensor(value)
            out[key] = t.numel() * t.element_size() if self._state.get(key) in (RESIDENT, FETCHING) else 0
        return out

    def placed_bytes(self) -> int:
        """Bytes of all residuals, wherever they are (raw bytes: 4, 2 or ~1 per element)."""
        return sum(backing_tensor(v).numel() * backing_tensor(v).element_size()
                   for v in self._tensors.values())

    # ---- moves --------------------------------------------------------------------------
    def _fetch(self, key: Hashable) -> None:
        state = self._state.get(key)
        if state not in (AWAY, EVICTING):
            return
        tensor = backing_tensor(self._tensors[key])
        if state == AWAY:
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        self._futures[key] = [self.store.prefetch(i, keep=True) for i in self._ids[key]]
        self._state[key] = FETCHING

    def _wait(self, key: Hashable) -> None:
        if self._state.get(key) == FETCHING:
            start = time.perf_counter()
            for f in self._futures.get(key, []):
                f.result()
            self.stall_s += time.perf_counter() - start
        self._futures[key] = []
        self._state[key] = RESIDENT

    def _evict(self, key: Hashable) -> None:
        self._futures[key] = [self.store.evict(i, to=self.target) for i in self._ids[key]]
        self._state[key] = EVICTING

    def _free_when_written(self, key: Hashable) -> None:
        if self._state.get(key) != EVICTING:
            return
        start = time.perf_counter()
        for f in self._futures.get(key, []):
            f.result()
        self.stall_s += time.perf_counter() - start
        backing_tensor(self._tensors[key]).untyped_storage().resize_(0)
        self._state[key], self._futures[key] = AWAY, []

    def settle(self) -> None:
        self.store.check()
        for key in list(self._writes):
            if self._state.get(key) == EVICTING and all(f.done() for f in self._futures[key]):
                self._free_when_written(key)
                self._writes.remove(key)
            elif self._state.get(key) != EVICTING:
                self._writes.remove(key)


def _same_layout(value: Residual, like: Residual) -> bool:
    if isinstance(value, QuantisedResidual) or isinstance(like, QuantisedResidual):
        return isinstance(value, QuantisedResidual) and value.same_layout(like)
    return (value.numel() == like.numel() and value.dtype == like.dtype
            and value.device == like.device)
