"""--grpo-sampled-backward under sequence parallelism, on 2 gloo ranks at the level of the
autograd function megatron's column-parallel layers call (megatron-core runs a whole model with
sequence parallelism only with the TE spec or apex norms, neither of which exists on CPU).

With sequence parallelism a column-parallel layer's input holds 1/TP of the sequence; the
forward all-gathers it, the backward all-gathers it again for the weight gradient and
reduce-scatters the data gradient back to sequence slices. Both TP ranks must keep the rows one
rank keeps for the whole layer: their weight-gradient slices and data-gradient slices equal the
TP=1 computation's, with the data gradients sampled too. A rank that used only its own slice's
|dy| norms (the defect the norm sync prevents) keeps other rows and fails the check."""

import torch

from harness import spawn_ranks

SEQ, BATCH, FAN_IN, FAN_OUT, KEEP = 16, 2, 24, 20, 0.3


def _data():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SEQ, BATCH, FAN_IN, generator=g) * torch.rand(SEQ, BATCH, 1, generator=g) ** 3
    w = torch.randn(FAN_OUT, FAN_IN, generator=g)
    dy = torch.randn(SEQ, BATCH, FAN_OUT, generator=g) * torch.rand(SEQ, BATCH, 1, generator=g) ** 3
    return x, w, dy


def _plan():
    from megatron_grpo.compute.plan import SampledBackward
    from megatron_grpo.grpo.config import GRPOConfig

    cfg = GRPOConfig(enabled=True, sampled_backward=True, sample_dgrad="below-core",
                     sample_min_keep=KEEP, sample_max_keep=KEEP)
    plan = SampledBackward(cfg, 1, slice(0, 1), seed=5, dp_rank=0)
    plan.wanted = [KEEP]
    plan.begin_step(3, ["dynamic"], tiered=True)
    return plan


def _grads(x, w, dy, group, sequence_parallel, own_norms=False):
    from megatron_grpo.megatron import sampled_linear as SL

    site = SL.Site(_plan(), 0, column=True, tp_group=group)
    if own_norms:
        site.sync_norms = lambda sq: sq  # the defect: each rank's own slice of dy
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = SL._SampledLinear.apply(xi, wi, None, False, False, sequence_parallel, group, site)
    out.backward(dy)
    return xi.grad, wi.grad, out.detach(), site.plan.metrics()["sample_rows_digest"]


def _worker(rank, port, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    x, w, dy = _data()
    ref_dx, ref_dw, ref_y, ref_digest = _grads(x, w, dy, None, False)
    seq = slice(rank * SEQ // 2, (rank + 1) * SEQ // 2)
    out = slice(rank * FAN_OUT // 2, (rank + 1) * FAN_OUT // 2)
    result = {"rank": rank}
    for name, own in (("synced", False), ("own_norms", True)):
        dx, dw, y, digest = _grads(x[seq], w[out], dy[:, :, out], dist.group.WORLD, True, own)
        result[name] = {
            "y": bool(torch.allclose(y, ref_y[:, :, out], atol=1e-5)),
            "dw": bool(torch.allclose(dw, ref_dw[out], rtol=1e-4, atol=1e-5)),
            "dx": bool(torch.allclose(dx, ref_dx[seq], rtol=1e-4, atol=1e-5)),
            "digest": digest == ref_digest,
            "sampled": bool((ref_dw != (dy.reshape(-1, FAN_OUT).t() @ x.reshape(-1, FAN_IN))).any()),
        }
    queue.put(result)
    dist.destroy_process_group()


def test_sequence_parallel_ranks_keep_the_rows_one_rank_keeps():
    results = sorted(spawn_ranks(_worker, 2), key=lambda r: r["rank"])
    for r in results:
        good, bad = r["synced"], r["own_norms"]
        assert good == {"y": True, "dw": True, "dx": True, "digest": True, "sampled": True}, r
        # The check says "bad" on a rank that drew from its own slice's norms.
        assert bad["y"] and not (bad["dw"] and bad["dx"] and bad["digest"]), r
