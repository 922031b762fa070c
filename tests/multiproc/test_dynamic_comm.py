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


def _inter_worker(rank, port, queue):
    # 3 "instances", one rank each: the group GRPO's inter-instance all-reduce runs on. A shard of
    # 1001 elements is not divisible by 3 (the padded scratch path).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.comm.compress import Int4Compressor
    from megatron_grpo.comm.error_feedback import ErrorFeedback
    from megatron_grpo.comm.hierarchical import InterInstanceAllReduce
    from megatron_grpo.comm.wire import WireCounter

    dist.init_process_group("gloo", rank=rank, world_size=3)
    counter = WireCounter()
    counter.install()
    comp, ef, n = Int4Compressor(256), ErrorFeedback(), 1001
    gen = torch.Generator().manual_seed(200 + rank)
    applied = torch.zeros(n, dtype=torch.float64)
    true = torch.zeros(n, dtype=torch.float64)
    outs = []
    for step in range(30):
        grad = torch.randn(n, generator=gen) * (1 + step % 4)
        true += grad.double()
        shard = grad.clone()
        counter.reset()
        InterInstanceAllReduce("b", shard, ef, comp, group=None, async_op=True).wait()
        sent = counter.reset()["total"]
        ef.commit()
        applied += shard.double()
        outs.append(shard.clone())
    total_true = true.clone()
    dist.all_reduce(total_true)
    residual = ef.residual("b").double()
    assert residual.numel() == 1002  # padded to 3 rows of 334
    dist.all_reduce(residual)
    ef_error = float((applied - (total_true - residual[:n])).abs().max())
    plain_error = float((applied - total_true).abs().max())
    gathered = [torch.empty(30 * n) for _ in range(3)]
    dist.all_gather(gathered, torch.cat(outs))
    identical = all(torch.equal(gathered[0], g) for g in gathered[1:])
    queue.put((rank, ef_error, plain_error, identical, sent, float(residual[n:].abs().max())))
    dist.barrier()
    dist.destroy_process_group()


def test_inter_instance_all_reduce_is_identical_everywhere_and_loses_nothing():
    from megatron_grpo.comm.compress import Int4Compressor

    row_payload = Int4Compressor(256).payload_bytes(334)
    for rank, ef_error, plain_error, identical, sent, pad in spawn_ranks(_inter_worker, nranks=3):
        # sum of what was applied = sum of the true gradients - the residuals still held back
        # (each member's own quantisation and the owners' all-gather losses), to fp rounding.
        assert ef_error < 1e-3, ef_error
        assert plain_error > 100 * ef_error
        assert identical  # every instance ends every step with the same bytes
        assert pad == 0.0  # zero padding quantises exactly: nothing owed there
        # all_to_all: 2 rows leave; all-gather: 2 copies of the own row leave (ring rule).
        assert sent == 2 * 2 * row_payload, (sent, row_payload)
