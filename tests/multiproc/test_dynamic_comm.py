"""The dynamic tier's compressed collectives on 2 real gloo ranks: exactness of error feedback
through the reduce-scatter, and identical parameter copies after compressed all-gathers."""

import os

import torch
import torch.distributed as dist

from harness import spawn_ranks

STEPS, N = 40, 4096


def _worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.comm.compress import Int4Compressor
    from megatron_grpo.comm.error_feedback import ErrorFeedback
    from megatron_grpo.comm.dynamic import CompressedReduceScatter, compressed_param_gather

    dist.init_process_group("gloo", rank=rank, world_size=2)
    comp, ef = Int4Compressor(256), ErrorFeedback()
    gen = torch.Generator().manual_seed(100 + rank)
    applied_sum = torch.zeros(N // 2, dtype=torch.float64)
    true_sum = torch.zeros(N, dtype=torch.float64)
    for step in range(STEPS):
        grad = torch.randn(N, generator=gen) * (1 + step % 3)
        true_sum += grad.double()
        buf = grad.clone()
        shard = buf[rank * N // 2:(rank + 1) * N // 2]
        CompressedReduceScatter("b", buf, shard, ef, comp, group=None, async_op=True).wait()
        ef.commit()  # the step was applied
        applied_sum += shard.double()
    # What every rank should have received for my shard: sum over ranks of their true grads,
    # minus what error feedback still holds back (each rank's final residual for my shard).
    total_true = true_sum.clone()
    dist.all_reduce(total_true)
    residual = ef.residual("b").double()
    dist.all_reduce(residual)
    mine = slice(rank * N // 2, (rank + 1) * N // 2)
    ef_error = float((applied_sum - (total_true[mine] - residual[mine])).abs().max())
    plain_error = float((applied_sum - total_true[mine]).abs().max())

    # Compressed parameter all-gather: both copies must stay bit-identical, and the owner's
    # exact master is reached up to one step's compression error.
    torch.manual_seed(0)
    param = torch.randn(N)            # identical initial copies on both ranks
    master = param[mine].clone()
    for step in range(10):
        master += torch.randn(N // 2, generator=gen) * 1e-2
        compressed_param_gather(param, master, comp, group=None)
    copies = [torch.empty(N) for _ in range(2)]
    dist.all_gather(copies, param)
    gap = float((param[mine] - master).abs().max())
    queue.put((rank, ef_error, plain_error, bool(torch.equal(copies[0], copies[1])), gap))
    dist.barrier()
    dist.destroy_process_group()


def test_error_feedback_exact_through_reduce_scatter_and_identical_param_copies():
    results = spawn_ranks(_worker)
    for rank, ef_error, plain_error, identical, gap in results:
        # sum of applied = sum of true - final residual, to fp32 rounding over 40 steps.
        assert ef_error < 1e-4, ef_error
        assert plain_error > 100 * ef_error   # the residual is real, not zero
        assert identical
        assert 0 < gap < 5e-3  # vs ~3e-2 total drift of the master over the 10 steps
