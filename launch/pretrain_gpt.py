"""Pretrain a GPT with megatron-core (baseline) or megatron-core + GRPO.

One process (CPU):
    python launch/pretrain_gpt.py --config launch/configs/tiny.yaml --data-path data/stdlib
One node, 2 ranks (CPU/gloo here, CUDA/NCCL on a GPU node): launch/run_local.sh, or
    torchrun --nproc_per_node 2 launch/pretrain_gpt.py --config launch/configs/tiny.yaml \
        --data-path data/stdlib --metrics-file runs/tiny.jsonl
Several nodes: sbatch launch/slurm/pretrain_gpt_grpo.sbatch (docs/launch.md).

Flags follow Megatron-LM names (--num-layers, --micro-batch-size, ...); --config FILE.yaml
sets any of them and explicit flags override the file. --help lists them all.
MEGATRON_GRPO_RANK_LOG=1 (set by the launch scripts) makes every rank print a progress line,
and with --grpo its tier map whenever it changes: metrics are written by one rank only, so
these lines are what shows that every node trained and agreed.
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank_log_hooks(cfg, who: str):
    """The run's hooks (baseline or GRPO), with per-rank log lines added."""
    from megatron_grpo.megatron import run_hooks

    hooks = run_hooks(cfg)
    inner, interval, last_map = hooks.step_metrics, cfg.logging.log_interval, [None]

    def say(text):  # one write per line: ranks sharing a terminal or job file do not interleave
        sys.stdout.write(f"[{who}] {text}\n")
        sys.stdout.flush()

    def step_metrics(iteration, wire, step_time):
        out = inner(iteration, wire, step_time)
        tier_map = out.get("grpo_tier_map")
        if tier_map is not None and tier_map != last_map[0]:
            # First line after start or resume too: it shows the map a checkpoint restored.
            say(f"iteration {iteration} tier map {tier_map}")
            last_map[0] = tier_map
        if iteration % interval == 0 or iteration == cfg.training.train_iters:
            say(f"iteration {iteration}/{cfg.training.train_iters} step {step_time:.3f} s "
                f"sent {wire['total']} B")
        return out

    hooks.step_metrics = step_metrics
    return hooks


# gloo errors that do not name gloo (its others carry their source path, .../gloo/transport/...).
# Seen when a peer hangs and the data-parallel group's timeout expires: the step waits on the
# overlapped gradient reduce-scatter's handle, which fails with this text (tests/reliability/test_hang.py).
GLOO_UNTAGGED = ("Application timeout caused pair closure",)


def _peer_failure(exc: BaseException):
    """A one-line description when ``exc`` is torch.distributed losing a peer, else None."""
    import torch.distributed as dist

    text = str(exc)
    if not (isinstance(exc, getattr(dist, "DistError", ())) or "gloo" in text or "NCCL" in text
            or any(marker in text for marker in GLOO_UNTAGGED)):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    peer = re.search(r"\[(\d+\.\d+\.\d+\.\d+)\]:\d+", text)  # gloo names the peer's address
    where = ""
    if peer:
        import socket

        try:
            where = f" (peer {peer.group(1)} = {socket.gethostbyaddr(peer.group(1))[0]})"
        except OSError:
            where = f" (peer {peer.group(1)})"
    return (f"peer failure{where}: another rank died or stopped responding; its own log names "
            f"the cause, this rank only saw: {first[:300]}")


def say_error(rank: str, message) -> None:
    """One line ``error (rank R on HOST): message`` on stderr, in ONE write. Every rank of a job
    shares torchrun's stderr, and print() writes the text and its newline separately when stderr
    is unbuffered (PYTHONUNBUFFERED=1, as the launchers set it): under load another rank's line
    then lands between them, and a log reader finds neither rank's line where it begins."""
    sys.stderr.flush()
    line = f"error (rank {rank}): {message}\n".encode("utf-8", "replace")
    while line:  # a pipe takes up to PIPE_BUF (4 KiB) bytes atomically; longer lines loop
        line = line[os.write(2, line):]


def main(argv=None) -> int:
    from megatron_grpo.training.arguments import ConfigError, parse_args
    from megatron_grpo.training.checkpointing import CheckpointError

    import socket

    rank = f"{os.environ.get('RANK', '0')} on {socket.gethostname()}"
    try:
        cfg = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as exc:
        say_error(rank, exc)
        return 2
    from megatron_grpo.megatron import run_hooks  # the launcher picks the hooks: baseline or GRPO
    from megatron_grpo.training.loop import run, shutdown

    try:
        per_rank_log = os.environ.get("MEGATRON_GRPO_RANK_LOG") == "1"
        run(cfg, _rank_log_hooks(cfg, f"rank {rank}") if per_rank_log else run_hooks(cfg))
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as exc:
        say_error(rank, exc)
        return 2
    except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
        message = _peer_failure(exc)
        if message is None:
            raise  # a bug, not a lost peer: keep the traceback
        say_error(rank, message)
        return 3
    shutdown()
    return 0


# Guarded: dist_checkpointing's save starts a spawn-based Manager that re-imports __main__.
if __name__ == "__main__":
    sys.exit(main())
