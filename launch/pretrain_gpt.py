"""Pretrain a GPT with megatron-core (baseline) or megatron-core + GRPO.

One process (CPU):
    python launch/pretrain_gpt.py --config launch/configs/tiny.yaml --data-path data/stdlib
One node, 2 ranks (CPU/gloo here, CUDA/NCCL on a GPU node):
    torchrun --nproc_per_node 2 launch/pretrain_gpt.py --config launch/configs/tiny.yaml \
        --data-path data/stdlib --metrics-file runs/tiny.jsonl
Two nodes: see launch/slurm/ (one srun task per node, torchrun c10d rendezvous).

Flags follow Megatron-LM names (--num-layers, --micro-batch-size, ...); --config FILE.yaml
sets any of them and explicit flags override the file. --help lists them all.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from megatron_grpo.training.arguments import ConfigError, parse_args
    from megatron_grpo.training.checkpointing import CheckpointError

    import socket

    rank = f"{os.environ.get('RANK', '0')} on {socket.gethostname()}"
    try:
        cfg = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2
    from megatron_grpo.training.loop import run, shutdown

    try:
        run(cfg)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2
    shutdown()
    return 0


# Guarded: dist_checkpointing's save starts a spawn-based Manager that re-imports __main__.
if __name__ == "__main__":
    sys.exit(main())
