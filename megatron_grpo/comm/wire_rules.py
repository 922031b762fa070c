"""Per-call byte rules for :mod:`megatron_grpo.comm.wire` (the table is in wire's docstring).

A rule is ``rule(kw, group) -> bytes this rank sends``: ``kw`` maps the wrapped function's
parameter names to the call's arguments (positional ones bound by name, so one rule serves every
call style), ``group`` is the call's process group already resolved (``None`` = default group).

Three tables:

* ``C10D_RULES``: primitives of ``torch.distributed`` (each issues exactly one backend call);
* ``VIA_PRIMITIVES``: functions built on those primitives (object collectives,
  ``batch_isend_irecv``). They get no formula and no wrapper: the primitives they issue are
  counted, so their bytes are exact (size exchange and pickle padding included) and counted once;
* ``FUNCOL_RULES``: ``torch.distributed._functional_collectives``, which go straight to the
  ``_c10d_functional`` C++ ops and never pass through the ``torch.distributed`` functions.

``NOT_COUNTED`` lists, with the reason, every collective-looking function that is deliberately
not counted. ``wire.audit()`` fails on any function in neither list, so a torch upgrade that adds
a collective is caught instead of silently counting 0.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.distributed.distributed_c10d as c10d

Rule = Callable[[dict, Optional[object]], int]


def nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    return 0


def group_size(group) -> int:
    try:
        if group is not None and group == c10d.GroupMember.NON_GROUP_MEMBER:
            return 0
        return c10d.get_world_size(group)  # -1 when this rank is not a member
    except Exception:  # not initialised: nothing is sent by us
        return 0


def group_rank(group) -> int:
    try:
        return c10d.get_rank(group)
    except Exception:
        return 0


def _root(kw, group, glob: str, local: str) -> int:
    """The root's rank in ``group`` from a global (``dst``) or group (``group_dst``) rank."""
    if kw.get(local) is not None:
        return kw[local]
    root = kw.get(glob)
    if root is None:
        return 0  # torch's default for gather/scatter: global rank 0
    if group is None or group == c10d.GroupMember.WORLD:
        return root
    return c10d.get_group_rank(group, root)


def _others(tensors, me: int) -> int:
    """Bytes of the list entries destined for the other ranks (entry j goes to rank j)."""
    return sum(nbytes(t) for j, t in enumerate(tensors or ()) if j != me)


def _a2a_single(inp, splits, group, p) -> int:
    """Input bytes minus the chunk this rank keeps (even split unless ``splits`` given)."""
    total = nbytes(inp)
    if splits:
        row = total // max(inp.shape[0], 1) if inp.dim() else total
        return total - int(splits[group_rank(group)]) * row
    return total - total // p


# -- generic formulas: fn(p, bytes) -----------------------------------------------------------
def _ring_allreduce(p, b):
    return (2 * (p - 1) * b) // p


def _ring_half(p, b):  # broadcast / reduce (pipelined chain, averaged) / reduce-scatter by input
    return ((p - 1) * b) // p


def _gather_ring(p, b):  # all-gather of b bytes per rank
    return (p - 1) * b


def _on(arg: str, formula, per_tensor: bool = False) -> Rule:
    """Rule applying ``formula(P, B)`` to argument ``arg`` (summed per tensor for lists)."""

    def rule(kw, group):
        p = group_size(group)
        if p <= 1:
            return 0
        value = kw.get(arg)
        if per_tensor and isinstance(value, (list, tuple)):
            return sum(formula(p, nbytes(t)) for t in value)
        return formula(p, nbytes(value))

    return rule


# -- c10d primitives with their own shape ----------------------------------------------------
def _list_to_others(arg: str) -> Rule:
    def rule(kw, group):
        return 0 if group_size(group) <= 1 else _others(kw.get(arg), group_rank(group))
    return rule


def _a2a_single_rule(inp: str) -> Rule:
    def rule(kw, group):
        p = group_size(group)
        return 0 if p <= 1 else _a2a_single(kw.get(inp), kw.get("input_split_sizes"), group, p)
    return rule


def _gather(kw, group):
    # Every non-root rank sends its tensor straight to the root; the root only receives.
    if group_size(group) <= 1:
        return 0
    root = _root(kw, group, "dst", "group_dst")
    return 0 if group_rank(group) == root else nbytes(kw.get("tensor"))


def _scatter(kw, group):
    # The root sends entry j of scatter_list to rank j; the others only receive.
    if group_size(group) <= 1:
        return 0
    root = _root(kw, group, "src", "group_src")
    return _others(kw.get("scatter_list"), root) if group_rank(group) == root else 0


def _send(kw, group):
    if group_size(group) <= 1:
        return 0
    # isend to oneself is legal and never leaves the process.
    peer = _root(kw, group, "dst", "group_dst")
    return 0 if peer == group_rank(group) else nbytes(kw.get("tensor"))


def _nothing(kw, group):  # receives
    return 0


C10D_RULES: Dict[str, Rule] = {
    "all_reduce": _on("tensor", _ring_allreduce),
    "all_reduce_coalesced": _on("tensors", _ring_allreduce, per_tensor=True),
    "reduce": _on("tensor", _ring_half),
    "broadcast": _on("tensor", _ring_half),
    "all_gather": _on("tensor", _gather_ring),
    "all_gather_single": _on("input_tensor", _gather_ring),
    "all_gather_into_tensor": _on("input_tensor", _gather_ring),
    "_all_gather_base": _on("input_tensor", _gather_ring),
    "all_gather_coalesced": _on("input_tensor_list", _gather_ring),
    "reduce_scatter": _list_to_others("input_list"),
    # (P-1) * B(output): each rank's input is P output-sized chunks, P-1 of them leave.
    "reduce_scatter_single": _on("output", _gather_ring),
    "reduce_scatter_tensor": _on("output", _gather_ring),
    "_reduce_scatter_base": _on("output", _gather_ring),
    "all_to_all_single": _a2a_single_rule("input"),
    "all_to_all": _list_to_others("input_tensor_list"),
    "gather": _gather,
    "scatter": _scatter,
    "send": _send,
    "isend": _send,
    "recv": _nothing,
    "irecv": _nothing,
}

# Built on the primitives above (which they look up as module globals of distributed_c10d, so
# they reach our wrappers): already counted exactly once, per primitive and under its name (an
# all_gather_object shows as two all_gathers: sizes, then the padded pickles). Not wrapped:
# wrapping them too would count their bytes twice or hide the primitives from per-op figures.
VIA_PRIMITIVES: Dict[str, str] = {
    "batch_isend_irecv": "isend / irecv (one per P2POp)",
    "all_gather_object": "all_gather(sizes) + all_gather(pickles)",
    "gather_object": "all_gather(sizes) + gather(pickles)",
    "broadcast_object_list": "broadcast(sizes) + broadcast(pickles)",
    "scatter_object_list": "broadcast(max size) + scatter(pickles) + scatter(sizes)",
    "send_object_list": "send or batch_isend_irecv, of sizes then pickles",
    "recv_object_list": "recv or batch_isend_irecv (sends nothing)",
}


# -- functional collectives --------------------------------------------------------------------
def _permute(kw, group):
    if group_size(group) <= 1:
        return 0
    me = group_rank(group)
    return 0 if kw["src_dst"][me] == me else nbytes(kw.get("self"))


def _batch_p2p(kw, group):
    if group_size(group) <= 1:
        return 0
    return sum(nbytes(t) for op, t in zip(kw["op_list"], kw["tensors"]) if op == "isend")


def _funcol_isend(kw, group):
    if group_size(group) <= 1:
        return 0
    local = kw.get("group_dst", -1)
    to_self = (local == group_rank(group)) if local not in (None, -1) \
        else kw.get("dst") == c10d.get_rank()  # dst is a global rank here
    return 0 if to_self else nbytes(kw.get("tensor"))


FUNCOL_RULES: Dict[str, Rule] = {
    "all_reduce": _on("self", _ring_allreduce),
    "all_reduce_inplace": _on("tensor", _ring_allreduce),
    "all_reduce_coalesced": _on("self", _ring_allreduce, per_tensor=True),
    "broadcast": _on("self", _ring_half),
    "all_gather_single": _on("self", _gather_ring),
    "all_gather_single_autograd": _on("self", _gather_ring),
    "all_gather_tensor": _on("self", _gather_ring),
    "all_gather_tensor_autograd": _on("self", _gather_ring),
    "all_gather_tensor_inplace": _on("input_tensor", _gather_ring),
    "all_gather_inplace": _on("tensor", _gather_ring),
    "all_gather_single_coalesced": _on("self", _gather_ring),
    "all_gather_into_tensor_coalesced": _on("self", _gather_ring),
    # Only the input is an argument here: (P-1)/P * B(input) = (P-1) * B(output).
    "reduce_scatter_single": _on("self", _ring_half),
    "reduce_scatter_single_autograd": _on("self", _ring_half),
    "reduce_scatter_tensor": _on("self", _ring_half),
    "reduce_scatter_tensor_autograd": _on("self", _ring_half),
    "reduce_scatter_tensor_inplace": _on("input", _ring_half),
    "reduce_scatter_single_coalesced": _on("inputs", _ring_half, per_tensor=True),
    "reduce_scatter_tensor_coalesced": _on("inputs", _ring_half, per_tensor=True),
    "all_to_all_single": _a2a_single_rule("self"),
    "all_to_all_single_autograd": _a2a_single_rule("self"),
    "all_to_all_inplace": _a2a_single_rule("input"),
    "permute_tensor": _permute,
    "isend_inplace": _funcol_isend,
    "irecv_inplace": _nothing,
    "batch_p2p_ops_inplace": _batch_p2p,
}


NOT_COUNTED: Dict[str, str] = {
    # Synchronisation only: a few bytes of control traffic, no payload of ours.
    "barrier": "synchronisation, no payload",
    "monitored_barrier": "synchronisation (store based), no payload",
    # Group management / queries: take a group argument but communicate no tensors (setting
    # up communicators goes through the store, not the collective path).
    "init_process_group": "group setup",
    "destroy_process_group": "group teardown",
    "new_subgroups": "group setup",
    "shrink_group": "group setup",
    "split_group": "group setup",
    "get_backend": "query",
    "get_backend_config": "query",
    "get_global_rank": "query",
    "get_group_rank": "query",
    "get_process_group_ranks": "query",
    "get_rank": "query",
    "get_world_size": "query",
}
