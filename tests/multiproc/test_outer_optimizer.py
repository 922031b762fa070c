"""The outer optimizer of the periodic tiers (megatron_grpo.comm.outer) on 3 spawned gloo ranks,
each one "instance": every instance ends a sync with the same bytes, the result is the Nesterov
step on the mean delta (checked against a float64 re-computation), compressed deltas lose
nothing over several syncs (error feedback), and an exact sync delivers what compression owed."""

import os

import torch
import torch.distributed as dist

from harness import spawn_ranks

N, SYNCS = 1001, 6  # 1001: not divisible by 3 (the padded path of the compressed all-reduce)


def _worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.comm.compress import Int8Compressor
    from megatron_grpo.comm.outer import OuterOptimizer

    dist.init_process_group("gloo", rank=rank, world_size=3)
    gen = torch.Generator().manual_seed(7)  # the same start on every instance
    start = torch.randn(N, generator=gen)
    local_gen = torch.Generator().manual_seed(100 + rank)
    out = {"rank": rank}

    # 1. Exact deltas, Nesterov momentum: compare with a float64 re-computation.
    lr, mu = 0.7, 0.9
    outer = OuterOptimizer(lr, mu, group=None)
    outer.set_anchor("u", start)
    local = start.clone()
    ref_anchor, ref_buf = start.double(), torch.zeros(N, dtype=torch.float64)
    worst, identical = 0.0, True
    for _ in range(SYNCS):
        local -= 0.01 * torch.randn(N, generator=local_gen)  # this instance's local steps
        deltas = [torch.zeros(N) for _ in range(3)]
        dist.all_gather(deltas, ref_anchor.float() - local)
        mean = torch.stack([d.double() for d in deltas]).mean(0)
        ref_buf = mu * ref_buf + mean
        ref_anchor = ref_anchor - lr * (mean + mu * ref_buf)
        spread, size = map(float, outer.sync("u", local))
        worst = max(worst, float((local.double() - ref_anchor).abs().max()))
        copies = [torch.zeros(N) for _ in range(3)]
        dist.all_gather(copies, local)
        identical &= all(torch.equal(c, local) for c in copies)
        assert torch.equal(outer.anchor["u"], local)
    out.update(exact_error=worst, exact_identical=identical, spread=spread, size=size)

    # 2. Compressed (int8) deltas, plain averaging: what was applied over all syncs equals the
    # mean of what every instance moved, less what error feedback still owes, to rounding; an
    # exact sync then delivers that too.
    outer = OuterOptimizer(1.0, 0.0, group=None)
    outer.set_anchor("u", start)
    local = start.clone()
    moved = torch.zeros(N, dtype=torch.float64)
    identical = True
    for i in range(SYNCS):
        step = 0.01 * torch.randn(N, generator=local_gen)
        local -= step
        moved += step.double()
        outer.sync("u", local, compressor=Int8Compressor(256))
        copies = [torch.zeros(N) for _ in range(3)]
        dist.all_gather(copies, local)
        identical &= all(torch.equal(c, local) for c in copies)
    total_moved = moved.clone()
    dist.all_reduce(total_moved)
    owed = outer.ef.residual("u")[:N].double()
    dist.all_reduce(owed)
    # anchor = start - (sum over syncs of the delivered mean delta) = start - (moved - owed) / 3
    gap_before = float((local.double() - (start.double() - (total_moved - owed) / 3)).abs().max())
    held_back = float(owed.abs().max() / 3)
    outer.sync("u", local, compressor=None)  # exact: delivers the residual, nothing moved since
    gap_after = float((local.double() - (start.double() - total_moved / 3)).abs().max())
    out.update(compressed_identical=identical, gap_before=gap_before, held_back=held_back,
               gap_after=gap_after, residual_left=outer.ef.residual("u") is None)
    dist.barrier()
    dist.destroy_process_group()
    queue.put(out)


def test_outer_sync_identical_nesterov_and_nothing_lost():
    for r in spawn_ranks(_worker, nranks=3):
        assert r["exact_identical"] and r["compressed_identical"], r
        assert r["exact_error"] < 1e-5, r  # fp32 against the float64 recomputation
        assert r["spread"] > 0 and r["size"] > 0  # the instances had moved apart
        assert r["gap_before"] < 1e-5, r  # applied = mean moved - owed, to rounding
        assert r["held_back"] > 100 * r["gap_before"], r  # and the residual is real
        assert r["gap_after"] < 1e-5 and r["residual_left"], r  # the exact sync delivered it
