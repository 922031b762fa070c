"""--grpo-memory-budget-gb: the memory tier's placement chosen from the planner's prediction.

Before the model is built, the planner (megatron_grpo.planner.plan, held to the measured model state
and activations by tests/multiproc/test_planner_measured.py) predicts this rank's peak for each
placement in tier order, and the first that fits the budget is used:

1. ``resident``: nothing moves (no chunk store, no SSD file);
2. ``stable``: the lowest tier leaves first: the stable tier's masters and moments between its
   updates, and the delayed stable tier's gradient sums (--no-grpo-offload-stream). Its update
   steps hold its masters and moments, so this lowers the peak by the sums only (delayed mode,
   the default; with frozen or compressed stable units it plans the resident peak, and
   ``resident`` is taken first);
3. ``stream``: the dynamic and stable tiers' fp32 masters and Adam moments live away and pass
   through the optimizer step a unit at a time (--grpo-offload-stream);
4. ``stream+residuals``: their error-feedback residuals live away too (--grpo-offload-residuals);
5. ``stream+residuals+grads``: and their gradient shards, from their sync to their update
   (--grpo-offload-grads).

Core state stays resident at every level.

The peak is the planner's total (model state + activations) plus what the process holds
before the model exists: on CPU the resident set at this point (interpreter, torch, megatron,
data), on CUDA the memory already allocated on the device. The planner's part is that of the
stage with the most memory; the held part is this rank's own, so ranks may choose different
levels. That is safe: placement issues no collective (docs/offload.md); the metrics record
carries the choice of the rank that writes it, and rank 0 prints its own.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

LEVELS: List[Tuple[str, Dict]] = [
    ("resident", {"target": "none"}),
    ("stable", {"stream": False, "residuals": False, "grads": False}),
    ("stream", {"stream": True, "residuals": False, "grads": False}),
    ("stream+residuals", {"stream": True, "residuals": True, "grads": False}),
    ("stream+residuals+grads", {"stream": True, "residuals": True, "grads": True}),
]
GB = 1e9


def model_spec(cfg, vocab: int, attention: str):
    """The planner's ModelSpec of a training config (also launch/plan.py's)."""
    from megatron_grpo.planner.plan import ModelSpec

    m, t = cfg.model, cfg.training
    return ModelSpec(num_layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                     ffn_hidden=m.ffn_hidden_size, vocab=vocab, seq_length=m.seq_length,
                     micro_batch_size=t.micro_batch_size, bf16=t.bf16,
                     max_position=m.max_position_embeddings,
                     make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
                     flash_attention=attention == "flash",
                     dropout=m.hidden_dropout > 0 or m.attention_dropout > 0,
                     num_query_groups=m.num_query_groups, swiglu=m.swiglu,
                     rmsnorm=m.normalization == "RMSNorm", rope=m.position_embedding_type == "rope",
                     bias_linear=not m.disable_bias_linear,
                     recompute_granularity=m.recompute_granularity,
                     recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers,
                     global_batch_size=t.global_batch_size,
                     overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                     sequence_parallel=cfg.parallel.sequence_parallel)


def spec_from_flags(train_argv: Sequence[str], nodes: int, gpus_per_node: int, gpu_memory_gb: float,
                    link_gbps: float, vocab: int = 128256, attention: str = "flash",
                    nvlink_gbps: float = 3600.0):
    """(ModelSpec, ClusterSpec, GRPOConfig, ddp bucket size, OffloadConfig) from training
    flags/--config, read as launch/pretrain_gpt.py reads them (launch/plan.py, the benchmarks)."""
    from megatron_grpo.planner.plan import ClusterSpec
    from megatron_grpo.training.arguments import parse_args

    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if value <= 0:  # checked first: the training parser divides by the world size
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    # --data-path is required by the training parser but irrelevant to the plan.
    cfg = parse_args([*train_argv, "--data-path", "unused-by-the-planner"],
                     world_size=nodes * gpus_per_node)
    model = model_spec(cfg, vocab, attention)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=gpu_memory_gb,
                          link_gbps=link_gbps, tp=cfg.parallel.tensor_model_parallel_size,
                          pp=cfg.parallel.pipeline_model_parallel_size, nvlink_gbps=nvlink_gbps,
                          instances=cfg.parallel.num_distributed_optimizer_instances)
    return model, cluster, cfg.grpo, cfg.parallel.ddp_bucket_size, cfg.offload


@dataclass
class BudgetChoice:
    """What the budget chose and why; its metrics go into every step's record."""

    budget_bytes: int
    base_bytes: int
    """Held before the model exists (CPU: resident set; CUDA: allocated device memory)."""
    predicted: List[Tuple[str, int]]
    """(level, predicted peak bytes) for every level, in tier order."""
    level: str

    @property
    def planned_bytes(self) -> int:
        return dict(self.predicted)[self.level]

    def metrics(self) -> Dict:
        return {"grpo_memory_budget_bytes": self.budget_bytes, "grpo_memory_level": self.level,
                "grpo_memory_planned_bytes": self.planned_bytes}

    def levels(self) -> str:
        peaks = ", ".join(f"{name} {_size(peak)}" for name, peak in self.predicted)
        return f"planned peaks per rank: {peaks}; {_size(self.base_bytes)} held before the model"

    def describe(self) -> str:
        return (f"--grpo-memory-budget-gb {self.budget_bytes / GB:g}: placement '{self.level}' "
                f"({self.levels()})")


def _size(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB else f"{nbytes / 1e6:.1f} MB"


def choose(cfg, vocab: int, attention: str, world_size: int, base_bytes: int, rank: int = 0):
    """(the OffloadConfig to run with, BudgetChoice). Raises ConfigError when even the last
    level's predicted peak is above the budget, naming the flag, the rank and what to change."""
    from megatron_grpo.planner.plan import ClusterSpec, plan
    from megatron_grpo.training.arguments import ConfigError

    off = cfg.offload
    budget = int(round(off.memory_budget_gb * GB))
    model = model_spec(cfg, vocab, attention)
    p = cfg.parallel
    cluster = ClusterSpec(nodes=1, gpus_per_node=world_size, tp=p.tensor_model_parallel_size,
                          pp=p.pipeline_model_parallel_size)
    predicted, configs = [], {}
    for name, changes in LEVELS:
        candidate = dataclasses.replace(off, **changes)
        configs[name] = candidate
        mem = plan(model, cluster, cfg.grpo, bucket_size=p.ddp_bucket_size, offload=candidate).grpo_memory
        predicted.append((name, base_bytes + mem.total))
    for name, peak in predicted:
        if peak <= budget:
            return configs[name], BudgetChoice(budget, base_bytes, predicted, name)
    levels = BudgetChoice(budget, base_bytes, predicted, LEVELS[-1][0]).levels()
    raise ConfigError(
        f"rank {rank}: --grpo-memory-budget-gb {off.memory_budget_gb:g} (OffloadConfig."
        f"memory_budget_gb): no placement fits ({levels}). Raise --grpo-memory-budget-gb, add data-parallel ranks "
        f"(optimizer state is sharded over them), lower --micro-batch-size (activations) or "
        f"--grpo-core-share (core state stays resident)")


def current_base_bytes(platform) -> int:
    """What the process holds now, before the model: see the module docstring."""
    if not platform.cpu_mode:
        import torch

        return int(torch.cuda.memory_allocated())
    with open("/proc/self/statm") as fh:  # fields: size, resident (pages), ...
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
