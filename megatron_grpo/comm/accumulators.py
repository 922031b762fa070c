"""DelayedAccumulators: the local gradient sums of --grpo-stable-mode delayed, one per stable bucket.

Between its updates a delayed stable unit sends nothing. Each applied step adds the bucket's
scaled gradient into its accumulator (``commit``, at the controller's end_step, so a skipped step
leaves it as it was). At the unit's update step the megatron glue reads it in backward
(``take``), syncs the mean gradient of the steps since the last update, and ``release``s it;
once that step is applied the sum starts again from zero.

Where they live: a dict of device tensors by default. With the memory tier
(--grpo-offload cpu|ssd) the glue hands ``use_store`` an OffloadedResiduals of the chunk store
(offload/residuals.py: read back a few ahead in the order of the last step's reads, written out
right after the add). An accumulator is then resident only around its two uses:

* end of an applied step: read back, the held gradient added, written out again;
* the update step's backward: read back and released after the add into the gradient. The
  file keeps it meanwhile, so a skipped update step loses nothing.

With a store the emptied accumulator of an updated unit keeps its registration (count 0, its
bytes stale and never read): the next step writes it anew in place rather than registering a new
tensor with the store at every update.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterator, List, Optional, Tuple

import torch

from megatron_grpo.comm import streams


class DelayedAccumulators:
    """Accumulators keyed like the error-feedback residuals: (unit, bucket index in its group)."""

    def __init__(self) -> None:
        self._tensors = {}  # key -> tensor: a dict, or the memory tier's store mapping
        self._store = None
        self.counts: Dict[Hashable, int] = {}  # steps summed; 0: empty (stale bytes in the store)
        self._held: Dict[Hashable, torch.Tensor] = {}
        self._used: set = set()

    def use_store(self, store) -> None:
        """Keep accumulators in ``store`` (OffloadedResiduals); the current ones move into it."""
        for key, value in list(self._tensors.items()):
            store[key] = value
        self._tensors, self._store = store, store

    # ------------------------------------------------------------------ one step
    def hold(self, key: Hashable, grad: torch.Tensor,
             local: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """A delayed stable bucket's scaled gradient of this step, added at ``commit``.

        ``local``: (indices, values) of elements whose value *now* is the one to sum, because
        ``grad`` is read at commit and something rewrites those elements in place before then:
        megatron's ``finalize_model_grads`` all-reduces sequence-parallel layernorm grads over
        tensor-parallel ranks, and the tied embedding over pipeline stages, after the
        data-parallel sync. Summing the all-reduced values would make the update step's sync,
        which finalize all-reduces again, count them once per model-parallel copy."""
        self._held[key] = (grad, local)

    def held(self) -> List[torch.Tensor]:
        """This step's held gradients (the optimizer's non-finite check covers them)."""
        return [grad for grad, _ in self._held.values()]

    def take(self, key: Hashable) -> Optional[Tuple[torch.Tensor, int]]:
        """(sum of scaled gradients, steps summed) of ``key`` for its update step, resident
        until ``release``; None when nothing was summed. Dropped when the step is applied."""
        if not self.counts.get(key):
            return None
        self._used.add(key)
        return self._tensors.get(key), self.counts[key]

    def release(self, key: Hashable) -> None:
        """The update read ``key`` (on GRPO's side stream on GPU: the use is recorded so the
        allocator does not hand the block on before the add ran, comm/streams.py)."""
        if self._store is None or key not in self._tensors:
            return
        tensor = self._tensors.get(key)
        streams.used_on_current_stream(tensor)
        self._store.release(key)

    def commit(self) -> None:
        """The step was applied: the accumulators its updates read are emptied, and the held
        gradients are added into theirs."""
        for key in self._used:
            self._empty(key)
        self._used.clear()
        for key, (grad, local) in self._held.items():
            count = self.counts.get(key, 0)
            if self._store is None:
                if count:
                    acc = self._tensors[key]
                    _add_held(acc, grad, local)
                else:
                    acc = self._tensors[key] = grad.detach().clone()
                    _put_local(acc, local)
            else:
                if count:
                    acc = self._store.get(key)
                    acc = self._store.buffer(key, acc)  # the same tensor, now to be written anew
                    _add_held(acc, grad, local)
                else:  # a new one, or the emptied one's registered bytes overwritten
                    acc = self._store.buffer(key, grad)
                    acc.copy_(grad)
                    _put_local(acc, local)
                self._store[key] = acc  # written out in the background
            self.counts[key] = count + 1
        self._held.clear()

    def discard(self) -> None:
        """The step was skipped: every accumulator stays as it was."""
        self._used.clear()
        self._held.clear()

    def drop(self, key: Hashable) -> None:
        """The bucket left the stable tier (re-tiering follows an update, so it is empty)."""
        self.counts.pop(key, None)
        if key in self._tensors:
            del self._tensors[key]

    def _empty(self, key: Hashable) -> None:
        if self._store is None:
            self.drop(key)
        else:
            self.counts[key] = 0

    # ------------------------------------------------------------------ reading
    def keys(self) -> List[Hashable]:
        """Keys with a sum (count > 0), sorted."""
        return sorted(k for k, n in self.counts.items() if n)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __getitem__(self, key: Hashable) -> Tuple[torch.Tensor, int]:
        """(sum, count) of a live key (read back from the store if it is away)."""
        if not self.counts.get(key):
            raise KeyError(key)
        return self._tensors.get(key), self.counts[key]

    def nbytes(self) -> int:
        """Bytes of accumulators resident on the device now."""
        if self._store is not None:
            return self._store.nbytes()
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def device_bytes_by_key(self) -> Dict[Hashable, int]:
        """Bytes per key on the device (a store's own count: a write in flight is away)."""
        if self._store is not None:
            return self._store.device_bytes_by_key()
        return {k: t.numel() * t.element_size() for k, t in self._tensors.items()}

    def placed_bytes(self) -> int:
        """Bytes of all accumulators wherever they are (with a store: registered ones too)."""
        if self._store is not None:
            return self._store.placed_bytes()
        return self.nbytes()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict:
        """{key: (sum on the CPU, count)} of the live keys; a store's are released after."""
        out = {}
        for key in self.keys():
            out[key] = (self._tensors.get(key).detach().cpu().clone(), self.counts[key])
            if self._store is not None:
                self._store.release(key)
        return out

    def load_state_dict(self, state: Dict, device: torch.device) -> None:
        """Replace every accumulator by the saved ones (a checkpoint's rank state)."""
        for key in list(self.counts):
            self.drop(key)
        self._used.clear()
        self._held.clear()
        for key, (tensor, count) in state.items():
            self.counts[key] = int(count)
            # A copy: a store frees the storage it registers once written out.
            self._tensors[key] = tensor.to(device, copy=True)


def _put_local(acc: torch.Tensor, local) -> None:
    """The held-time values of the ``local`` elements replace what ``acc`` has there."""
    if local is not None:
        index, values = local
        acc.index_copy_(0, index, values)


def _add_held(acc: torch.Tensor, grad: torch.Tensor, local) -> None:
    """acc += grad, with the held-time values for the ``local`` elements (each element gets
    one addition, so the sums are bit for bit those of adding a clean local gradient)."""
    if local is None:
        acc.add_(grad)
        return
    index, values = local
    before = acc.index_select(0, index)
    acc.add_(grad)
    acc.index_copy_(0, index, before.add_(values))
