"""The side-stream free rule through the real bucket group (issue 27, item 3), on two gloo ranks.

A megatron DDP model (overlap on) with GRPO installed, every unit dynamic, its error-feedback
residuals in the memory tier's OffloadedResiduals, and the controller's streams replaced by the
stream double (tests/stream_double.py). Backward's hooks run GRPOBucketGroup.start_grad_sync
inside the side stream's context, so ErrorFeedback.owed's add and the store's release happen
there, as on a GPU. The double fails the run if a residual is freed under the pending add.

Only the free rule is checked here (``check_races=False``): the double does not model that a
collective's ``wait()`` makes the main stream wait for the stream that issued it.
"""

from harness import spawn_ranks

LAYERS, WIDTH, BUCKET, STEPS = 4, 32, 1000, 4


def _worker(rank, port, queue):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.platform import select_platform

    select_platform(force_cpu=True)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    out = {"rank": rank}
    try:
        out.update(_train(rank))
    except BaseException:  # reported by the test (a failing rank would leave the queue empty)
        import traceback

        out["error"] = traceback.format_exc()
    queue.put(out)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _train(rank):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.megatron import grpo_data_parallel_group, install
    from megatron_grpo.offload import ChunkStore, OffloadConfig
    from megatron_grpo.offload.residuals import OffloadedResiduals
    from stream_double import StreamDouble

    tf = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp = DistributedDataParallel(tf, DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=BUCKET,
        grad_reduce_in_fp32=True), module)
    ctrl = GRPOController(GRPOConfig(enabled=True, compress="all", warmup_iters=100), [ddp], torch.device("cpu"),
                          grpo_data_parallel_group())
    install([ddp], ctrl)
    ctrl.tiers = ["dynamic"] * len(ctrl.units)
    with ChunkStore(OffloadConfig(chunk_mb=0.25, capacity=8 << 20), rank=rank) as store, \
            StreamDouble(check_races=False) as double:
        residuals = OffloadedResiduals(store, "cpu", lookahead=2)
        ctrl.ef.use_store(residuals)
        double.install(ctrl)
        for step in range(STEPS):
            ctrl.begin_step(step)
            residuals.begin_step()  # the memory tier's TierPlacement.begin_step does this
            ddp.zero_grad_buffer()
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
            module(x).square().mean().backward()  # start_grad_sync, on the side stream
            ddp.finish_grad_sync()
            ctrl.end_step()
            store.wait_all()  # every write lands: which residual is where is the same each run
            residuals.settle()
        return {"units": len(ctrl.units), "keys": len(ctrl.ef.keys()),
                "cross_stream_frees": double.cross_stream_frees,
                "side_sections": double.log.count("enter:side")}


def test_offloaded_residuals_outlive_the_side_stream_add_in_the_bucket_group():
    for r in spawn_ranks(_worker, 2, timeout=240):
        assert "error" not in r, r["error"]
        assert r["keys"] == r["units"] == LAYERS and r["side_sections"] == LAYERS * STEPS
        # From the third step on, the two residuals the store fetched at the step's start (main
        # stream) were released under the side stream's pending add, protected by record_stream.
        assert r["cross_stream_frees"] == 2 * (STEPS - 2)
