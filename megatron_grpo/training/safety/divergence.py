"""A diverged run stops, and non-finite weights are never checkpointed.

Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (on by default) raises at the first NaN or
Inf in a rank's loss or gradient. Here:

* a non-finite training loss on any rank, or a non-finite gradient norm of an update that was
  applied (the megatron baseline does not skip steps, so its weights are then non-finite),
  stops the run at that iteration (``--check-for-nan-in-loss-and-grad``);
* GRPO skips a step whose gradient is non-finite anywhere (as megatron skips an fp16 overflow
  step): an isolated bad step is skipped and training goes on, and
  ``--max-consecutive-skipped-steps`` N skipped in a row stop the run;
* ``save_checkpoint`` refuses weights that hold a NaN or Inf (``nonfinite_weights_problem``), so
  the previous checkpoint stays the newest one.

Every rank must stop at the same iteration: a rank that raised while the others entered the
next step's collectives would leave them waiting for the distributed timeout. The loop's
per-iteration agreement all-reduce (``_Preemption.agree``) carries this rank's flags, so every
rank sees the same counts and raises together; naming the first bad rank costs one more
all-reduce, on the failure path only.
"""

from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.training.safety.checkpoint_dirs import TRACKER


class TrainingDiverged(ValueError):
    """The run diverged; the message names the iteration, the ranks, the flag and what to do.
    A ValueError so that launch/pretrain_gpt.py reports it as one line, ``error (rank R on
    HOST): ...``, and exits 2, as it does for a bad config: no traceback, nothing to debug."""


def latest_complete(root: Optional[str]) -> Optional[int]:
    """The iteration ``root``'s tracker names, or None (no --save, no tracker, unreadable)."""
    if not root:
        return None
    try:
        text = open(os.path.join(root, TRACKER)).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _checkpoint_text(save: Optional[str]) -> str:
    if not save:
        return "There is no checkpoint to resume from (no --save)."
    last = latest_complete(save)
    if last is None:
        return f"No checkpoint is written for it; --save {save} holds no complete checkpoint yet."
    return f"No checkpoint is written for it: the latest complete checkpoint, iteration {last} in {save}, is kept."


class DivergenceGuard:
    """Per-iteration checks of one run (the same decisions on every rank)."""

    FLAGS = 3
    """Length of ``local_flags``: own loss non-finite, reduced loss non-finite, applied
    non-finite gradient norm."""

    def __init__(self, cfg) -> None:
        t = cfg.training
        self.check_nan = bool(t.check_for_nan_in_loss_and_grad)
        self.max_skipped = int(t.max_consecutive_skipped_steps)
        self.train_iters = t.train_iters
        self.lr, self.warmup = cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters
        self.save = cfg.checkpoint.save
        self.consecutive = 0

    def local_flags(self, result) -> List[int]:
        """This rank's view of the step (``StepResult``), for the agreement all-reduce."""
        if not self.check_nan:
            return [0] * self.FLAGS
        reduced_bad = result.loss is not None and not math.isfinite(result.loss)
        grad_bad = (result.update_successful and result.grad_norm is not None
                    and not math.isfinite(result.grad_norm))
        return [int(not result.local_loss_finite), int(reduced_bad), int(grad_bad)]

    def problem(self, iteration: int, result, agreed: Sequence[int], device) -> Optional[str]:
        """The error text when the run must stop after ``iteration``, else None. ``agreed``: the
        sums over all ranks of ``local_flags``. Collective when a loss was non-finite."""
        world = dist.get_world_size()
        own_bad, reduced_bad, grad_bad = (int(x) for x in agreed)
        how = "Resume from a checkpoint before the divergence" if latest_complete(self.save) is not None \
            else "Rerun"
        advice = (f"{how} with a lower --lr (now {self.lr:g}) or a longer --lr-warmup-iters (now "
                  f"{self.warmup}), or check the data at this point")
        where = f"iteration {iteration} of {self.train_iters}"
        if own_bad or reduced_bad:
            shown = result.loss if result.loss is not None and not math.isfinite(result.loss) else "non-finite"
            if own_bad:
                first = first_rank(not result.local_loss_finite, device)
                ranks = f"on {own_bad} of {world} rank(s) (first: rank {first})"
            else:
                ranks = "summed over the data-parallel ranks (every rank's own loss is finite)"
            return (f"{where}: the loss is {shown} {ranks}; the run has diverged and stops "
                    f"(--check-for-nan-in-loss-and-grad, on by default as in Megatron-LM). "
                    f"{_checkpoint_text(self.save)} {advice}; --no-check-for-nan-in-loss-and-grad "
                    f"trains on regardless.")
        if grad_bad:
            return (f"{where}: the gradient norm is {result.grad_norm} and the update was applied, so "
                    f"the weights are non-finite; the run has diverged and stops "
                    f"(--check-for-nan-in-loss-and-grad, on by default as in Megatron-LM). "
                    f"{_checkpoint_text(self.save)} {advice}.")
        # Whether a step was skipped is agreed over the job (the optimizer all-reduces it).
        self.consecutive = self.consecutive + 1 if not result.update_successful else 0
        if self.max_skipped and self.consecutive >= self.max_skipped:
            first = iteration - self.consecutive + 1
            return (f"{where}: {self.consecutive} consecutive steps skipped (iterations {first}-{iteration}: "
                    f"a non-finite gradient on some rank; the skip is agreed over all {world} ranks), so "
                    f"the weights have not moved since iteration {first - 1}; the run stops "
                    f"(--max-consecutive-skipped-steps {self.max_skipped}; 0 never stops). "
                    f"{_checkpoint_text(self.save)} {advice}; or raise --max-consecutive-skipped-steps.")
        return None


def first_rank(bad: bool, device) -> int:
    """Collective: the lowest rank for which ``bad`` holds (world size if none)."""
    world = dist.get_world_size()
    mine = torch.tensor([dist.get_rank() if bad else world], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return int(mine.item())


def nonfinite_weights_problem(root: str, iteration: int, built) -> Optional[str]:
    """Collective (every rank, before a save writes anything): why the weights must not be
    saved, or None. Each rank counts NaN/Inf values in its model parameters (the distributed
    optimizer's fp32 masters are copied into them every step, so a non-finite master shows);
    one all-reduce of a world-sized vector names the ranks."""
    params = [p for chunk in built.ddp_model for p in chunk.parameters()]
    device = params[0].device if params else torch.device("cpu")
    count = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
    counts = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    counts[dist.get_rank()] = count
    dist.all_reduce(counts)
    bad = [r for r, n in enumerate(counts.tolist()) if n]
    if not bad:
        return None
    last = latest_complete(root)
    kept = (f"the latest complete checkpoint, iteration {last}, is kept: resume with --load {root} and "
            f"a lower --lr or a longer --lr-warmup-iters" if last is not None
            else f"{root} holds no complete checkpoint")
    return (f"--save {root}: refusing to save iteration {iteration}: the weights are non-finite "
            f"({int(counts.sum())} NaN/Inf values on rank(s) {', '.join(map(str, bad))}; this is rank "
            f"{dist.get_rank()}), and a checkpoint of them could only resume a diverged run. Nothing "
            f"was written; {kept}.")
