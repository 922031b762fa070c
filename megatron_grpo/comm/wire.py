"""Count the bytes this rank sends in torch.distributed collectives, from the actual calls.

Every collective that megatron-core (or we) issue goes through a thin wrapper installed over
``torch.distributed``'s functions and over ``torch.distributed._functional_collectives``. The
wrapper reads the real tensors of the call (their element count and dtype) and the real group
size, and adds what this rank puts on the wire under the bandwidth-optimal ring algorithm that
NCCL uses for large messages (P = group size, me = this rank in the group, B = bytes; integer
division, rules in ``wire_rules``):

=====================================  ======================================================
call (torch.distributed)               bytes sent by this rank
=====================================  ======================================================
all_reduce(t)                          2 (P-1)/P * B(t)
all_reduce_coalesced(ts)               sum over t of 2 (P-1)/P * B(t)
reduce(t, dst)                         (P-1)/P * B(t)       (pipelined chain, averaged)
broadcast(t, src)                      (P-1)/P * B(t)       (pipelined chain, averaged)
reduce_scatter_single/_tensor/_base    (P-1) * B(o)         (= (P-1)/P * B(i))
reduce_scatter(o, list)                sum of B(list[j]) for j != me
all_gather_single/_into_tensor/_base   (P-1) * B(i)
all_gather(list, t)                    (P-1) * B(t)
all_gather_coalesced(lists, ts)        (P-1) * B(ts)
all_to_all_single(o, i)                B(i) - B(own chunk)  (even split unless sizes given)
all_to_all(outs, ins)                  sum of B(ins[j]) for j != me
gather(t, list, dst)                   B(t) on non-root ranks, 0 on the root (it receives)
scatter(t, list, src)                  sum of B(list[j]) for j != root on the root, 0 elsewhere
send/isend(t)                          B(t) (0 to oneself)
recv/irecv                             0
batch_isend_irecv, *_object(_list)     the isend/all_gather/gather/broadcast/scatter/send
                                       calls they make, each by its own rule (not wrapped)
barrier, monitored_barrier             not counted (no payload)
=====================================  ======================================================

Functional collectives (counted as ``funcol.<name>``) use the same conventions:
all_reduce(_inplace) 2 (P-1)/P * B; all_reduce_coalesced per tensor; broadcast (P-1)/P * B;
all_gather_single/_tensor (+ _autograd, _inplace, _coalesced), all_gather_inplace (P-1) * B(in);
reduce_scatter_single/_tensor (+ _autograd, _inplace, _coalesced) (P-1)/P * B(in);
all_to_all_single(_autograd), all_to_all_inplace as all_to_all_single; permute_tensor B(in)
unless mapped to itself; isend_inplace B, irecv_inplace 0; batch_p2p_ops_inplace sum of B of the
"isend" entries.

P = 1 sends nothing. Bytes are attributed to the innermost active ``tag`` (e.g. a GRPO tier),
to the operation name and to the link class of the call's group (``by_link``: ``inter_node``
when the group's ranks live on more than one node, else ``intra_node``), so per-tier, per-op
and per-link totals are exact sums of real calls. A group that spans nodes counts all its
bytes as inter-node: the ring runs at the pace of its slowest hop. The node of a rank is
``rank // ranks_per_node`` (torchrun and SLURM place consecutive ranks on a node), with
ranks_per_node from ``MEGATRON_GRPO_RANKS_PER_NODE`` (tests emulating nodes on one machine) or
torchrun's ``LOCAL_WORLD_SIZE``; without either every group is intra-node.
A function that calls another counted one (all_gather_into_tensor -> all_gather_single,
send -> isend, the torch-function re-dispatch under CPU mode) is counted once, by the outermost.

Why wrap instead of estimating: an estimate silently stays right when code changes what it
sends; the counter does not. ``audit()`` (run by ``install()``) fails when this torch has a
collective that is neither counted nor listed in ``wire_rules.NOT_COUNTED``.

Strict device mode (``set_strict(True)`` or ``MEGATRON_GRPO_STRICT_COMM=1``): every tensor handed
to a counted collective must be on the group's communication device (``bind_group_device``, else
one the group's backend serves; meta tensors never). On NCCL a host tensor fails deep inside the
call; CPU-only tests would never see it, so strict mode raises ``CollectiveDeviceError`` before
the call, on the same check on every rank, so no peer is left waiting.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import threading
from collections import defaultdict
from typing import Callable, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_grpo.comm.wire_checks import _device_message, _tensors_in
from megatron_grpo.comm.wire_rules import C10D_RULES, FUNCOL_RULES, NOT_COUNTED, VIA_PRIMITIVES

STRICT_ENV = "MEGATRON_GRPO_STRICT_COMM"
RANKS_PER_NODE_ENV = "MEGATRON_GRPO_RANKS_PER_NODE"
FUNCOL_PREFIX = "funcol."

__all__ = ["WireCounter", "wire_counter", "CollectiveDeviceError", "UncountedCollectiveError",
           "audit", "STRICT_ENV"]


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a collective is not on the device its process group communicates on."""


class UncountedCollectiveError(RuntimeError):
    """This torch has a collective that the counter would silently count as 0 bytes."""


# -- the guard: which torch functions look like collectives --------------------------------------
_COMM_PARAMS = {"group", "group_name", "p2p_op_list"}


def _funcol():
    import torch.distributed._functional_collectives as fc  # imports in ~30 ms; part of torch

    return fc


def _collective_like(module, names) -> List[str]:
    """Names of functions in ``module`` that take a process group or do point-to-point."""
    found = []
    for name in sorted(set(names)):
        fn = getattr(module, name, None)
        if fn is None or not callable(fn) or isinstance(fn, type):
            continue
        try:
            params = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if params & _COMM_PARAMS or re.search("send|recv", name):
            found.append(name)
    return found


def audit() -> List[str]:
    """Collective-like public functions of this torch that are neither counted nor documented as
    sending nothing (``wire_rules.NOT_COUNTED``). Empty on a torch the counter fully covers."""
    fc = _funcol()
    public_dist = set(getattr(c10d, "__all__", ()))
    public_dist |= {n for n in dir(dist) if not n.startswith("_")}
    public_fc = {n for n in dir(fc) if not n.startswith("_")
                 and getattr(getattr(fc, n), "__module__", None) == fc.__name__}
    known = set(C10D_RULES) | set(VIA_PRIMITIVES) | set(NOT_COUNTED)
    missing = [f"torch.distributed.{n}" for n in _collective_like(dist, public_dist)
               if n not in known]
    missing += [f"{fc.__name__}.{n}" for n in _collective_like(fc, public_fc)
                if n not in FUNCOL_RULES and n not in NOT_COUNTED]
    return missing


# -- groups ------------------------------------------------------------------------------------
_DEFAULT = "<default group>"  # binding key of group=None / the WORLD group


def _is_default(group) -> bool:
    return group is None or group is c10d._world.default_pg


def _funcol_group(kw):
    """The ProcessGroup (None = default) of a functional-collective call (PG, name, ranks,
    DeviceMesh or (mesh, dim))."""
    group = kw.get("group", kw.get("group_name"))
    if group is None or group == "":
        return None
    if isinstance(group, c10d.ProcessGroup):
        return group
    if isinstance(group, list):  # ranks + tag (deprecated); resolved without fc's warning
        name = c10d._resolve_group_name_by_ranks_and_tag(group, kw.get("tag", ""))
    else:
        name = _funcol()._resolve_group(group, kw.get("tag", ""))
    return name if isinstance(name, c10d.ProcessGroup) else c10d._resolve_process_group(name)


def ranks_per_node() -> Optional[int]:
    """Ranks per node from MEGATRON_GRPO_RANKS_PER_NODE or torchrun's LOCAL_WORLD_SIZE (None: unknown)."""
    for name in (RANKS_PER_NODE_ENV, "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, "")
        if value.strip():
            try:
                n = int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} must be a positive integer (ranks per node)") from None
            if n <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer (ranks per node)")
            return n
    return None


def _c10d_group(kw):
    return kw.get("group")


def _served_types(pg) -> Optional[frozenset]:
    """Device types the group's backend(s) accept (None: unknown, accept anything)."""
    try:
        return frozenset(d.type for d in pg._device_types)
    except Exception:
        pass
    try:  # e.g. "cpu:gloo,cuda:nccl"
        config = dist.get_backend_config(pg).split(",")
        return frozenset(p.split(":")[0] for p in config if ":" in p) or None
    except Exception:
        return None


def _param_names(fn) -> List[str]:
    try:
        return [n for n, p in inspect.signature(fn).parameters.items()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


class WireCounter:
    """Process-wide byte counter. Use ``install()`` once, then read/reset per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.by_tag: Dict[str, int] = defaultdict(int)
        self.by_op: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)
        self.by_link: Dict[str, int] = defaultdict(int)
        self._link_of: Dict[object, str] = {}  # resolved group -> link class (cached)
        self._originals: Dict[str, Callable] = {}
        self._strict = False
        self._strict_set = False  # set_strict() wins over the environment
        self._bound: Dict[object, torch.device] = {}
        self._expect: Dict[object, tuple] = {}  # resolved group -> (bound, served, name)

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

    def record(self, op: str, nbytes: int, group=None) -> None:
        stack = self._stack()
        tag = stack[-1] if stack else "untagged"
        link = self.link(group)
        with self._lock:
            self.by_tag[tag] += nbytes
            self.by_op[op] += nbytes
            self.by_link[link] += nbytes
            self.calls[op] += 1

    def link(self, group) -> str:
        """``inter_node`` when ``group`` (None: the default group) spans nodes, else
        ``intra_node`` (see the module docstring)."""
        key = _DEFAULT if _is_default(group) else group
        cached = self._link_of.get(key)
        if cached is not None:
            return cached
        per_node = ranks_per_node()
        link = "intra_node"
        if per_node and dist.is_initialized():
            try:
                ranks = dist.get_process_group_ranks(None if key is _DEFAULT else group)
            except (ValueError, RuntimeError, TypeError):  # not a group this rank can name
                ranks = []
            if len({r // per_node for r in ranks}) > 1:
                link = "inter_node"
        self._link_of[key] = link
        return link

    # -- reading -----------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def snapshot(self) -> dict:
        with self._lock:
            return {"total": sum(self.by_op.values()), "by_tag": dict(self.by_tag),
                    "by_op": dict(self.by_op), "calls": dict(self.calls),
                    "by_link": dict(self.by_link)}

    def reset(self) -> dict:
        """Return the counts so far and start from zero."""
        with self._lock:
            snap = {"total": sum(self.by_op.values()), "by_tag": dict(self.by_tag),
                    "by_op": dict(self.by_op), "calls": dict(self.calls),
                    "by_link": dict(self.by_link)}
            self.by_link.clear()
            self.by_tag.clear()
            self.by_op.clear()
            self.calls.clear()
        return snap

    # -- strict device mode ------------------------------------------------------------------
    @property
    def strict(self) -> bool:
        return self._strict

    def set_strict(self, flag: bool) -> None:
        """Check every tensor of every counted collective against its group's device (overrides
        ``MEGATRON_GRPO_STRICT_COMM``). Off by default; never changes the byte counts."""
        self._strict = bool(flag)
        self._strict_set = True

    def bind_group_device(self, group, device: Union[str, int, torch.device, None]) -> None:
        """Collectives over ``group`` (None: the default group) must use ``device`` (None:
        unbind, fall back to the devices the group's backend serves)."""
        key = _DEFAULT if _is_default(group) else group
        if device is None:
            self._bound.pop(key, None)
        else:
            self._bound[key] = torch.device(device)
        self._expect.clear()

    def _expected(self, group) -> tuple:
        pg = c10d._world.default_pg if group is None else group
        hit = self._expect.get(pg)
        if hit is None:
            default = _is_default(pg)
            bound = self._bound.get(_DEFAULT if default else pg)
            served = None if pg is None else _served_types(pg)
            name = "the default group" if default else f"group {getattr(pg, 'group_name', pg)!r}"
            hit = self._expect[pg] = (bound, served, name)
        return hit

    def _check(self, op: str, kw: dict, group) -> None:
        """Raise CollectiveDeviceError for the first tensor of the call that is off-device."""
        if group is not None and group == c10d.GroupMember.NON_GROUP_MEMBER:
            return  # torch returns without communicating
        expected = None
        for arg, value in kw.items():
            if isinstance(value, torch.Tensor):
                items = ((arg, value),)
            elif isinstance(value, (list, tuple)) and value:
                items = _tensors_in(arg, value)
            else:
                continue
            for name, t in items:
                if expected is None:
                    expected = self._expected(group)
                bound, served, _ = expected
                dev = t.device
                if dev.type == "meta":
                    bad = True
                elif bound is not None:
                    bad = dev.type != bound.type or (bound.index is not None
                                                     and dev.index != bound.index)
                else:
                    bad = served is not None and dev.type not in served
                if bad:
                    raise CollectiveDeviceError(_device_message(op, name, dev, expected))

    def _check_p2p_ops(self, ops) -> None:
        """batch_isend_irecv: check every P2POp before the first is posted (a later bad one
        would leave the peer waiting on the earlier ones)."""
        for i, p2p in enumerate(ops or ()):
            self._check("batch_isend_irecv", {f"p2p_op_list[{i}].tensor": p2p.tensor}, p2p.group)

    # -- installation ------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap torch.distributed's collectives and the functional collectives (idempotent).

        Raises UncountedCollectiveError (before changing anything) when ``audit()`` finds a
        collective this module does not know. Reads ``MEGATRON_GRPO_STRICT_COMM`` unless
        ``set_strict`` was called.

        Megatron binds some functions at import time (``dist_reduce_scatter_func`` in
        param_and_grad_buffer), so module-level references to the originals in already
        imported ``megatron``/``megatron_grpo`` modules are rebound too. Wrappers are also put
        into ``distributed_c10d`` so ``P2POp``'s check (``op in [isend, irecv]``) accepts them,
        and so the functions torch builds on the primitives (object collectives,
        batch_isend_irecv, all_gather_into_tensor -> all_gather_single) reach them.
        """
        import sys

        if not self._strict_set:
            self._strict = os.environ.get(STRICT_ENV, "") not in ("", "0")
        global _AUDITED
        if not _AUDITED:
            missing = audit()
            if missing:
                raise UncountedCollectiveError(
                    "torch.distributed has collectives the wire counter does not count (they "
                    "would silently count 0 bytes): " + ", ".join(missing) + ". Add a rule in "
                    "megatron_grpo/comm/wire_rules.py (or list it in NOT_COUNTED with the reason).")
            _AUDITED = True

        fc = _funcol()
        replaced = {}
        for name, rule in C10D_RULES.items():
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None or getattr(original, "_wire_counted", False):
                continue
            wrapper = self._wrap(name, original, rule, _c10d_group)
            self._originals[name] = original
            replaced[id(original)] = wrapper
            if hasattr(c10d, name):
                setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        batch = getattr(c10d, "batch_isend_irecv", None)
        if batch is not None and not getattr(batch, "_wire_counted", False):
            wrapper = self._wrap_batch(batch)
            self._originals["batch_isend_irecv"] = batch
            replaced[id(batch)] = wrapper
            c10d.batch_isend_irecv = dist.batch_isend_irecv = wrapper
        for name, rule in FUNCOL_RULES.items():
            original = getattr(fc, name, None)
            if original is None or getattr(original, "_wire_counted", False):
                continue
            wrapper = self._wrap(FUNCOL_PREFIX + name, original, rule, _funcol_group)
            self._originals[FUNCOL_PREFIX + name] = original
            replaced[id(original)] = wrapper
            setattr(fc, name, wrapper)
        if not replaced:
            return
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith("megatron"):  # megatron and megatron_grpo
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and id(value) in replaced:
                    setattr(mod, attr, replaced[id(value)])

    def _wrap(self, op: str, original: Callable, rule: Callable, resolve: Callable) -> Callable:
        counter = self
        local = self._local
        params = _param_names(original)

        def wrapper(*args, **kwargs):
            # A collective can re-enter its public function (torch-function dispatch, e.g.
            # under CPU mode's TorchFunctionMode) or call another one (all_gather_into_tensor
            # -> all_gather_single, send -> isend, funcol *_inplace -> funcol op): count the
            # outermost call only.
            if getattr(local, "inside", False):
                return original(*args, **kwargs)
            kw = dict(zip(params, args))
            if kwargs:
                kw.update(kwargs)
            group = resolve(kw)
            if counter._strict:  # before the call: nothing reaches the backend
                counter._check(op, kw, group)
            counter.record(op, int(rule(kw, group)), group)
            local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = False

        return _mark(wrapper, op, original)

    def _wrap_batch(self, original: Callable) -> Callable:
        # Check-only: the isend/irecv calls it makes are counted by their own wrappers.
        counter = self

        def batch_isend_irecv(p2p_op_list):
            if counter._strict:
                counter._check_p2p_ops(p2p_op_list)
            return original(p2p_op_list)

        return _mark(batch_isend_irecv, "batch_isend_irecv", original)


def _mark(wrapper, name, original):
    wrapper.__name__ = name.split(".")[-1]
    wrapper.__qualname__ = wrapper.__name__
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original
    wrapper._wire_counted = True
    return wrapper


_AUDITED = False
_COUNTER: Optional[WireCounter] = None


def wire_counter() -> WireCounter:
    """The process-wide counter, installed on first use."""
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = WireCounter()
    _COUNTER.install()
    return _COUNTER
