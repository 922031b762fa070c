"""Launch-time helpers shared by launch/slurm/*.sbatch, launch/slurm/node_task.sh and
launch/run_local.sh, so that shell scripts never parse training flags themselves.

    job_setup.py plan --world-size N -- TRAINING FLAGS...
        Validates the flags exactly as launch/pretrain_gpt.py will (same parser, same YAML
        precedence) and prints shell assignments (GRPO_TP=2 ...) for `eval`, among them the
        CUDA_DEVICE_MAX_CONNECTIONS decision the launchers apply. It builds no model and
        imports no megatron-core (~1.5 s of CPU), so a bad flag fails before any node starts.
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
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def cuda_max_connections(cfg, environ=None):
    """The CUDA_DEVICE_MAX_CONNECTIONS decision for this job (export, why, warning): 1 where
    megatron-core relies on it (TP > 1), unset at TP = 1, and a value the user exported kept
    as given. The rule and its reasons: megatron_grpo.training.cuda_settings.cuda_max_connections
    (training checks the same rule at start-up); costs: docs/launch.md."""
    from megatron_grpo.training.cuda_settings import cuda_max_connections as rule

    return rule(cfg.parallel.tensor_model_parallel_size,
                os.environ if environ is None else environ, cfg.grpo.enabled)


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
    conn = cuda_max_connections(cfg)
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
        # The launchers export GRPO_CUDA_MAX_CONNECTIONS when non-empty (never over a value the
        # user set: then it is empty) and print the warning in cuda mode.
        "GRPO_CUDA_MAX_CONNECTIONS": conn.export or "",
        "GRPO_CUDA_MAX_CONNECTIONS_WHY": conn.why,
        "GRPO_CUDA_MAX_CONNECTIONS_WARNING": conn.warning or "",
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
