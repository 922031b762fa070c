"""Count the bytes this rank sends in torch.distributed collectives, from the actual calls.

Every collective that megatron-core (or we) issue goes through a thin wrapper installed over
``torch.distributed``'s functions. The wrapper reads the real tensors of the call (their
element count and dtype) and the real group size, and adds what this rank puts on the wire
under the bandwidth-optimal ring algorithm that NCCL uses for large messages:

==========================  =====================================================
call                        bytes sent by this rank (P = group size, B = bytes)
==========================  =====================================================
all_reduce(t)               2 (P-1)/P * B(t)
reduce_scatter_tensor(o,i)  (P-1) * B(o)          (= (P-1)/P * B(i))
all_gather_into_tensor(o,i) (P-1) * B(i)
all_gather(list, t)         (P-1) * B(t)
reduce_scatter(o, list)     sum of B(list[j]) for j != own rank
all_to_all_single(o, i)     B(i) - B(own chunk)   (even split unless sizes given)
broadcast(t)                (P-1)/P * B(t)        (pipelined ring, averaged)
send/isend(t)               B(t)
==========================  =====================================================

P = 1 sends nothing. Bytes are attributed to the innermost active ``tag`` (e.g. a GRPO tier)
and to the operation name, so per-tier and per-op totals are exact sums of real calls.

Why wrap instead of estimating: an estimate silently stays right when code changes what it
sends; the counter does not.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _group_size(group) -> int:
    try:
        if group is not None and group == c10d.GroupMember.NON_GROUP_MEMBER:
            return 0
        return c10d.get_world_size(group)
    except Exception:  # not initialised, or not a member: nothing is sent by us
        return 0


def _group_rank(group) -> int:
    try:
        return c10d.get_rank(group)
    except Exception:
        return 0


def _arg(args, kwargs, index, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


# Each rule: (args, kwargs) -> bytes this rank sends.
def _all_reduce(a, k):
    p = _group_size(_arg(a, k, 2, "group"))
    return 0 if p <= 1 else (2 * (p - 1) * _nbytes(_arg(a, k, 0, "tensor"))) // p


def _reduce_scatter_tensor(a, k):
    p = _group_size(_arg(a, k, 3, "group"))
    return 0 if p <= 1 else (p - 1) * _nbytes(_arg(a, k, 0, "output"))


def _all_gather_into_tensor(a, k):
    p = _group_size(_arg(a, k, 2, "group"))
    return 0 if p <= 1 else (p - 1) * _nbytes(_arg(a, k, 1, "input_tensor"))


def _all_gather(a, k):
    p = _group_size(_arg(a, k, 2, "group"))
    return 0 if p <= 1 else (p - 1) * _nbytes(_arg(a, k, 1, "tensor"))


def _reduce_scatter(a, k):
    group = _arg(a, k, 3, "group")
    p = _group_size(group)
    if p <= 1:
        return 0
    inputs = list(_arg(a, k, 1, "input_list"))
    me = _group_rank(group)
    return sum(_nbytes(t) for j, t in enumerate(inputs) if j != me)


def _all_to_all_single(a, k):
    group = _arg(a, k, 4, "group")
    p = _group_size(group)
    if p <= 1:
        return 0
    inp = _arg(a, k, 1, "input")
    splits = _arg(a, k, 3, "input_split_sizes")
    total = _nbytes(inp)
    if splits:
        row = total // max(inp.shape[0], 1)
        return total - splits[_group_rank(group)] * row
    return total - total // p


def _broadcast(a, k):
    p = _group_size(_arg(a, k, 2, "group"))
    return 0 if p <= 1 else ((p - 1) * _nbytes(_arg(a, k, 0, "tensor"))) // p


def _send(a, k):
    return 0 if _group_size(_arg(a, k, 2, "group")) == 0 else _nbytes(_arg(a, k, 0, "tensor"))


_RULES: Dict[str, Callable] = {
    "all_reduce": _all_reduce,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "_reduce_scatter_base": _reduce_scatter_tensor,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "_all_gather_base": _all_gather_into_tensor,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all_single": _all_to_all_single,
    "broadcast": _broadcast,
    "send": _send,
    "isend": _send,
}


class WireCounter:
    """Process-wide byte counter. Use ``install()`` once, then read/reset per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.by_tag: Dict[str, int] = defaultdict(int)
        self.by_op: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)
        self._originals: Dict[str, Callable] = {}

    # -- attribution -------------------------------------------------------------------------
    @contextlib.contextmanager
    def tag(self, name: str) -> Iterator[None]:
        """Attribute the bytes of collectives issued inside this block to ``name``."""
        stack = self._stack()
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()

    def _stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def record(self, op: str, nbytes: int) -> None:
        stack = self._stack()
        tag = stack[-1] if stack else "untagged"
        with self._lock:
            self.by_tag[tag] += nbytes
            self.by_op[op] += nbytes
            self.calls[op] += 1

    # -- reading -----------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def snapshot(self) -> dict:
        with self._lock:
            return {"total": sum(self.by_op.values()), "by_tag": dict(self.by_tag),
                    "by_op": dict(self.by_op), "calls": dict(self.calls)}

    def reset(self) -> dict:
        """Return the counts so far and start from zero."""
        with self._lock:
            snap = {"total": sum(self.by_op.values()), "by_tag": dict(self.by_tag),
                    "by_op": dict(self.by_op), "calls": dict(self.calls)}
            self.by_tag.clear()
            self.by_op.clear()
            self.calls.clear()
        return snap

    # -- installation ------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap torch.distributed's collectives (idempotent).

        Megatron binds some functions at import time (``dist_reduce_scatter_func`` in
        param_and_grad_buffer), so module-level references to the originals in already
        imported ``megatron``/``megatron_grpo`` modules are rebound too. Wrappers are also put
        into ``distributed_c10d`` so ``P2POp``'s check (``op in [isend, irecv]``) accepts them.
        """
        import sys

        replaced = {}
        for name, rule in _RULES.items():
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None or getattr(original, "_wire_counted", False):
                continue
            wrapper = self._wrap(name, original, rule)
            self._originals[name] = original
            replaced[id(original)] = wrapper
            if hasattr(c10d, name):
                setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        if not replaced:
            return
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(("megatron", "megatron_grpo")):
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and id(value) in replaced:
                    setattr(mod, attr, replaced[id(value)])

    def _wrap(self, name: str, original: Callable, rule: Callable) -> Callable:
        counter = self

        def wrapper(*args, **kwargs):
            # A collective can re-enter its public function (torch-function dispatch, e.g.
            # under CPU mode's TorchFunctionMode): count the outermost call only.
            local = counter._local
            if getattr(local, "inside", False):
                return original(*args, **kwargs)
            counter.record(name, int(rule(args, kwargs)))
            local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = False

        wrapper.__name__ = name
        wrapper.__qualname__ = name
        wrapper.__wrapped__ = original
        wrapper._wire_counted = True
        return wrapper


_COUNTER: Optional[WireCounter] = None


def wire_counter() -> WireCounter:
    """The process-wide counter, installed on first use."""
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = WireCounter()
    _COUNTER.install()
    return _COUNTER
