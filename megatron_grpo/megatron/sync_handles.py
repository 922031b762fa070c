"""What GRPOBucketGroup's ``grad_reduce_handle`` holds, and which stream finishes a compressed sync.

``finish_grad_sync`` and the in-flight window (``GRPOBucketGroup._in_flight``) call
``grad_reduce_handle.wait()`` on the main stream. For the compressed collectives GRPO issues
itself (comm/dynamic.py, powersgd.py, hierarchical.py) that wait issues the decode on GRPO's
side stream, the stream the collective was issued on, and makes the main stream wait on the
"decoded" event (``streams.CommOrder``). Such a handle then ``joins_side_stream``: the last
event the main stream waited on was recorded on the side stream after everything the unit
queued there, so the group need not join the side stream again.
"""

from __future__ import annotations

from typing import Optional

from megatron_grpo.comm.streams import CommOrder
from megatron_grpo.megatron import compat


class Completed:
    """Handle of a sync that needed no communication (or ran synchronously)."""

    joins_side_stream = False

    def wait(self) -> None:
        pass


class Handles:
    """The in-flight syncs of a group's buckets, waited for in issue order."""

    def __init__(self, handles) -> None:
        self.handles = handles
        # Only GRPO's compressed syncs finish through a CommOrder; torch's own work handles
        # (periodic tiers' reduce-scatters) make the waiting stream wait for the collective
        # alone, not for the side stream's other work.
        self.joins_side_stream = bool(handles) and all(
            getattr(h, "order", None) is not None for h in handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


def comm_order(ctrl) -> Optional[CommOrder]:
    """Where the controller's compressed syncs finish: its side stream (GPU, or the CPU tests'
    stream double); None without one (CPU: the caller's own stream, as on the host)."""
    if ctrl.side_stream is None:
        return None
    return CommOrder(ctrl.side_stream, ctrl.stream_context, ctrl.current_stream)


def wait_for_grad_sync(group) -> None:
    """Wait for a GRPOBucketGroup's ``grad_reduce_handle`` (whichever its tier produced), timed
    as the wait for communication (RU); afterwards the main stream may read and free the unit's
    gradients and everything the side stream made for it."""
    handle = group.grad_reduce_handle
    joined = getattr(handle, "joins_side_stream", False)  # megatron's own handles: no
    with group.grpo.wait_timer():
        handle.wait()
        if not joined and group._hierarchical and getattr(group, "communication_stream", None) is not None:
            # megatron's hierarchical sync ran on its communication stream (GPU; a no-op
            # stand-in on CPU): its finish_grad_sync waits for that stream, not a handle.
            compat.grad_sync_wait_stream().wait_stream(group.communication_stream)
    if not joined:
        # importance, held gradients, and any side-stream work no decoded event covers
        group.grpo.join_side_stream()
