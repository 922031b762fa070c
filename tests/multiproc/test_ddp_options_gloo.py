"""average_in_collective and context parallelism on two gloo ranks.

Two real megatron DDP models (overlap on, distributed optimizer) with GRPO installed, one
backward each, then the gradient shard each rank hands its optimizer:

* average_in_collective=True: megatron scales by 1.0 and reduces with ReduceOp.AVG. GRPO's
  compressed path sums, so without the fix a compressed tier got dp times the gradient. The
  compressed shard must be the same bits as with average_in_collective=False, and within the
  int8 error of megatron's exact one.
* context_parallel_size=2 (dp 1 x cp 2): megatron reduces over the cp ranks; the glue's
  controller group must be that group, so the dynamic tier compresses there too.
"""

import pytest

from harness import spawn_ranks

LAYERS, WIDTH, BUCKET = 4, 32, 1000  # 4 x 1,056 elements: a bucket group per layer


def _worker(rank, port, queue):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.platform import select_platform

    select_platform(force_cpu=True)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    out = {"rank": rank}
    for part, cp, cases in (("average", 1, [(a, t) for a in (False, True) for t in ("core", "dynamic")]),
                            ("cp2", 2, [("cp2", t) for t in ("core", "dynamic")])):
        ps.initialize_model_parallel(context_parallel_size=cp)
        try:
            for case in cases:
                out[case] = _synced_shard(rank, case[0] is True, case[1], cp)
        except Exception:  # reported by the test (a failing rank would leave the queue empty)
            import traceback

            out[f"error {part}"] = traceback.format_exc()
        ps.destroy_model_parallel()
    queue.put(out)
    dist.destroy_process_group()


def _synced_shard(rank, average, tier, cp):
    """This rank's reduced gradient shard of every bucket after one backward, with every unit
    in ``tier`` (core: megatron's exact sync; dynamic: GRPO's int8 reduce-scatter)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.megatron import grpo_data_parallel_group, install

    tf = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                           use_cpu_initialization=True, context_parallel_size=cp)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True,
                                               bucket_size=BUCKET, grad_reduce_in_fp32=True,
                                               average_in_collective=average)
    ddp = DistributedDataParallel(tf, ddp_config, module)
    ctrl = GRPOController(GRPOConfig(enabled=True, compress="all", compressor="int8", core_compressor="none"), [ddp],
                          torch.device("cpu"), grpo_data_parallel_group())
    install([ddp], ctrl)
    ctrl.tiers = [tier] * len(ctrl.units)
    ctrl.tiered = True
    compressed = [ctrl.unit_compressor(u.index) is not None for u in ctrl.units]
    ddp.zero_grad_buffer()
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 + rank))
    module(x).square().mean().backward()
    ddp.finish_grad_sync()
    size = ddp.bucket_groups[0].intra_distributed_optimizer_instance_group.size()
    shards = []
    for group in ddp.bucket_groups:
        for b in group.buckets:
            n = b.grad_data.numel() // size
            shards.append(b.grad_data[rank * n:(rank + 1) * n].clone())
    return {"shard": torch.cat(shards), "compressed": compressed, "units": len(ctrl.units),
            "ctrl_dp": ctrl.dp_size, "ddp_dp": size}


@pytest.fixture(scope="module")
def results():
    return {r["rank"]: r for r in spawn_ranks(_worker, 2, timeout=240)}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_compressed_tiers_average_as_megatron_does_under_average_in_collective(results):
    import torch

    for r in results.values():
        assert "error average" not in r, r["error average"]
        assert r[(False, "core")]["units"] >= 2
        assert not any(r[(True, "core")]["compressed"]) and all(r[(True, "dynamic")]["compressed"])
        exact_sum, exact_avg = r[(False, "core")]["shard"], r[(True, "core")]["shard"]
        # megatron's own two ways (pre-scale and SUM, or AVG) agree up to rounding ...
        assert torch.allclose(exact_avg, exact_sum, rtol=1e-5, atol=1e-8)
        # ... GRPO's compressed path pre-scales by 1/dp in both: the same bits ...
        assert torch.equal(r[(True, "dynamic")]["shard"], r[(False, "dynamic")]["shard"])
        # ... and within int8's error of the exact gradient (dp x it would be 1.0 away).
        assert _rel(r[(True, "dynamic")]["shard"], exact_avg) < 0.02


def test_context_parallel_ranks_are_the_controllers_data_parallel_group(results):
    for r in results.values():
        assert "error cp2" not in r, r["error cp2"]
        core, dynamic = r[("cp2", "core")], r[("cp2", "dynamic")]
        assert (dynamic["ctrl_dp"], dynamic["ddp_dp"]) == (2, 2)
        assert all(dynamic["compressed"])  # dp 1 alone would have left every unit exact
        assert _rel(dynamic["shard"], core["shard"]) < 0.02
