"""Train a small megatron-core GPT with GRPO: the library path, top to bottom.

GRPO here is Gradient-aware Resource Partitioning Optimization (not Group Relative Policy
Optimization). This script is what a megatron-core training script needs to add; everything
else is plain megatron-core 0.16.1. Run it with torchrun (2 gloo ranks on a CPU machine, NCCL
on GPUs):

    torchrun --nproc_per_node 2 examples/train_with_grpo.py
    torchrun --nproc_per_node 2 examples/train_with_grpo.py --iters 40 --summary-json run.json

The data is synthetic (each sample counts upwards modulo the vocabulary from a random start),
so it needs no files and the loss falls within a few steps. With the default short schedule
(--warmup 4: four exact steps, then tiers) the tier map is printed when it changes, and every
step prints its loss and the gradient-sync bytes this rank sent. launch/pretrain_gpt.py does
the same with real data, checkpoints, evaluation and metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# Not needed after `pip install -e .`; lets the script run from a plain checkout too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

# 1. The platform comes first, before anything imports megatron: CUDA + NCCL when a GPU is
#    usable, otherwise megatron-grpo's CPU mode (megatron-core on CPU, gloo collectives).
from megatron_grpo.platform import select_platform


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=16, help="training iterations")
    p.add_argument("--warmup", type=int, default=4, help="exact steps before the first tiering "
                   "(GRPOConfig.warmup_iters; real runs use ~100)")
    p.add_argument("--stable-interval", type=int, default=2, help="GRPOConfig.stable_interval")
    p.add_argument("--stable-share", type=float, default=0.2, help="GRPOConfig.stable_share: 0 "
                   "by default there (the quality front of docs/grpo.md); on here so the example shows all three tiers")
    p.add_argument("--compress", default="all", help="GRPOConfig.compress: all here, so the "
                   "demo shows the compressed sync on localhost, where auto (the default of "
                   "real runs) measures that it does not pay and syncs exactly")
    p.add_argument("--bucket-mb", type=float, default=0.04, help="tier unit size in MB "
                   "(GRPOConfig.bucket_mb; 128 on real models)")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step and rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu", action="store_true", help="CPU mode even where CUDA is available")
    p.add_argument("--summary-json", default=None,
                   help="rank 0 writes losses, bytes and tier maps per step here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    vocab = 256

    # 1. (continued) Platform, then torch.distributed. torchrun sets RANK/WORLD_SIZE/MASTER_*.
    platform = select_platform(force_cpu=args.cpu, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(platform.backend)

    # megatron-core and megatron-grpo's glue are imported after the platform is chosen.
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.comm.wire import wire_counter
    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.megatron import (GRPODistributedDataParallel, get_grpo_optimizer,
                                        grpo_optimizers, install)

    # 2. megatron's process groups (here: data parallel only) and seeds.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank = dist.get_rank(dp_group)

    # 3. A small GPTModel with megatron's local (non-transformer-engine) layer spec. The fused
    #    kernels need CUDA/apex, so they are off here; on GPUs with transformer-engine use
    #    get_gpt_layer_with_transformer_engine_spec() and the fusions as usual.
    tf_config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=4,
        use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        cuda_graph_scope=[])    # megatron 0.16.1's default "full" only warns that it is deprecated
    gpt = GPTModel(config=tf_config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=vocab, max_sequence_length=args.seq_length)
    if not platform.cpu_mode:
        gpt = gpt.to(platform.device)

    # 4. GRPO settings (the same fields as the --grpo-* flags of launch/pretrain_gpt.py), short
    #    schedules so that tiers appear within a few steps.
    grpo = GRPOConfig(enabled=True, compress=args.compress, bucket_mb=args.bucket_mb,
                      warmup_iters=args.warmup, retier_interval=8, stable_interval=args.stable_interval,
                      gvr_interval=args.stable_interval, stable_share=args.stable_share,
                      dynamic_share=0.85 - args.stable_share)
    grpo.validate(dist.get_world_size())

    # 5. megatron DDP, with GRPO's subclass and one DDP bucket per tier unit. GRPO needs the
    #    distributed optimizer and overlapped gradient reduction (buckets report when ready).
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        bucket_size=grpo.bucket_elements)
    model = GRPODistributedDataParallel(tf_config, ddp_config, gpt, grpo_config=grpo)

    # 6. The optimizer: get_grpo_optimizer is megatron's get_megatron_optimizer with GRPO's
    #    DistributedOptimizer subclass.
    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, clip_grad=1.0,
                                 use_distributed_optimizer=True)
    optimizer = get_grpo_optimizer(opt_config, [model])

    # 7. The controller (tiers, schedule, monitors) for this data-parallel replica, installed
    #    into the DDP bucket groups and bound to every GRPO optimizer megatron built.
    ctrl = GRPOController(grpo, [model], platform.device, dp_group)
    install([model], ctrl)
    for opt in grpo_optimizers(optimizer):
        opt.bind(ctrl)

    # 8. The settings megatron-core's schedules read from the TransformerConfig, as for any
    #    megatron DDP model. finalize_model_grads_func waits for the gradient sync that backward
    #    started (without it the optimizer reads unsynchronised gradients and the second step
    #    fails: "Should not have multiple communication calls outstanding at once");
    #    no_sync_func keeps the sync for the last micro-batch; grad_scale_func scales the loss.
    tf_config.no_sync_func = model.no_sync
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.grad_scale_func = optimizer.scale_loss

    # Synthetic batches: each sample counts upwards from a random start (mod vocab). Rank r of
    # the data-parallel group draws its own samples.
    gen = torch.Generator().manual_seed(args.seed + 1000 * dp_rank)
    positions = torch.arange(args.seq_length + 1)
    causal_mask = (torch.tril(torch.ones(1, 1, args.seq_length, args.seq_length)) < 0.5)
    causal_mask = causal_mask.to(platform.device)     # True = masked out (megatron's convention)

    def batches():
        while True:
            start = torch.randint(0, vocab, (args.micro_batch_size, 1), generator=gen)
            seq = (start + positions) % vocab
            yield {"tokens": seq[:, :-1], "labels": seq[:, 1:],
                   "position_ids": positions[:-1].expand(args.micro_batch_size, -1)}

    def forward_step(data_iterator, chunk):
        batch = {k: v.to(platform.device) for k, v in next(data_iterator).items()}
        output = chunk(batch["tokens"], batch["position_ids"], causal_mask, labels=batch["labels"])

        def loss_func(per_token_loss):
            loss = per_token_loss.float().sum()
            tokens = torch.tensor(per_token_loss.numel(), dtype=torch.int, device=loss.device)
            return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    data = batches()
    counter = wire_counter()          # counts the bytes of every torch.distributed collective
    counter.reset()
    records, last_map = [], None

    # 9. The loop: megatron's forward_backward and optimizer.step between the controller's
    #    begin_step(iteration) (iterations done so far) and end_step().
    for iteration in range(args.iters):
        t0 = time.perf_counter()
        ctrl.begin_step(iteration)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        results = forward_backward(
            forward_step_func=forward_step, data_iterator=data, model=[model],
            num_microbatches=args.micro_batches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        update_ok, grad_norm, _ = optimizer.step()
        ctrl.end_step()
        step_time = time.perf_counter() - t0
        sent = counter.reset()        # this step's gradient and parameter sync

        totals = torch.stack([r["lm loss"] for r in results]).sum(0)
        with counter.tag("logging"):  # loss bookkeeping, kept apart from gradient traffic
            dist.all_reduce(totals, group=dp_group)
        counter.reset()
        loss = (totals[0] / totals[1]).item()
        m = ctrl.metrics(sent["by_tag"], step_time)
        record = {"iteration": iteration + 1, "loss": loss, "bytes": sent["total"],
                  "bytes_by_tier": {t: m[f"wire_bytes_{t}"] for t in ("core", "dynamic", "stable")},
                  "tier_map": m["grpo_tier_map"], "tiered": m["grpo_tiered"],
                  "stable_update": m["grpo_stable_update"], "step_time_s": step_time,
                  "update_successful": bool(update_ok)}
        records.append(record)
        if dist.get_rank() == 0:
            if m["grpo_tier_map"] != last_map:
                print(f"iteration {iteration + 1}: tier map {m['grpo_tier_map']} "
                      f"(c = core, d = dynamic, s = stable; one letter per DDP bucket)", flush=True)
                last_map = m["grpo_tier_map"]
            print(f"iteration {iteration + 1:3d}  loss {loss:.4f}  sent {sent['total']:>9,d} bytes"
                  f"  ({step_time:.2f} s)", flush=True)

    if dist.get_rank() == 0:
        warm = [r["bytes"] for r in records if not r["tiered"]]
        tiered = [r["bytes"] for r in records if r["tiered"]]
        summary = {
            "world_size": dist.get_world_size(), "units": len(ctrl.units),
            "tier_map": ctrl.metrics({}, 1.0)["grpo_tier_map"], "shares": ctrl.shares(),
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
            "warmup_bytes_per_step": sum(warm) / len(warm) if warm else None,
            "tiered_bytes_per_step": sum(tiered) / len(tiered) if tiered else None,
            "records": records,
        }
        ratio = (f"{summary['tiered_bytes_per_step'] / summary['warmup_bytes_per_step']:.3f}"
                 if warm and tiered else "n/a")
        print(f"done: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, "
              f"tier map {summary['tier_map']}, bytes per step after tiering / exact warm-up "
              f"= {ratio}", flush=True)
        if args.summary_json:
            with open(args.summary_json, "w") as fh:
                json.dump(summary, fh, indent=1)
        if not all(math.isfinite(r["loss"]) for r in records):
            raise SystemExit("error: non-finite loss")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
