"""No storage is freed while a side-stream kernel may still use it.

The stream double (tests/stream_double.py) stands in for CUDA streams and the caching allocator
on CPU: it fails when a storage with a pending, unprotected use on another stream is freed, or
when a kernel races one queued on another stream. First the double itself (it catches what it
must and accepts the three safe patterns), then GRPO's side-stream paths under it.
"""

import pytest
import torch

from megatron_grpo.comm import streams
from megatron_grpo.comm.compress import Int4Compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.offload import ChunkStore, OffloadConfig
from megatron_grpo.offload.residuals import OffloadedResiduals
from stream_double import StreamDouble, StreamHazard


def _side_add(double, target, source):
    double.side.wait_stream(double.main)  # as GRPOBucketGroup._side_stream does
    with double.on(double.side):
        target.add_(source)


# ---- the double ----------------------------------------------------------------------------------
def test_double_fails_a_free_while_a_side_stream_read_is_pending():
    with StreamDouble() as double:
        grad, residual = torch.zeros(64), torch.ones(64)  # residual: a main-stream allocation
        _side_add(double, grad, residual)
        with pytest.raises(StreamHazard, match=r"allocated by the main stream.*side"):
            residual.untyped_storage().resize_(0)


@pytest.mark.parametrize("protect", ["record_stream", "join", "side_allocation"])
def test_double_accepts_the_three_safe_frees(protect):
    with StreamDouble() as double:
        grad = torch.zeros(64)
        if protect == "side_allocation":
            with double.on(double.side):
                residual = torch.ones(64)  # the side stream's own block: reuse is stream-ordered
        else:
            residual = torch.ones(64)
        double.side.wait_stream(double.main)
        with double.on(double.side):
            grad.add_(residual)
            if protect == "record_stream":
                streams.used_on_current_stream(residual)
        if protect == "join":
            double.main.wait_stream(double.side)
        residual.untyped_storage().resize_(0)
        assert double.cross_stream_frees == (1 if protect == "record_stream" else 0)


def test_double_fails_a_main_stream_write_racing_a_queued_side_stream_read():
    with StreamDouble() as double:
        grad, residual = torch.zeros(64), torch.ones(64)
        _side_add(double, grad, residual)
        with pytest.raises(StreamHazard, match=r"main stream writes a storage the side stream"):
            residual.fill_(2.0)  # a buffer handed out again before the side stream read it
        double.main.wait_stream(double.side)
        residual.fill_(3.0)
        event = double.side.record_event()
        _side_add(double, grad, residual)
        double.main.wait_event(event)  # an event from before the add does not cover it
        with pytest.raises(StreamHazard):
            grad.mul_(2.0)


# ---- GRPO's paths ----------------------------------------------------------------------------------
def test_offloaded_residual_is_not_freed_under_the_pending_side_stream_add():
    # ErrorFeedback.owed queues grad.add_(residual) on the side stream, then the offloading
    # store's release() frees the residual's storage at once. The residuals prefetched at the
    # start of the step were allocated by the main stream, so the allocator could give their
    # block to the next main-stream allocation before the add ran.
    c, dp, n, keys = Int4Compressor(256), 2, 8192, [(u, 0) for u in range(4)]
    cfg = OffloadConfig(chunk_mb=0.25, capacity=8 << 20)
    with ChunkStore(cfg, rank=0) as store, StreamDouble() as double:
        res = OffloadedResiduals(store, "cpu", lookahead=2)
        ef = ErrorFeedback()
        ef.use_store(res)
        released = []
        for step in range(4):
            res.begin_step()  # main stream: fetches the first `lookahead` residuals of the step
            for key in reversed(keys):  # backward: the last buckets are ready first
                grad = torch.randn(n, generator=torch.Generator().manual_seed(10 * step + key[0]))
                double.side.wait_stream(double.main)
                with double.on(double.side):  # GRPOBucketGroup.start_grad_sync
                    payload = c.compress_rows(ef.owed(key, grad).view(dp, -1))
                    ef.stage(key, grad, payload, 0, c)
                released.append(res.nbytes())
            double.main.wait_stream(double.side)  # GRPOController.end_step joins first
            ef.commit()
            store.wait_all()  # every write lands: which residual is where is then the same each run
            res.settle()
        # From step 2 on (step 1 has no read order yet), the two residuals begin_step fetched on
        # the main stream were released under the side stream's pending add; the others were
        # fetched from inside the side stream's context (its own blocks: stream-ordered reuse).
        assert double.cross_stream_frees == 4
        assert ef.nbytes() == 0 and len(ef.keys()) == 4
