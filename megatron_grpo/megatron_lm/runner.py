"""Run a Megatron-LM training script (``pretrain_gpt.py`` and its siblings, unmodified) with
GRPO's flags, classes and per-step hooks in place.

    python -m torch.distributed.run --nproc_per_node N -m megatron_grpo.megatron_lm \\
        PATH/pretrain_gpt.py [Megatron-LM flags] --grpo [GRPO flags]

Order matters: CPU mode first (before megatron builds anything), then the flags chained into
Megatron-LM's parser, then the script as ``__main__``. GRPO's classes go in place when Megatron-LM
has validated its arguments and the runner's refusals passed, before distributed start-up.
Without --grpo the script runs as it would alone (plus the metrics file when asked).
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
from types import SimpleNamespace
from typing import List

USAGE = ("usage: python -m megatron_grpo.megatron_lm PATH/pretrain_gpt.py [Megatron-LM flags] "
         "[--grpo ...]")


_RUN = {"hooks": None}  # GRPO's hooks once built, for finish() when the script ends


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def run_config(args, grpo, offload) -> SimpleNamespace:
    """The slice of the project's PretrainConfig that GRPO's hooks read, from Megatron-LM's args."""
    return SimpleNamespace(
        grpo=grpo, offload=offload,
        training=SimpleNamespace(train_iters=args.train_iters, seed=args.seed,
                                 global_batch_size=args.global_batch_size),
        model=SimpleNamespace(num_layers=args.num_layers, seq_length=args.seq_length,
                              hidden_size=args.hidden_size),
        parallel=SimpleNamespace(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size))


def _after_validate(args) -> None:
    """Megatron-LM's arguments are final: refuse what GRPO cannot carry, then put its classes
    and step hooks in place."""
    from megatron_grpo.grpo.config import ConfigError
    from megatron_grpo.megatron_lm import flags, refusals, steps

    grpo, offload, runner = flags.settings(args, getattr(args, "world_size", None))
    refusals.check(args, grpo, offload, _rank())
    hooks = None
    if grpo.enabled:
        if not args.train_iters:
            raise ConfigError(f"rank {_rank()}: GRPO's schedule counts iterations: give --train-iters "
                              f"instead of --train-samples")
        from megatron_grpo.megatron import grpo_hooks, lm_points

        hooks = _RUN["hooks"] = grpo_hooks(run_config(args, grpo, offload))
        replaced = lm_points.install(grpo, lambda chunks, opt: hooks.after_build(
            SimpleNamespace(ddp_model=chunks, optimizer=opt)), _rank())
        if _rank() == 0:
            print(f"[megatron_grpo] GRPO in place at {', '.join(replaced)}", flush=True)
    from megatron_grpo.megatron_lm import checkpoints
    from megatron_grpo.platform import cpu_mode_active

    if grpo.enabled or cpu_mode_active():
        checkpoints.install(hooks, cpu_mode_active())
    if grpo.enabled or runner.metrics_file:
        # megatron's buffer module binds the collectives at import: import it first, then count.
        import megatron.core.distributed.param_and_grad_buffer  # noqa: F401
        from megatron_grpo.comm.wire import wire_counter

        steps.install(hooks, runner.metrics_file, "grpo" if grpo.enabled else "baseline",
                      wire_counter())


def install_arguments() -> None:
    """Chain GRPO's flags into Megatron-LM's parser and its checks after Megatron-LM's own."""
    from megatron.training import arguments

    from megatron_grpo.megatron_lm import flags

    add_original = arguments.add_megatron_arguments

    @functools.wraps(add_original)
    def add_megatron_arguments(parser):
        return flags.add_arguments(add_original(parser))

    arguments.add_megatron_arguments = add_megatron_arguments
    validate_original = arguments.validate_args
    done = []

    @functools.wraps(validate_original)
    def validate_args(args, *a, **kw):
        out = validate_original(args, *a, **kw)
        if not done:  # 0.16.1 reaches it through initialize.py's own import as well
            done.append(True)
            _after_validate(args)
        return out

    arguments.validate_args = validate_args
    try:
        from megatron.training import initialize
    except ImportError:
        return
    if getattr(initialize, "validate_args", None) is validate_original:
        initialize.validate_args = validate_args


def main(argv: List[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"error (megatron_grpo.megatron_lm): no script at {argv[0]}\n{USAGE}", file=sys.stderr)
        return 2
    from megatron_grpo.platform import select_platform

    platform = select_platform(local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    from megatron_grpo.grpo.config import ConfigError
    from megatron_grpo.megatron_lm import wheel

    rest = list(argv[1:])
    wheel.install()
    if platform.cpu_mode:
        from megatron_grpo.megatron_lm import cpu

        rest = cpu.install(rest)
    install_arguments()
    sys.argv = [script] + rest
    sys.path.insert(0, os.path.dirname(script))  # the script's own imports (gpt_builders, ...)
    try:
        runpy.run_path(script, run_name="__main__")
    except ConfigError as exc:
        print(f"error (megatron_grpo): {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if _RUN["hooks"] is not None:
            # The memory tier's background workers stop and its files go, however the script
            # ended (Megatron-LM ends --exit-interval runs with sys.exit).
            _RUN["hooks"].finish()
    return 0
