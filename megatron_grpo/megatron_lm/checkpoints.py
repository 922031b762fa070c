"""Megatron-LM's save and load with GRPO's own state beside the checkpoint, and the CPU load fix.

Megatron-LM checkpoints hold the model, the optimizer and the schedule; GRPO's state (tiers,
importance, error-feedback residuals, per-parameter Adam steps) lives outside them. The runner
wraps ``megatron.training.training.save_checkpoint``/``load_checkpoint`` (the names ``train`` and
``setup_model_and_optimizer`` call, 0.16.1-0.19.x): after megatron saved iteration N, GRPO's
common state goes to ``iter_000000N/grpo_state/common.pt`` (rank 0) and each rank's to
``rank_NNNNN.pt`` beside it, written to a temporary name and renamed, so a file is whole or
absent; after megatron loaded, they are read back. A checkpoint without them (saved without
--grpo, or a job stopped between megatron's save and GRPO's files) starts GRPO's state fresh, and
the runner says so.

CPU only: without apex or transformer-engine, megatron's DistributedOptimizer.state_dict asserts
that every parameter has one Adam ``step``, and a freshly built torch Adam has no state at all,
so Megatron-LM cannot build its load template (megatron's own run fails the same way). Zero
state is filled in first and the per-parameter steps rebuilt after, by the project's own loop's
functions (megatron_grpo.training.checkpointing); the load runs without autograd (below).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from megatron_grpo.training.checkpointing import prefill_optimizer_state, restore_per_param_steps

STATE_DIR = "grpo_state"


def state_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", STATE_DIR)


def _write(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def install(hooks, cpu_mode: bool) -> None:
    """Wrap Megatron-LM's save and load. ``hooks``: GRPO's RunHooks, or None without --grpo
    (then only the CPU fix applies)."""
    from megatron.training import get_args, training

    rank = torch.distributed.get_rank
    save_original, load_original = training.save_checkpoint, training.load_checkpoint

    @functools.wraps(save_original)
    def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
        if hooks is not None:
            hooks.before_save()
        out = save_original(iteration, model, optimizer, *args, **kwargs)
        margs = get_args()
        if hooks is not None and margs.save and not kwargs.get("non_persistent_ckpt", False):
            d = state_dir(margs.save, iteration)
            os.makedirs(d, exist_ok=True)
            common = hooks.checkpoint_state()  # on every rank: it gathers the Adam steps
            if rank() == 0:
                _write(common, os.path.join(d, "common.pt"))
            _write(hooks.rank_state(), os.path.join(d, f"rank_{rank():05d}.pt"))
            torch.distributed.barrier()  # every rank's file is there before training goes on
        return out

    @functools.wraps(load_original)
    def load_checkpoint(ddp_model, optimizer, *args, **kwargs):
        if cpu_mode and optimizer is not None:
            prefill_optimizer_state(optimizer)
        # fp32 on CPU: the main parameter shards are views of the model's leaf parameters, and
        # megatron copies loaded values into them in place (with bf16 on GPU they are copies).
        with torch.no_grad() if cpu_mode else contextlib.nullcontext():
            out = load_original(ddp_model, optimizer, *args, **kwargs)
        if cpu_mode and optimizer is not None:
            restore_per_param_steps(optimizer)
        iteration = out[0] if isinstance(out, tuple) else out
        margs = get_args()
        root = getattr(margs, kwargs.get("load_arg", "load"), None)
        if hooks is not None and root and iteration:
            d = state_dir(root, int(iteration))
            common, mine = os.path.join(d, "common.pt"), os.path.join(d, f"rank_{rank():05d}.pt")
            if os.path.isfile(common) and os.path.isfile(mine):
                hooks.load_state(torch.load(common, weights_only=False))
                hooks.load_rank_state(torch.load(mine, weights_only=False))
            elif rank() == 0:
                # Either cause leaves the same files; both are named rather than guessed.
                print(f"[megatron_grpo] {d}: no GRPO state (the checkpoint was saved without --grpo, "
                      f"or the job stopped between megatron's save and GRPO's): GRPO starts its "
                      f"tiers, importance and residuals afresh at iteration {iteration}", flush=True)
        return out

    training.save_checkpoint, training.load_checkpoint = save_checkpoint, load_checkpoint
