"""A compressed sync finishes on the stream its collective was issued on, not on the main stream.

Under the stream double (tests/stream_double.py) the side stream stands in for GRPO's CUDA side
stream and a 1-rank gloo group for the network. For one bucket of each compressed collective
(the int4 reduce-scatter with replicated elements, PowerSGD's, the hierarchical all-reduce with
exact offsets) ``wait()`` called on the main stream must: wait for the collective with the side
stream current (with NCCL: the side stream waits, the host does not), issue every decode kernel
(and the hierarchical second phase's all-gather) on the side stream after that wait, record a
"decoded" event after the last of them, and leave the main stream one dependency, a
``wait_event`` on that event; no host synchronize; the gradient buffer the decode writes
(a main-stream allocation) record_stream-ed on the side stream. Results are bit-identical to
the path without streams (the CPU's).
"""

import contextlib

import pytest
import torch

from megatron_grpo.comm.compress import Int4Compressor
from megatron_grpo.comm.dynamic import CompressedReduceScatter
from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.comm.hierarchical import InterInstanceAllReduce
from megatron_grpo.comm.powersgd import BucketLayout, PowerSGDReduceScatter, PowerSGDState
from megatron_grpo.comm.replicated import ReplicatedElements
from megatron_grpo.comm.streams import CommOrder
from stream_double import StreamDouble

N = 1024  # one bucket: an 8 x 96 matrix then 256 elements sent exactly


def _issue(kind, grad, ef, group, async_op, order):
    """Start one bucket's sync as GRPOBucketGroup does (dp = 1: the shard is the bucket)."""
    if kind == "int4":
        rep = ReplicatedElements(torch.arange(768, N), N, 0)
        return CompressedReduceScatter("b", grad, grad, ef, Int4Compressor(64), group, async_op,
                                       replicated=rep, order=order)
    if kind == "powersgd":
        layout = BucketLayout([(0, 8, 96)], torch.arange(768, N), N)
        return PowerSGDReduceScatter("b", grad, grad, ef, PowerSGDState(2), layout, group, async_op,
                                     tag=contextlib.nullcontext, order=order)
    return InterInstanceAllReduce("b", grad, ef, Int4Compressor(64), group, async_op,
                                  exact_offsets=torch.arange(768, N), order=order)


def _grad(step):
    return torch.randn(N, generator=torch.Generator().manual_seed(step))


def _reference(kind, group, steps):
    """The same syncs with no streams at all (the CPU path: wait() decodes where it is called)."""
    ef, out = ErrorFeedback(), []
    for step in range(steps):
        grad = _grad(step)
        _issue(kind, grad, ef, group, True, None).wait()
        ef.commit()
        out.append(grad)
    return out


def _after(log, i, prefix):
    return [j for j in range(i, len(log)) if log[j].startswith(prefix)]


@pytest.mark.parametrize("kind", ["int4", "powersgd", "hierarchical"])
def test_decode_runs_on_the_comm_stream_and_main_waits_on_its_event(kind, gloo_group):
    steps, got = 2, []
    ef = ErrorFeedback()
    with StreamDouble() as double:
        order = CommOrder(double.side, double.on, lambda: double._current)
        for step in range(steps):
            grad = _grad(step)  # megatron's gradient buffer: a main-stream allocation
            double.side.wait_stream(double.main)  # as GRPOBucketGroup._side_stream does
            with double.on(double.side):
                handle = _issue(kind, grad, ef, gloo_group, True, order)
            start = len(double.log)
            handle.wait()  # finish_grad_sync / the in-flight window: the main stream
            log = double.log[start:]
            kernels = [j for j, e in enumerate(log) if e.startswith(("kernel:", "collective:"))]
            assert kernels, log
            assert all(":side:" in log[j] for j in kernels), [log[j] for j in kernels if ":main:" in log[j]]
            # The comm stream waits for the exchange before it decodes anything.
            first_wait = log.index("side<-collective")
            assert first_wait < kernels[0], log[:kernels[0] + 1]
            assert all(e != "main<-collective" for e in log), log
            if kind == "hierarchical":  # the second phase's all-gather, issued on the comm stream
                assert any(e.startswith("collective:side:c10d._allgather_base_") for e in log), log
            # One event after the last kernel; the main stream's only entry is the wait on it.
            records = _after(log, kernels[-1], "record:side#")
            assert len(records) == 1 and not _after(log, 0, "record:main")
            decoded = log[records[0]][len("record:"):]
            assert [e for e in log if e.startswith("main")] == [f"main<-event:{decoded}"], log
            assert log.index(f"main<-event:{decoded}") > records[0]
            assert not [e for e in double.log if e.startswith("synchronize")]
            # The gradient buffer, written on the side stream, is recorded there...
            assert "side" in double.recorded_streams(grad), log
            ef.commit()  # the controller's end_step (after its join)
            got.append(grad.clone())
            # ... and the main stream, having waited on the event, may free it at once.
            grad.untyped_storage().resize_(0)
    for a, b in zip(got, _reference(kind, gloo_group, steps)):
        assert torch.equal(a, b)


def test_a_synchronous_sync_finishes_on_the_side_stream_without_a_self_wait(gloo_group):
    # Without overlap the sync finishes inside the side stream's section (the constructor
    # waits): no event wait of the side stream on itself, nothing on the main stream.
    with StreamDouble() as double:
        order = CommOrder(double.side, double.on, lambda: double._current)
        grad = _grad(0)
        double.side.wait_stream(double.main)
        start = len(double.log)
        with double.on(double.side):
            _issue("int4", grad, ErrorFeedback(), gloo_group, False, order)
        log = double.log[start:]
        assert not [e for e in log if "<-event" in e or e.startswith("main") or ":main:" in e], log
        assert "side<-collective" in log
