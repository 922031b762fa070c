"""GRPODistributedDataParallel with GRPO off is megatron's DistributedDataParallel: the same
buckets over the same parameter ranges in every configuration (megatron-core's own unit tests
run GRPO's class this way); with GRPO on it keeps its buckets where megatron drops them.

Two gloo ranks as two pipeline stages (dp 1 each): stage 0 checks overlap on and off, stage 1
is a stage after the first, where megatron turns bucketing off.
"""

from harness import spawn_ranks

LAYERS, WIDTH, BUCKET = 10, 100, 10_000  # 10 x 10,100 elements: 10 buckets when bucketing


def _layouts(rank, port, queue):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.platform import select_platform

    select_platform(force_cpu=True)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    tf = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                           use_cpu_initialization=True)  # only read for its flags here

    def layout(cls, overlap, bucket_size=BUCKET, **kw):
        torch.manual_seed(0)
        module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        names = {p: n for n, p in module.named_parameters()}
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, use_distributed_optimizer=True,
                                                   bucket_size=bucket_size, grad_reduce_in_fp32=True)
        ddp = cls(tf, ddp_config, module, **kw)
        # Every bucket: its element range in the buffer and the parameters it holds, by name.
        return [[(b.offset, b.grad_data.numel(), sorted(names[p] for p in b.params_list))
                 for b in buf.buckets] for buf in ddp.buffers], ddp_config.bucket_size

    out = {"rank": rank}
    try:
        _collect(out, layout)
    except Exception as exc:  # reported by the test (a failing rank would leave the queue empty)
        out["error"] = repr(exc)
    queue.put(out)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _collect(out, layout):
    from megatron.core.distributed import DistributedDataParallel

    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.megatron.ddp import GRPODistributedDataParallel

    for overlap in (False, True):
        for size in (BUCKET, None):
            # Filled one by one: what was built before an error is still compared.
            case = out[f"overlap={overlap} bucket_size={size}"] = {}
            case["megatron"] = layout(DistributedDataParallel, overlap, size)
            case["off_default"] = layout(GRPODistributedDataParallel, overlap, size)
            case["off_config"] = layout(GRPODistributedDataParallel, overlap, size,
                                        grpo_config=GRPOConfig(enabled=False))
    out["disable_bucketing"] = {
        "megatron": layout(DistributedDataParallel, True, disable_bucketing=True),
        "off_default": layout(GRPODistributedDataParallel, True, disable_bucketing=True)}
    # GRPO on: the buckets are its tier units, kept without overlap and on later stages.
    out["on"] = {overlap: layout(GRPODistributedDataParallel, overlap, grpo_config=GRPOConfig(enabled=True))
                 for overlap in (False, True)}


def test_grpo_ddp_is_megatron_ddp_when_grpo_is_off():
    results = {r["rank"]: r for r in spawn_ranks(_layouts, 2)}
    for stage, r in results.items():
        cases = [k for k in r if k.startswith("overlap=")] + ["disable_bucketing"]
        for case in cases:
            want = r[case]["megatron"]
            for variant, got in r[case].items():
                assert len(got[0][0]) == len(want[0][0]), (stage, case, variant, len(got[0][0]), len(want[0][0]))
                # Same bucket ranges and parameters, and the same ddp_config left behind.
                assert got == want, (stage, case, variant)
        assert "error" not in r, (stage, r["error"])
        # megatron's own rule, checked so the comparison above means something: one bucket
        # without overlap and on a stage after the first, ten with overlap on stage 0.
        assert len(r["overlap=False bucket_size=10000"]["megatron"][0][0]) == 1
        assert len(r["overlap=True bucket_size=10000"]["megatron"][0][0]) == (LAYERS if stage == 0 else 1)
        # GRPO on keeps one bucket per BUCKET elements everywhere (its tier units).
        for overlap, (buckets, _) in r["on"].items():
            assert len(buckets[0]) == LAYERS, (stage, overlap)
            assert [len(b[2]) for b in buckets[0]] == [2] * LAYERS  # weight and bias of one layer
