"""TierPlacement: where each tier unit's optimizer state lives, step by step.

The stable tier is updated once every ``--grpo-stable-interval`` steps. Between its updates the
optimizer never reads its state (GRPO gives those shards no gradient, so Adam skips them), so
its Adam moments and fp32 master shards can leave device memory: they are evicted to host
memory or to the rank's SSD file after an update and prefetched one step before the next, on
the chunk store's worker threads, so the copies overlap a whole step of compute.

With ``stream=True`` the dynamic tier's state (and the stable tier's at its updates) lives
away too and passes through the optimizer step one tier unit at a time: unit i+1's moments and
master are read back while unit i is updated and its new weights copied to the model, and unit
i's go out again right after (``stream()``, driven by the glue's windowed optimizer step), so at
most two units' state is resident at once. The first unit's is prefetched during forward and
backward. Core units stay resident.

State is placed in groups keyed ``(unit index, kind)``: kind ``master`` or ``moments``.

Evicting frees memory for real: once every chunk of a tensor is safely away (its eviction
Futures completed: on CUDA the store's copy stream has finished reading it, so the caching
allocator may hand the block to the next allocation at once) its storage is resized to zero
bytes (the tensor keeps its shape and identity, so the optimizer and megatron
still hold the same objects); prefetching allocates it again and copies the bytes back, bit for
bit. Torch does not check a kernel's reads against a zero-byte storage, so reading an evicted
tensor is undefined (it can crash): everything that reads this state goes through ``ensure()``
and ``stream()`` (the optimizer step), ``saved_tensor()`` (checkpoint saving) or
``resident_all()``, and the tests compare runs with and without offload bit for bit.

A checkpoint brings nothing back to the device: ``prepare_save()`` lets the moves in flight
land, and the optimizer's state dict takes each away tensor's bytes straight from the store
into host memory (``saved_tensor``; a map of the SSD file where the chunks lie in order, so
they become page cache only as the writer reads them). Bringing every unit back for the save
held all state at once, the run's peak exactly when it checkpointed.

This module knows nothing of megatron: the glue (megatron_grpo.megatron.offload) hands it, per
unit, the (name, tensor) pairs to place, and says which units the next steps need.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import torch

from .store import ChunkStore

TARGETS = ("none", "cpu", "ssd")
STREAMED_TIERS = ("dynamic", "stable")
STREAMED_KINDS = ("moments", "master")
RESIDENT, EVICTING, AWAY, FETCHING = "resident", "evicting", "away", "fetching"


@dataclass
class _Placed:
    name: str
    tensor: torch.Tensor
    ids: List[int]
    nbytes: int


@dataclass
class _Unit:
    tensors: List[_Placed] = field(default_factory=list)
    state: str = RESIDENT
    futures: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def owns_storage(tensor: torch.Tensor) -> bool:
    """True when the tensor is the only user of its whole storage, so freeing the storage frees
    exactly this tensor (views into a shared buffer must not be freed)."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


class TierPlacement:
    """Moves units' state between device and ``target`` (cpu or ssd) on a ChunkStore."""

    def __init__(self, store: ChunkStore, target: str, stream: bool = False,
                 stream_core: bool = False):
        if target not in ("cpu", "ssd"):
            raise ValueError(f"offload: TierPlacement target must be cpu or ssd, got {target!r}")
        self.store, self.target, self.stream_on = store, target, stream
        self.units: Dict[Hashable, _Unit] = {}
        self._known: Dict[int, Tuple[Hashable, str]] = {}  # id(tensor) -> (key, name)
        self._fresh: set = set()  # keys of groups registered since the last begin_step
        self.stall_s = 0.0  # time the training loop waited for prefetches, this step
        self.residuals = None  # OffloadedResiduals of the error feedback, when offloaded
        self.accumulators = None  # OffloadedResiduals of the delayed stable accumulators
        self.grads = None  # OffloadedResiduals of gradient shards (the glue's GradShards drives it)
        self.stream_everything = False  # this step streams core units too (GRPO's warm-up)
        self.stream_core = stream and stream_core  # --grpo-offload-core: every step
        self._last_stats = store.stats()
        self.tiers: Sequence[str] = ()

    # ---- registration ------------------------------------------------------------------
    def add(self, state: Dict[Hashable, List[Tuple[str, torch.Tensor]]]) -> None:
        """Register state tensors not seen before (optimizer state appears lazily, at a
        parameter's first update). A tensor seen before must still be the same object: state
        replaced behind the store's back (a load into new tensors) would be lost, so it is an
        error, not a silent re-registration."""
        for unit, pairs in state.items():
            placed = self.units.setdefault(unit, _Unit())
            names = {t.name: t for t in placed.tensors}
            for name, tensor in pairs:
                old = names.get(name)
                if old is not None:
                    if old.tensor is not tensor:
                        raise RuntimeError(
                            f"offload: state tensor {name!r} of unit {unit} was replaced by a new "
                            f"tensor while the placement held the old one; load checkpoints "
                            f"before the first step (the training entry does)")
                    continue
                if id(tensor) in self._known:
                    continue  # shared by two names: placed once
                if not owns_storage(tensor):
                    raise ValueError(f"offload: state tensor {name!r} of unit {unit} is a view "
                                     f"into a larger buffer; only tensors that own their "
                                     f"storage can be offloaded")
                if placed.state != RESIDENT:
                    # Joining a unit that is away: bring the unit back first (rare: state is
                    # created at a unit's first update, when it is resident).
                    self._fetch(placed)
                    self._wait(placed)
                label = "/".join(map(str, unit)) if isinstance(unit, tuple) else str(unit)
                ids = self.store.register(f"unit{label}/{name}", tensor)
                placed.tensors.append(_Placed(name, tensor, ids, tensor.numel() * tensor.element_size()))
                self._known[id(tensor)] = (unit, name)
                self._fresh.add(unit)

    # ---- the schedule ------------------------------------------------------------------
    def begin_step(self, tiers: Sequence[str], update_now: bool, update_next: bool,
                   stream_all: bool = False) -> None:
        """Before a step: free what finished evicting, then evict the stable units this step
        and the next do not update, and prefetch those the next step updates (one step ahead,
        so the copy overlaps this step's compute); with streaming, start reading back the
        first unit the optimizer step will update. ``stream_all`` (GRPO's exact warm-up, when
        every unit is core): stream every unit, so the warm-up's peak is no higher than the
        tiered steps'."""
        self.tiers = list(tiers)
        self.stream_everything = stream_all and self.stream_on
        self.stall_s = 0.0
        self.settle()
        if self.residuals is not None:
            self.residuals.begin_step()
        if self.accumulators is not None:
            # Read back at the step's end, after the optimizer step, and in backward only by a
            # stable update: between updates none is resident through forward and backward.
            self.accumulators.begin_step(prefetch=update_now, drain=True)
        for key, unit in self.units.items():
            if self.needed(key, update_now or update_next):
                if unit.state in (EVICTING, AWAY):
                    self._fetch(unit)
            elif unit.state in (RESIDENT, FETCHING):
                self._evict(unit)
        # State registered since the last step (the masters before step 1) leaves before this
        # step's forward, not with the next step: resident through step 1, it was the run's
        # peak (measured: +0.4 GB per rank on bench memcap's model). The wait is stall time.
        self._free_now([k for k in self._fresh if k in self.units and self.units[k].state == EVICTING])
        self._fresh.clear()
        windows = self.windows(update_now)
        if windows:
            for key in self._group(windows[0]):
                self._fetch_if_away(key)

    def tier(self, key: Hashable) -> str:
        index = key[0] if isinstance(key, tuple) else key
        return self.tiers[index] if index < len(self.tiers) else "core"

    def streamed(self, key: Hashable) -> bool:
        return (self.stream_on and isinstance(key, tuple) and key[1] in STREAMED_KINDS
                and (self.stream_everything or self.stream_core or self.tier(key) in STREAMED_TIERS))

    def needed(self, key: Hashable, update: bool) -> bool:
        """Resident outside the optimizer step's stream: everything but the stable tier
        between its updates and streamed state."""
        if self.streamed(key):
            return False
        return self.tier(key) != "stable" or update

    def windows(self, update_now: bool) -> List[int]:
        """Units whose streamed state this step's optimizer updates, in the order it updates
        them (unit order)."""
        out: List[int] = []
        for key in self.units:
            if self.streamed(key) and (self.tier(key) != "stable" or update_now) \
                    and key[0] not in out:
                out.append(key[0])
        return out

    def _group(self, window: int) -> List[Hashable]:
        return [k for k in self.units if isinstance(k, tuple) and k[0] == window and self.streamed(k)]

    def ensure(self, update_now: bool) -> None:
        """Before the optimizer reads state: wait for every group this step uses outside the
        stream (the wait is the stall, reported per step) and free what finished evicting."""
        for key, unit in self.units.items():
            if self.needed(key, update_now) and unit.state != RESIDENT:
                self._fetch_if_away(key)
                self._timed_wait(unit)
        self.settle()

    def stream(self, windows: Sequence[int], run: Callable[[int], None]) -> None:
        """Run ``run(unit)`` for each unit in turn with its streamed state resident: the next
        unit's is read back while this one runs, and this one's goes out right after. Before
        unit i+1 runs, unit i-1's write-out is waited for and its memory freed, so at most three
        units' state is allocated at any time (running, arriving, leaving) however far the disk
        lags; a wait for the disk is stall time."""
        groups = {w: self._group(w) for w in windows}
        for i, window in enumerate(windows):
            for key in groups[window]:
                self._fetch_if_away(key)
            for key in groups[window]:
                self._timed_wait(self.units[key])
            if i >= 2:
                self._free_now(groups[windows[i - 2]])
            if i + 1 < len(windows):
                for key in groups[windows[i + 1]]:
                    self._fetch_if_away(key)
            run(window)
            for key in groups[window]:
                self._evict(self.units[key])
        self.settle()

    def _free_now(self, keys: Sequence[Hashable]) -> None:
        """Wait for these groups' evictions and free their storage (counted as stall)."""
        start = time.perf_counter()
        for key in keys:
            unit = self.units[key]
            if unit.state == EVICTING:
                for f in unit.futures:
                    f.result()
                for t in unit.tensors:
                    t.tensor.untyped_storage().resize_(0)
                unit.state, unit.futures = AWAY, []
        self.stall_s += time.perf_counter() - start

    def _fetch_if_away(self, key: Hashable) -> None:
        unit = self.units[key]
        if unit.state in (EVICTING, AWAY):
            self._fetch(unit)

    def _timed_wait(self, unit: _Unit) -> None:
        if unit.state == RESIDENT:
            return
        start = time.perf_counter()
        self._wait(unit)
        self.stall_s += time.perf_counter() - start

    def resident_all(self) -> None:
        """Bring everything back (``close(restore=True)``; a checkpoint does not need it:
        ``prepare_save`` and ``saved_tensor``)."""
        for key, unit in self.units.items():
            self._fetch_if_away(key)
            self._timed_wait(unit)
        self.store.check()

    # ---- checkpoints ---------------------------------------------------------------------
    def prepare_save(self) -> None:
        """Before a checkpoint is written: wait for every move in flight (raising a failed one),
        free what finished evicting and mark what finished arriving, so each group is resident
        or away. Nothing is brought back (``saved_tensor`` reads away state from the store)."""
        self.store.wait_all()
        self.settle()
        for unit in self.units.values():
            if unit.state == FETCHING:
                self._wait(unit)  # landed already: no wait, only the bookkeeping

    def saved_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a checkpoint writes for ``tensor``: the tensor itself when it is not placed or
        its group is resident; else a host tensor of the same dtype and shape with its bytes,
        taken from the store without touching the device (``ChunkStore.host_bytes``: valid
        until the next step moves the group). On CUDA the checkpoint needs host copies anyway
        (megatron's writer copies device tensors to host memory before it writes), so away
        state costs the device nothing and host memory no more than resident state does."""
        known = self._known.get(id(tensor))  # placed tensors are alive: their ids are unique
        if known is None:
            return tensor
        unit = self.units[known[0]]
        if unit.state == RESIDENT:
            return tensor
        placed = next(t for t in unit.tensors if t.tensor is tensor)
        return self.store.host_bytes(placed.ids).view(tensor.dtype).view(tensor.shape)

    def settle(self) -> None:
        """Free the storage of units whose eviction completed; raise a background error."""
        self.store.check()
        for unit in self.units.values():
            if unit.state == EVICTING and all(f.done() for f in unit.futures):
                for f in unit.futures:
                    f.result()  # an eviction that failed leaves the bytes where they were
                for t in unit.tensors:
                    t.tensor.untyped_storage().resize_(0)
                unit.state, unit.futures = AWAY, []

    # ---- moves -------------------------------------------------------------------------
    def _evict(self, unit: _Unit) -> None:
        if unit.state == FETCHING:
            self._wait(unit)  # the bytes must be back before they are copied out again
        unit.futures = [self.store.evict(i, to=self.target) for t in unit.tensors for i in t.ids]
        unit.state = EVICTING

    def _fetch(self, unit: _Unit) -> None:
        if unit.state == AWAY:
            # Allocated on this thread's stream before the prefetch is asked for: the store's
            # copy stream waits for an event recorded after it (offload/copy_stream.py).
            for t in unit.tensors:
                t.tensor.untyped_storage().resize_(t.nbytes)
        # From EVICTING the bytes were never freed; the store runs this move after the
        # eviction of each chunk, so the copy back is of the same bytes.
        unit.futures = [self.store.prefetch(i) for t in unit.tensors for i in t.ids]
        unit.state = FETCHING

    def _wait(self, unit: _Unit) -> None:
        for f in unit.futures:
            f.result()
        unit.futures = []
        unit.state = RESIDENT

    # ---- reporting ---------------------------------------------------------------------
    def resident_bytes(self) -> Dict[str, Dict[str, int]]:
        """Placed bytes per tier and per location: device (resident or on its way back) or
        the target (away, or being evicted: counted where the move goes)."""
        out: Dict[str, Dict[str, int]] = {}
        for key, unit in self.units.items():
            tier = self.tier(key)
            where = "device" if unit.state in (RESIDENT, FETCHING) else self.target
            row = out.setdefault(tier, {"device": 0, self.target: 0})
            row[where] += unit.nbytes
        return out

    def device_bytes(self, key: Hashable) -> int:
        """Bytes of a placed group on the device (resident or on its way back); 0 if unknown."""
        unit = self.units.get(key)
        return unit.nbytes if unit is not None and unit.state in (RESIDENT, FETCHING) else 0

    def step_metrics(self) -> Dict[str, float]:
        """The step's offload figures: bytes each way and their rate, busy time of the copies,
        the stall, the share of copy time hidden behind compute, resident bytes by tier."""
        now = self.store.stats()
        before, self._last_stats = self._last_stats, now
        delta = {d: (now["bytes"][d] - before["bytes"][d], now["seconds"][d] - before["seconds"][d])
                 for d in now["bytes"]}
        out_dirs, in_dirs = ("device_to_cpu", "to_ssd"), ("cpu_to_device", "from_ssd")
        written, read = (sum(delta[d][0] for d in dirs) for dirs in (out_dirs, in_dirs))
        out_s, in_s = (sum(delta[d][1] for d in dirs) for dirs in (out_dirs, in_dirs))
        busy = out_s + in_s
        stall = self.stall_s + sum(kept.stall_s for kept in self._kept())
        rec: Dict[str, float] = {
            "offload_bytes_written": written, "offload_bytes_read": read,
            "offload_io_busy_s": busy, "offload_stall_s": stall,
        }
        for name, kept in (("residuals", self.residuals), ("accumulators", self.accumulators),
                           ("grads", self.grads)):
            if kept is not None:
                # Counted like resident_bytes: a write in flight is where it goes.
                resident = sum(kept.device_bytes_by_key().values())
                rec[f"offload_bytes_{name}_device"] = resident
                rec[f"offload_bytes_{name}_{self.target}"] = kept.placed_bytes() - resident
                rec[f"offload_bytes_{name}_device_at_start"] = kept.resident_at_start
        if out_s > 0:
            rec["offload_write_gbps"] = written / out_s / 1e9
        if in_s > 0:
            rec["offload_read_gbps"] = read / in_s / 1e9
        if busy > 0:
            # Copy time the loop did not wait for; the copies run beside the step's compute.
            rec["offload_hidden_share"] = max(0.0, 1.0 - stall / busy)
        for tier, row in self.resident_bytes().items():
            for where, nbytes in row.items():
                rec[f"offload_bytes_{tier}_{where}"] = nbytes
        return rec

    def _kept(self) -> list:
        """The stores of state read and written every step (residuals, accumulators, gradient
        shards)."""
        return [k for k in (self.residuals, self.accumulators, self.grads) if k is not None]

    def close(self, restore: bool = True) -> None:
        """Bring everything back (``restore``), then close the store (its file is deleted).
        Residuals are not brought back: the run is over and nothing reads them. Without
        ``restore`` (the end of a training run, its last checkpoint written) state that is away
        stays zero bytes: bringing it all back would be the run's peak, for nothing."""
        try:
            if restore:
                self.resident_all()
        finally:
            self.store.close()


def planned_bytes(sizes: Sequence[int], store_chunk_bytes: int) -> int:
    """File bytes to hold tensors of these byte sizes at once (each chunk 4096-aligned)."""
    from .slot_file import align_up

    total = 0
    for n in sizes:
        full, rest = divmod(n, store_chunk_bytes)
        total += full * align_up(store_chunk_bytes) + (align_up(rest) if rest else 0)
    return total

