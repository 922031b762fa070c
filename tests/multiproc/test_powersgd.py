"""The PowerSGD peer compressor on 2 real gloo ranks: full rank reproduces the exact sum, low
rank delivers a rank-r matrix, error feedback loses nothing over many steps, 1-D parameters go
exactly, and a skipped step leaves the warm-start factors as they were."""

import os

import torch
import torch.distributed as dist

from harness import spawn_ranks

# Two matrices and a block of 1-D parameter elements, then 4 padding elements.
MATS = [(0, 16, 32), (512, 8, 64)]
EXACT = (1024, 1100)
N = 1104


def _layout():
    from megatron_grpo.comm.powersgd import BucketLayout

    return BucketLayout(list(MATS), torch.arange(*EXACT), N)


def _grad(gen, scale=1.0):
    g = torch.randn(N, generator=gen) * scale
    g[EXACT[1]:] = 0.0  # padding carries no gradient
    return g


def _reduce(buf, rank, ef, state, layout):
    from megatron_grpo.comm.powersgd import PowerSGDReduceScatter
    from contextlib import nullcontext

    shard = buf[rank * N // 2:(rank + 1) * N // 2]
    PowerSGDReduceScatter("b", buf, shard, ef, state, layout, None, True, nullcontext).wait()
    full = torch.empty(N)
    dist.all_gather_into_tensor(full, shard.contiguous())
    return full


def _worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.comm.error_feedback import ErrorFeedback
    from megatron_grpo.comm.powersgd import PowerSGDState

    dist.init_process_group("gloo", rank=rank, world_size=2)
    layout, gen, out = _layout(), torch.Generator().manual_seed(10 + rank), {}

    # 1. Rank >= every matrix dimension: the power step spans the whole space, so the reduced
    #    bucket is the exact sum (to fp32 rounding).
    g = _grad(gen)
    total = g.clone()
    dist.all_reduce(total)
    full = _reduce(g.clone(), rank, ErrorFeedback(), PowerSGDState(64), layout)
    out["full_rank_err"] = float((full - total).abs().max())

    # 2. Rank 2: each matrix block of the reduced bucket has rank <= 2; 1-D elements are exact;
    #    padding stays zero.
    state, ef = PowerSGDState(2), ErrorFeedback()
    g = _grad(gen)
    total = g.clone()
    dist.all_reduce(total)
    full = _reduce(g.clone(), rank, ef, state, layout)
    out["ranks"] = [int(torch.linalg.matrix_rank(full[s:s + r * c].view(r, c))) for s, r, c in MATS]
    out["exact_err"] = float((full[EXACT[0]:EXACT[1]] - total[EXACT[0]:EXACT[1]]).abs().max())
    out["padding"] = float(full[EXACT[1]:].abs().max())
    out["low_rank_err"] = float((full[:1024] - total[:1024]).abs().max())

    # 3. A skipped step (discard) leaves Q and the residuals as they were.
    ef.commit()
    state.commit()
    q_before = state.q("b", layout.wire_elements(2)[1], "cpu").clone()
    r_before = ef.residual("b").clone()
    _reduce(_grad(gen).clone(), rank, ef, state, layout)
    ef.discard()
    state.discard()
    out["skip_keeps_q"] = bool(torch.equal(state.q("b", q_before.numel(), "cpu"), q_before))
    out["skip_keeps_residual"] = bool(torch.equal(ef.residual("b"), r_before))

    # 4. Error feedback over 30 applied steps: sum delivered = sum true - final residuals, and
    #    rank 1 sending zeros still issues the same collectives (the run finishes).
    state, ef = PowerSGDState(2), ErrorFeedback()
    delivered = torch.zeros(N, dtype=torch.float64)
    true_sum = torch.zeros(N, dtype=torch.float64)
    for step in range(30):
        g = _grad(gen, 1 + step % 3) if rank == 0 or step % 5 else torch.zeros(N)
        true_sum += g.double()
        delivered += _reduce(g.clone(), rank, ef, state, layout).double()
        ef.commit()
        state.commit()
    dist.all_reduce(true_sum)
    residual = ef.residual("b").double()
    dist.all_reduce(residual)
    out["ef_err"] = float((delivered - (true_sum - residual)).abs().max())
    out["plain_err"] = float((delivered - true_sum).abs().max())
    out["wire"] = layout.wire_elements(2)
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def test_powersgd_reduce_on_two_ranks():
    for rank, o in spawn_ranks(_worker):
        assert o["full_rank_err"] < 1e-4, o
        assert o["ranks"] == [2, 2], o
        assert o["exact_err"] < 1e-6 and o["padding"] == 0.0, o
        assert o["low_rank_err"] > 0.1, o        # rank 2 of 16x32 / 8x64 really is lossy
        assert o["skip_keeps_q"] and o["skip_keeps_residual"], o
        assert o["ef_err"] < 1e-3, o             # nothing lost over 30 steps, only delayed
        assert o["plain_err"] > 100 * o["ef_err"], o
        # P: 16*2 + 8*2 factor elements + 76 exact elements; Q: 32*2 + 64*2.
        assert o["wire"] == (16 * 2 + 8 * 2 + 76, 32 * 2 + 64 * 2), o


def test_layout_from_a_megatron_bucket_shape():
    """BucketLayout.for_bucket puts >=2-D parameters in matrices and 1-D ones in exact."""
    from types import SimpleNamespace

    from megatron_grpo.comm.powersgd import BucketLayout

    grad = torch.zeros(200)
    w, b = torch.nn.Parameter(torch.zeros(8, 4, 3)), torch.nn.Parameter(torch.zeros(10))
    w.main_grad, b.main_grad = grad[0:96], grad[128:138]   # 32 elements of start padding
    lay = BucketLayout.for_bucket(SimpleNamespace(grad_data=grad, params_list=[b, w]), "cpu")
    assert lay.matrices == [(0, 8, 12)]
    assert lay.exact_index.tolist() == list(range(128, 138))
    assert lay.wire_elements(4) == (8 * 4 + 10, 12 * 4)
