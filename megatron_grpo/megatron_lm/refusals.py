"""Megatron-LM options GRPO does not carry, refused before anything is built.

Each refusal is one line naming the flag, why GRPO cannot run with it, and what to give instead.
They are checked right after Megatron-LM validated its arguments, before distributed
initialisation, so a refused run costs seconds and leaves nothing behind.
"""

from __future__ import annotations

from typing import List

from megatron_grpo.grpo.config import ConfigError


def _cuda_graphs(args) -> bool:
    impl = getattr(args, "cuda_graph_impl", None)
    return (impl not in (None, "none")) or bool(getattr(args, "enable_cuda_graph", False)) \
        or bool(getattr(args, "external_cuda_graph", False))


def problems(args, grpo, offload) -> List[str]:
    """Every reason this Megatron-LM configuration cannot run with GRPO (empty: it can)."""
    if not grpo.enabled:
        if offload.target != "none":
            return [f"--grpo-offload {offload.target} places GRPO's stable tier: it needs --grpo"]
        return []
    out = []
    if not getattr(args, "use_distributed_optimizer", False):
        out.append("--grpo runs inside megatron's distributed optimizer: add --use-distributed-optimizer")
    if not getattr(args, "overlap_grad_reduce", False):
        out.append("--grpo needs gradient buckets, and without --overlap-grad-reduce Megatron-LM "
                   "makes none: add --overlap-grad-reduce")
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        out.append("--grpo lives in megatron's DistributedDataParallel, not FSDP: drop "
                   "--use-torch-fsdp2 / --use-megatron-fsdp")
    if getattr(args, "overlap_param_gather", False):
        out.append("--overlap-param-gather: GRPO gathers parameters per tier after the optimizer "
                   "step (quantised deltas), not in the next forward; drop the flag")
    if "muon" in str(getattr(args, "optimizer", "adam")):
        out.append(f"--optimizer {args.optimizer}: GRPO's tiers shard Adam's state by bucket; "
                   f"Muon orthogonalises whole matrices. Use --optimizer adam")
    if getattr(args, "rerun_mode", "disabled") == "validate_results":
        out.append("--rerun-mode validate_results (Megatron-LM's default) re-runs a suspect step "
                   "to compare results, but GRPO's error feedback has moved on, so the re-run "
                   "differs and a healthy step looks faulty: add --rerun-mode disabled")
    if getattr(args, "fp16", False):
        out.append("--fp16: GRPO's non-finite check replaces the loss scaler's and runs in bf16 "
                   "or fp32; use --bf16")
    if grpo.sampled_backward and _cuda_graphs(args):
        out.append("--grpo-sampled-backward samples different rows each step, which a captured "
                   "CUDA graph replays unchanged: drop the CUDA graph flags or the sampled backward")
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 1 and not getattr(args, "untie_embeddings_and_output_weights", False):
        out.append("--grpo with tied embeddings and --pipeline-model-parallel-size > 1: the two "
                   "stages' copies would be tiered apart; add --untie-embeddings-and-output-weights")
    if grpo.periodic and getattr(args, "num_distributed_optimizer_instances", 1) == 1:
        out.append("GRPO's periodic tiers train locally inside a distributed-optimizer instance: "
                   "add --num-distributed-optimizer-instances N > 1")
    return out


def check(args, grpo, offload, rank: int) -> None:
    """Raise ConfigError listing every problem, one line each, naming the rank."""
    found = problems(args, grpo, offload)
    if found:
        raise ConfigError(f"rank {rank}: this Megatron-LM run cannot start with GRPO:\n  "
                          + "\n  ".join(found))
