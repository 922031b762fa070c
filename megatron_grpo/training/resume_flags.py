"""A resume whose flags differ from the checkpoint's: honour them, or say why not.

What each kind of setting does at ``--load`` (every rank decides alike; rank 0 prints):

* **The lr schedule and Adam's settings** -- --lr, --min-lr, --lr-warmup-iters, the decay length
  (--lr-decay-iters, by default --train-iters), --lr-decay-style, --weight-decay, --adam-beta1/2,
  --adam-eps. megatron's OptimizerParamScheduler saves its values beside its position, and the
  optimizer's param groups (betas, eps) come back from the checkpoint, so a changed flag was
  silently ignored. Megatron-LM's rule (OptimizerParamScheduler.load_state_dict / _check_and_set,
  neither flag set by default): a value that differs is an error unless
  --override-opt_param-scheduler (this run's values) or --use-checkpoint-opt_param-scheduler
  (the checkpoint's) says which wins. Megatron-LM's lr_decay_iters defaults to train_iters, as
  ours does, so a changed --train-iters without --lr-decay-iters changes the decay and is
  refused the same way; with --override-opt_param-scheduler the decay runs to the new
  --train-iters from the saved position. Adam's betas and eps follow the same two flags (an
  extension: Megatron-LM keeps the checkpoint's without a word). Values that cannot change the lr
  are not compared (the decay length of a constant schedule, the weight-decay increment of the
  constant weight decay this project uses).
* **--seed**: the new value is used, with a WARNING: megatron builds the dataset's shuffle from it,
  so the data order after the checkpoint's position changes; the random streams (dropout) go on
  from the checkpoint's saved RNG state (at the same world size) and the weights are the
  checkpoint's.
* **GRPO's tier shares**: the new values are used, with a WARNING: the checkpoint's tier map is
  kept until the next re-tier, which plans with the new shares.
* **Everything else recorded** (``run_flags``: every flag but paths, logging and the checkpoint's
  own; the model's shape is checked by checkpointing.check_record): this run's value is used,
  listed in one line.
* **A checkpoint past --train-iters** is refused before it is loaded (``check_not_past_end``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

from megatron_grpo.training.checkpointing import CheckpointError

OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"

REFUSED, CHECKPOINT, COMMAND_LINE = "refused", "checkpoint", "command line"
"""FlagChange.outcome: the resume stops; the checkpoint's value is used; this run's value is used."""

DECAY_BY_TRAIN_ITERS = "--train-iters (the lr decay, no --lr-decay-iters)"
"""How the decay length is named when --train-iters set it (no --lr-decay-iters on either side)."""

# megatron OptimizerParamScheduler.state_dict() key -> the flag that sets it. Step counts are in
# samples (iterations x --global-batch-size), as Megatron-LM steps the scheduler.
_SCHEDULE = (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("lr_warmup_steps", "--lr-warmup-iters"),
             ("lr_decay_steps", "--lr-decay-iters"), ("lr_decay_style", "--lr-decay-style"),
             ("start_wd", "--weight-decay"))
ADAM = ("--adam-beta1", "--adam-beta2", "--adam-eps")
SHARES = ("--grpo-core-share", "--grpo-dynamic-share", "--grpo-stable-share")
# Not listed as changes: where output goes and how this job stops (they are this job's own),
# flags compared above, and --grpo (check_record names GRPO on/off).
_NOT_COMPARED = {"--data-cache-dir", "--exit-after-iter", "--cpu", "--distributed-timeout-minutes",
                 "--grpo-offload-dir", "--grpo", "--lr", "--min-lr", "--lr-warmup-iters", "--lr-decay-iters",
                 "--lr-decay-style", "--weight-decay", *ADAM}
_NOT_RECORDED_SECTIONS = ("checkpoint", "logging")


class ResumeFlagsError(CheckpointError):
    """This run's flags conflict with the checkpoint's; the message names each and the way out."""


@dataclass(frozen=True)
class FlagChange:
    """One setting that differs between the checkpoint and this run, and what the resume does."""

    flag: str
    saved: Any
    given: Any
    outcome: str
    """REFUSED, CHECKPOINT or COMMAND_LINE."""
    why: str = ""
    warn: bool = True
    """A WARNING line of its own (False: listed in the one line of other changes that took effect)."""
    detail: str = ""
    """Said after the two values, e.g. how the lr decay length follows from --train-iters."""

    def values(self) -> str:
        return f"{self.flag} {_show(self.saved)} in the checkpoint, {_show(self.given)} here{self.detail}"


def _show(value) -> str:
    if value is None:
        return "(default)"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def _plain(value):
    """A JSON-plain copy (the checkpoint's common state is loaded with torch's safe unpickler)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return str(value)


def run_flags(cfg) -> Dict[str, Any]:
    """flag -> value for every setting of this run but --save/--load and logging; each checkpoint
    stores it (common state ``run_flags``) so a resume can say what changed."""
    from megatron_grpo.training.arguments import flag_name
    from megatron_grpo.training.config import SECTIONS

    out: Dict[str, Any] = {}
    for section in SECTIONS:
        if section in _NOT_RECORDED_SECTIONS:
            continue
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            flag = flag_name(f.name, getattr(sub, "FLAG_PREFIX", ""), getattr(sub, "FLAG_NAMES", None))
            out[flag] = _plain(getattr(sub, f.name))
    return out


def adam_settings(param_groups: Sequence[Dict]) -> Optional[Dict[str, float]]:
    """Adam's betas and eps as the optimizer holds them (after a load: the checkpoint's)."""
    group = param_groups[0] if param_groups else {}
    if "betas" not in group or "eps" not in group:
        return None
    return {"--adam-beta1": float(group["betas"][0]), "--adam-beta2": float(group["betas"][1]),
            "--adam-eps": float(group["eps"])}


def checkpoint_view(common: Dict, adam: Optional[Dict[str, float]]) -> Dict:
    """What ``compare`` reads of a checkpoint: its common state, and Adam's settings as loaded
    (None with --no-load-optim: this run's are then used)."""
    return {"scheduler": common["scheduler"], "adam": adam, "flags": common.get("run_flags"),
            "consumed_samples": common.get("consumed_samples"), "world_size": common.get("world_size"),
            "tiered": (common.get("extensions") or {}).get("tiered")}


def run_view(cfg, scheduler_state: Dict, world_size: int) -> Dict:
    """What ``compare`` reads of this run: its config and its scheduler's (unloaded) state."""
    o = cfg.optimizer
    return {"scheduler": scheduler_state, "world_size": world_size, "flags": run_flags(cfg),
            "adam": {"--adam-beta1": o.adam_beta1, "--adam-beta2": o.adam_beta2, "--adam-eps": o.adam_eps}}


def _steps(samples, gbs: Optional[int]):
    """A scheduler step count in iterations, or in samples when --global-batch-size changed."""
    if gbs and samples % gbs == 0:
        return samples // gbs
    return f"{samples} samples"


def _decay_by_train_iters(a, b, s_flags: Optional[Dict], g_flags: Dict):
    """(saved, given, detail) of a decay length set by --train-iters: the --train-iters the user
    gave on each side, and where the decay length differs from it (the lr decays over
    max(--train-iters, --lr-warmup-iters + 1) iterations: a run whose warm-up fills it), both
    lengths. With another --global-batch-size the lengths stay in samples."""
    s_iters, g_iters = (s_flags or {}).get("--train-iters"), g_flags.get("--train-iters")
    if not (isinstance(a, int) and isinstance(b, int) and s_iters is not None and g_iters is not None):
        return a, b, ""
    if (a, b) == (s_iters, g_iters):
        return a, b, ""
    return s_iters, g_iters, (f" (the lr decays over max(--train-iters, --lr-warmup-iters + 1) "
                              f"iterations: {a} in the checkpoint, {b} here)")


def _optimizer_change(flag, saved, given, override: bool, use_checkpoint: bool) -> FlagChange:
    if override:
        return FlagChange(flag, saved, given, COMMAND_LINE, f"this run's value is used ({OVERRIDE})")
    if use_checkpoint:
        return FlagChange(flag, saved, given, CHECKPOINT, f"the checkpoint's value is used ({USE_CHECKPOINT})")
    return FlagChange(flag, saved, given, REFUSED)


def _seed_why(saved: Dict, given: Dict) -> str:
    rng = ("the random streams (dropout) go on from the checkpoint's saved RNG state"
           if saved.get("world_size") == given.get("world_size") else
           "the random streams start from the new seed (another world size: per-rank RNG state is not restored)")
    return (f"the training data order follows the new seed from sample {saved.get('consumed_samples')} on "
            f"(megatron builds the dataset's shuffle from it: samples trained on before may come again and "
            f"others be left out of this epoch); {rng}; the weights are the checkpoint's")


def _shares_why(saved: Dict, flags: Dict) -> str:
    if saved.get("tiered"):
        return (f"the checkpoint's tier map is kept until the next re-tier (every --grpo-retier-interval "
                f"{flags.get('--grpo-retier-interval')} iterations after the warm-up), which plans with "
                f"the new shares")
    if saved.get("tiered") is False:
        return (f"no tiers yet: the first tiering, after the --grpo-warmup-iters "
                f"{flags.get('--grpo-warmup-iters')} warm-up, plans with the new shares")
    return "the next tiering plans with the new shares (no GRPO state resumed)"


def compare(saved: Dict, given: Dict, override: bool = False, use_checkpoint: bool = False) -> List[FlagChange]:
    """Every setting that differs between the checkpoint (``saved``, a ``checkpoint_view``) and
    this run (``given``, a ``run_view``), with what the resume does with it (module docstring).
    ``override``/``use_checkpoint``: --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler."""
    s_flags, g_flags = saved.get("flags"), given["flags"]
    g_gbs = g_flags.get("--global-batch-size")
    s_gbs = (s_flags or {}).get("--global-batch-size", g_gbs)
    gbs = g_gbs if s_gbs == g_gbs else None  # another batch size: step counts shown in samples
    explicit_decay = any((f or {}).get("--lr-decay-iters") is not None for f in (s_flags, g_flags))
    s_sched, g_sched = saved["scheduler"], given["scheduler"]
    changes: List[FlagChange] = []
    for key, flag in _SCHEDULE:
        a, b = s_sched.get(key), g_sched.get(key)
        if key == "lr_decay_steps" and s_sched["lr_decay_style"] == g_sched["lr_decay_style"] == "constant":
            continue  # a constant lr has no decay
        if key == "start_wd":
            a, b = ((d["start_wd"] if d["start_wd"] == d["end_wd"] else (d["start_wd"], d["end_wd"]))
                    for d in (s_sched, g_sched))
        if a == b:
            continue
        detail = ""
        if key in ("lr_warmup_steps", "lr_decay_steps"):
            a, b = _steps(a, gbs), _steps(b, gbs)
            if key == "lr_decay_steps" and not explicit_decay:
                flag = DECAY_BY_TRAIN_ITERS
                a, b, detail = _decay_by_train_iters(a, b, s_flags, g_flags)
        change = _optimizer_change(flag, a, b, override, use_checkpoint)
        changes.append(dataclasses.replace(change, detail=detail) if detail else change)
    if saved.get("adam") is not None:
        for flag in ADAM:
            if saved["adam"][flag] != given["adam"][flag]:
                changes.append(_optimizer_change(flag, saved["adam"][flag], given["adam"][flag],
                                                 override, use_checkpoint))
    if s_flags is None:
        return changes
    grpo_both = bool(s_flags.get("--grpo")) and bool(g_flags.get("--grpo"))
    named = {c.flag for c in changes}
    for flag, b in g_flags.items():
        if flag not in s_flags or s_flags[flag] == b or flag in _NOT_COMPARED:
            continue
        if flag.startswith("--grpo-") and not grpo_both:
            continue  # no GRPO on one side: its settings were or are unused
        if flag == "--train-iters" and DECAY_BY_TRAIN_ITERS in named:
            continue
        a = s_flags[flag]
        if flag == "--seed":
            changes.append(FlagChange(flag, a, b, COMMAND_LINE, _seed_why(saved, given)))
        elif flag in SHARES:
            changes.append(FlagChange(flag, a, b, COMMAND_LINE, _shares_why(saved, g_flags)))
        else:
            changes.append(FlagChange(flag, a, b, COMMAND_LINE, warn=False))
    return changes


def lr_at(scheduler_state: Dict, num_steps: int) -> float:
    """The lr megatron's scheduler with these values gives after ``num_steps`` samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = scheduler_state
    sched = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[]), init_lr=0.0, max_lr=s["max_lr"], min_lr=s["min_lr"],
        lr_warmup_steps=s["lr_warmup_steps"], lr_decay_steps=s["lr_decay_steps"],
        lr_decay_style=s["lr_decay_style"], start_wd=s["start_wd"], end_wd=s["end_wd"],
        wd_incr_steps=s["wd_incr_steps"], wd_incr_style=s["wd_incr_style"])
    sched.num_steps = num_steps
    return sched.get_lr({})


def refusal(root: str, iteration: int, changes: Sequence[FlagChange], saved: Dict, given: Dict,
            rank: int) -> Optional[str]:
    """The error text for the REFUSED changes, or None if there are none."""
    refused = [c for c in changes if c.outcome == REFUSED]
    if not refused:
        return None
    lr_o = lr_c = ""
    if any(c.flag not in ADAM for c in refused):
        at = saved["scheduler"]["num_steps"]
        lr_o = f" (iteration {iteration + 1} then trains at lr {lr_at(given['scheduler'], at):.4g})"
        lr_c = f" (lr {lr_at(saved['scheduler'], at):.4g})"
    return (f"--load {root}: checkpoint iteration {iteration} was written with other optimizer settings "
            f"than this run's (rank {rank}): {'; '.join(c.values() for c in refused)}. As Megatron-LM, a "
            f"resume does not pick one silently: pass {OVERRIDE} to use this run's values from iteration "
            f"{iteration + 1} on{lr_o}, or {USE_CHECKPOINT} to keep the checkpoint's{lr_c}; or give the "
            f"checkpoint's values.")


def report(root: str, iteration: int, changes: Sequence[FlagChange], recorded: bool, run_name: str) -> List[str]:
    """The lines rank 0 prints: one WARNING per setting whose checkpoint value wins or whose new
    value needs saying (seed, shares, an overridden schedule), one line for the other changes."""
    head = f"resume from {root} iteration {iteration}"
    lines = [f"WARNING: {head}: {c.values()}: {c.why}" for c in changes if c.warn and c.outcome != REFUSED]
    quiet = [c.values() for c in changes if not c.warn]
    if quiet:
        lines.append(f"[{run_name}] {head}: changed since the checkpoint, this run's values are used: "
                     f"{'; '.join(quiet)}")
    if not recorded:
        lines.append(f"[{run_name}] {head}: the checkpoint records no run flags (written before they were): "
                     f"--seed, GRPO and data settings are not compared")
    return lines


def restore(cfg, common: Dict, built, root: str) -> List[FlagChange]:
    """On every rank, after checkpointing.load_checkpoint: compare, refuse (ResumeFlagsError) or
    restore the lr schedule and Adam's settings as the two flags say, and print (rank 0) what
    won. Replaces a bare ``scheduler.load_state_dict``."""
    import torch.distributed as dist

    from megatron_grpo.training.model import optimizer_list

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    c = cfg.checkpoint
    groups = [g for opt in optimizer_list(built.optimizer) for g in opt.optimizer.param_groups]
    saved = checkpoint_view(common, adam_settings(groups) if c.load_optim else None)
    given = run_view(cfg, built.scheduler.state_dict(), world)
    changes = compare(saved, given, c.override_opt_param_scheduler, c.use_checkpoint_opt_param_scheduler)
    iteration = int(common["iteration"])
    problem = refusal(root, iteration, changes, saved, given, rank)
    if problem is not None:
        raise ResumeFlagsError(problem)
    # megatron's own rule, now that a conflict has been refused or settled by a flag.
    built.scheduler.override_opt_param_scheduler = c.override_opt_param_scheduler
    built.scheduler.use_checkpoint_opt_param_scheduler = not c.override_opt_param_scheduler
    sched = built.scheduler
    sched.load_state_dict(common["scheduler"])
    # megatron-core puts max_lr/min_lr in every param group (from OptimizerConfig.lr/min_lr), and
    # get_lr reads the group's before the scheduler's: the optimizer's load brought back the
    # checkpoint's (--no-load-optim: this run's), so --override-opt_param-scheduler's lr was
    # ignored (a known Megatron-LM defect: its own training loop now rewrites them after the load). The
    # scheduler's values are the ones that won: every group gets them (this project sets no
    # per-group lr), and step(0) recomputes each group's lr from them.
    for group in groups:
        if "max_lr" in group:
            group["max_lr"], group["min_lr"] = sched.max_lr, sched.min_lr
    sched.step(0)
    if c.override_opt_param_scheduler:
        adam = given["adam"]
        for group in groups:
            if "betas" in group:
                group["betas"] = (adam["--adam-beta1"], adam["--adam-beta2"])
                group["eps"] = adam["--adam-eps"]
    if rank == 0:
        for line in report(root, iteration, changes, saved["flags"] is not None, cfg.logging.run_name):
            print(line, flush=True)
    return changes


def check_not_past_end(root: str, resume, cfg, rank: int = 0) -> None:
    """Refuse, before loading, a checkpoint at an iteration past --train-iters (it trained
    nothing and exited 0). ``resume``: the iteration --load resumes from, or anything else for
    the one its tracker names. A checkpoint at exactly --train-iters (a finished run) passes."""
    from megatron_grpo.training.checkpointing import latest_iteration

    iteration = resume if isinstance(resume, int) else latest_iteration(root)
    train_iters = cfg.training.train_iters
    if iteration <= train_iters:
        return
    decay = (f" (with {OVERRIDE} or {USE_CHECKPOINT}: --train-iters sets the lr decay)"
             if cfg.optimizer.lr_decay_iters is None else "")
    raise ResumeFlagsError(
        f"--load {root}: its checkpoint is at iteration {iteration}, past --train-iters {train_iters}: "
        f"nothing is left to train (rank {rank}). Give --train-iters above {iteration} to train on{decay}, "
        f"point --load at a checkpoint of iteration {train_iters} or earlier, or start a new run from its "
        f"weights with --init-from {root}.")
