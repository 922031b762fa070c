"""Training flags of the device check's runs: the models, GRPO's schedule and the planner call
that predicts their bytes and memory.

On the device, phases b-d train launch/configs/tiny.yaml (~0.9 M parameters) in bf16 and phase
e a ~300 M GPT (24 layers, hidden 1024, seq 1024); the CPU dry run trains a smaller model
(tests/harness.py's SMALL_MODEL shape) for fewer iterations. Every GRPO run has all three tiers
(the stable share defaults to 0, so it is given) and compressed core and dynamic tiers.
"""

from __future__ import annotations

import importlib.util
import os
from typing import List

from .common import ROOT

# 2 layers, hidden 96 (megatron pads parameter starts: the byte rules see padding), seq 64.
SMALL = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "4", "--ddp-bucket-size", "20000",
         "--log-interval", "1000", "--seed", "7"]
TINY = ["--config", "launch/configs/tiny.yaml", "--log-interval", "8"]
BIG = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
       "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "8",
       "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "5", "--log-interval", "5"]
THREE_TIERS = ["--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.65",
               "--grpo-stable-share", "0.2", "--grpo-max-dynamic-share", "0.7"]
OFFLOAD = ["--grpo-offload", "cpu", "--grpo-offload-chunk-mb", "0.25"]
BYTE_VOCAB = 258  # the byte tokenizer of the default corpus
# cuBLAS picks the same kernels run to run with a fixed workspace: the bit-for-bit comparisons of
# phases b-d need it (phase e times steps and leaves cuBLAS alone).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def iters(cpu: bool) -> int:
    return 10 if cpu else 24


def warmup(cpu: bool) -> int:
    return 4 if cpu else 8


def model(cpu: bool, train_iters: int) -> List[str]:
    """The small bf16 model of phases b-d, ``train_iters`` iterations, evaluation at the end."""
    return [*(SMALL if cpu else TINY), "--bf16", "--train-iters", str(train_iters),
            "--eval-interval", str(train_iters), "--eval-iters", "2"]


def grpo(cpu: bool) -> List[str]:
    """GRPO with the three tiers: exact warm-up, then re-tier every 8, stable update every 4,
    a monitoring (health) step every 4."""
    return ["--grpo", "--grpo-warmup-iters", str(warmup(cpu)), "--grpo-retier-interval", "8",
            "--grpo-stable-interval", "4", "--grpo-gvr-interval", "4", "--grpo-importance-interval", "1",
            *THREE_TIERS, *(["--grpo-bucket-mb", "0.04"] if cpu else [])]


def big(train_iters: int = 20) -> List[str]:
    return [*BIG, "--bf16", "--train-iters", str(train_iters), "--eval-interval", str(train_iters),
            "--eval-iters", "0"]


BIG_GRPO = ["--grpo", "--grpo-bucket-mb", "16", "--grpo-warmup-iters", "6", "--grpo-retier-interval", "10",
            "--grpo-stable-interval", "5", "--grpo-gvr-interval", "4", *THREE_TIERS]


def bucket_elements(args: List[str], world_size: int) -> int:
    """GRPO's unit size in elements for these flags (a baseline given it as --ddp-bucket-size has
    GRPO's bucket layout, so both sum gradient norms in the same order)."""
    from megatron_grpo.training.arguments import parse_args

    return parse_args([*args, "--data-path", "unused"], world_size=world_size).grpo.bucket_elements


def plan_cli():
    """launch/plan.py as a module (it reads training flags exactly as the planner CLI does)."""
    spec = importlib.util.spec_from_file_location("gpu_check_plan_cli", os.path.join(ROOT, "launch", "plan.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plan_inputs(args: List[str], nodes: int, gpus_per_node: int, attention: str = "unfused"):
    """(ModelSpec, ClusterSpec, GRPOConfig, ddp bucket size) of a run's flags."""
    model_spec, cluster, grpo_cfg, bucket, _ = plan_cli().spec_from_flags(
        args, nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_gb=141.0, link_gbps=100.0,
        vocab=BYTE_VOCAB, attention=attention)
    return model_spec, cluster, grpo_cfg, bucket
