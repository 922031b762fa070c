"""Launch-time helpers shared by launch/slurm/*.sbatch, launch/slurm/node_task.sh and
launch/run_local.sh, so that shell scripts never parse training flags themselves.

    job_setup.py plan --world-size N -- TRAINING FLAGS...
        Validates the flags exactly as launch/pretrain_gpt.py will (same parser, same YAML
        precedence) and prints shell assignments (GRPO_TP=2 ...) for `eval`. Runs in ~0.1 s:
        it imports neither torch nor megatron, so a bad flag fails before any node starts.
    job_setup.py build-cache --cache-dir DIR --world-size N -- TRAINING FLAGS...
        Builds megatron's dataset index cache (document/sample/shuffle indices) in DIR in one
        process. megatron-core builds that cache on global rank 0 only and has every other rank
        read it back after a barrier, which works only when DIR is shared: with node-local
        caches each node builds its own copy first, and training then finds a cache hit.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def cuda_max_connections(cfg) -> Tuple[Optional[str], str]:
    """(value or None to leave unset, why) for CUDA_DEVICE_MAX_CONNECTIONS.

    megatron-core 0.16.1 (tensor_parallel/layers.py) issues the tensor-parallel all-reduce of
    input gradients (TP > 1) and, with sequence parallelism, the all-gather / reduce-scatter
    asynchronously and "relies on CUDA_DEVICE_MAX_CONNECTIONS=1" so the GPU runs them before
    the weight-gradient GEMM; it warns when the variable is not 1. Without TP nothing needs that
    ordering, and one hardware queue would only serialise data-parallel bucket communication
    behind compute. (parallel_state.py asserts the opposite, != 1, for a UCC pipeline backend,
    which this project does not use.) This project exposes no sequence-parallel flag, so TP
    decides.
    """
    tp = cfg.parallel.tensor_model_parallel_size
    if tp > 1:
        return "1", (f"TP={tp}: megatron-core overlaps the tensor-parallel gradient all-reduce with "
                     f"the weight-gradient GEMM and needs kernels in issue order")
    return None, "TP=1: no tensor-parallel overlap needs kernel ordering (left unset)"


def _parse(world_size: int, argv: List[str]):
    from megatron_grpo.training.arguments import ConfigError, parse_args

    try:
        return parse_args(argv, world_size=world_size)
    except ConfigError as exc:
        print(f"error (job setup on {os.uname().nodename}): {exc}", file=sys.stderr)
        sys.exit(2)


def plan(world_size: int, argv: List[str]) -> None:
    cfg = _parse(world_size, argv)
    from megatron_grpo.data import parse_data_prefix

    prefixes, _ = parse_data_prefix(cfg.data.data_path)
    value, why = cuda_max_connections(cfg)
    out = {
        "GRPO_TP": cfg.parallel.tensor_model_parallel_size,
        "GRPO_PP": cfg.parallel.pipeline_model_parallel_size,
        "GRPO_DP": world_size // (cfg.parallel.tensor_model_parallel_size
                                  * cfg.parallel.pipeline_model_parallel_size),
        "GRPO_ENABLED": int(cfg.grpo.enabled),
        "GRPO_FORCE_CPU": int(cfg.training.cpu),
        "GRPO_SAVE": cfg.checkpoint.save or "",
        "GRPO_LOAD": cfg.checkpoint.load or "",
        "GRPO_DATA_PREFIXES": " ".join(prefixes),
        "GRPO_DATA_CACHE_DIR": cfg.data.data_cache_dir or "",
        "GRPO_TRAIN_ITERS": cfg.training.train_iters,
        "GRPO_CUDA_MAX_CONNECTIONS": value or "",
        "GRPO_CUDA_MAX_CONNECTIONS_WHY": why,
    }
    for key, val in out.items():
        print(f"{key}={shlex.quote(str(val))}")


def build_cache(cache_dir: str, world_size: int, argv: List[str]) -> None:
    cfg = _parse(world_size, argv)
    import torch.distributed as dist

    from megatron_grpo.training.loop import build_run_datasets

    os.makedirs(cache_dir, exist_ok=True)
    # megatron's BlendedDataset calls torch.distributed.get_rank() unguarded, so a blend needs a
    # process group; a 1-rank FileStore group touches no network.
    store = os.path.join(cache_dir, f".build-store.{os.getpid()}")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        # The same call as a run: the cache files are named by a hash of the requested sizes.
        build_run_datasets(cfg, cache_dir=cache_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error (data cache on {os.uname().nodename}): {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        dist.destroy_process_group()
        if os.path.exists(store):
            os.remove(store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("plan", "build-cache"))
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--cache-dir", default=None)
    if "--" not in sys.argv:
        parser.error("put the training flags after '--'")
    cut = sys.argv.index("--")
    args = parser.parse_args(sys.argv[1:cut])
    training = sys.argv[cut + 1:]
    if args.command == "plan":
        plan(args.world_size, training)
    else:
        if not args.cache_dir:
            parser.error("build-cache needs --cache-dir")
        build_cache(args.cache_dir, args.world_size, training)


if __name__ == "__main__":
    main()
