"""What a resume does with flags that differ from the checkpoint's (megatron_grpo/training/resume_flags.py),
without processes: the checkpoint is a config's scheduler stepped to its iteration, as the loop saves it.
The 2-rank runs are tests/multiproc/test_resume_changed_flags.py."""

import math
from types import SimpleNamespace

import pytest

from megatron_grpo.training import resume_flags as rf
from megatron_grpo.training.arguments import ConfigError, parse_args
from megatron_grpo.training.model import build_scheduler

DATA = ["--data-path", "data/x"]
BASE = ["--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "20", "--global-batch-size", "16",
        "--micro-batch-size", "4", "--train-iters", "40", "--seed", "1234"]


def _cfg(*argv):
    return parse_args([*BASE, *DATA, *argv], world_size=2)


def _optimizer(cfg):
    """Param groups as megatron-core makes them: Adam's settings and the lr bounds of OptimizerConfig."""
    o = cfg.optimizer
    return SimpleNamespace(param_groups=[{"betas": (o.adam_beta1, o.adam_beta2), "eps": o.adam_eps,
                                          "max_lr": o.lr, "min_lr": o.min_lr}])


def _checkpoint(cfg, iteration=40, extensions=None):
    """The common state the loop saves at ``iteration`` and the optimizer as loaded from it."""
    opt = _optimizer(cfg)
    sched = build_scheduler(cfg, opt)
    sched.step(increment=iteration * cfg.training.global_batch_size)
    common = {"iteration": iteration, "consumed_samples": iteration * cfg.training.global_batch_size,
              "scheduler": sched.state_dict(), "run_flags": rf.run_flags(cfg), "world_size": 2,
              "extensions": extensions or {}}
    return common, opt


def _compare(old, new, **flags):
    common, opt = _checkpoint(old)
    saved = rf.checkpoint_view(common, rf.adam_settings(opt.param_groups))
    given = rf.run_view(new, build_scheduler(new, _optimizer(new)).state_dict(), 2)
    return [(c.flag, c.saved, c.given, c.outcome) for c in rf.compare(saved, given, **flags)]


def test_an_unchanged_resume_has_no_changes():
    assert _compare(_cfg(), _cfg()) == []
    # --log-interval, --save, --metrics-file ... are this job's own: not compared
    assert _compare(_cfg(), _cfg("--log-interval", "3", "--run-name", "b", "--eval-interval", "7")) == []


def test_changed_lr_is_refused_unless_a_flag_says_which_wins():
    old, new = _cfg(), _cfg("--lr", "5e-4", "--min-lr", "5e-5")
    assert _compare(old, new) == [("--lr", 2e-3, 5e-4, rf.REFUSED), ("--min-lr", 2e-4, 5e-5, rf.REFUSED)]
    assert _compare(old, new, override=True) == [("--lr", 2e-3, 5e-4, rf.COMMAND_LINE),
                                                 ("--min-lr", 2e-4, 5e-5, rf.COMMAND_LINE)]
    assert _compare(old, new, use_checkpoint=True) == [("--lr", 2e-3, 5e-4, rf.CHECKPOINT),
                                                       ("--min-lr", 2e-4, 5e-5, rf.CHECKPOINT)]


def test_longer_train_iters_changes_the_decay_unless_lr_decay_iters_keeps_it():
    decay = rf.DECAY_BY_TRAIN_ITERS
    assert _compare(_cfg(), _cfg("--train-iters", "60")) == [(decay, 40, 60, rf.REFUSED)]
    # An explicit --lr-decay-iters equal to the old length: the schedule is the checkpoint's, and
    # the longer run is only listed.
    assert _compare(_cfg(), _cfg("--train-iters", "60", "--lr-decay-iters", "40")) == [
        ("--train-iters", 40, 60, rf.COMMAND_LINE)]
    assert _compare(_cfg("--lr-decay-iters", "100"), _cfg("--lr-decay-iters", "60")) == [
        ("--lr-decay-iters", 100, 60, rf.REFUSED)]
    # A constant lr has no decay to change.
    assert _compare(_cfg("--lr-decay-style", "constant"),
                    _cfg("--lr-decay-style", "constant", "--train-iters", "60")) == [
        ("--train-iters", 40, 60, rf.COMMAND_LINE)]


def test_a_decay_length_set_by_the_warm_up_names_the_train_iters_the_user_gave():
    # 20 iterations with a 20-iteration warm-up, resumed with --train-iters 25: the decay length
    # is max(--train-iters, --lr-warmup-iters + 1) = 21, not the 20 the user gave. Before, the
    # refusal said "--train-iters ... 21 in the checkpoint", a value the user never gave.
    old, new = _cfg("--train-iters", "20"), _cfg("--train-iters", "25")
    common, opt = _checkpoint(old, iteration=20)
    saved = rf.checkpoint_view(common, rf.adam_settings(opt.param_groups))
    given = rf.run_view(new, build_scheduler(new, _optimizer(new)).state_dict(), 2)
    changes = rf.compare(saved, given)
    assert [(c.flag, c.saved, c.given, c.outcome) for c in changes] == [
        (rf.DECAY_BY_TRAIN_ITERS, 20, 25, rf.REFUSED)]
    assert changes[0].values() == (
        "--train-iters (the lr decay, no --lr-decay-iters) 20 in the checkpoint, 25 here (the lr "
        "decays over max(--train-iters, --lr-warmup-iters + 1) iterations: 21 in the checkpoint, 25 here)")
    # Where the decay length is --train-iters itself, nothing more is said.
    assert rf.compare(*_views(_cfg(), _cfg("--train-iters", "60")))[0].values() == (
        "--train-iters (the lr decay, no --lr-decay-iters) 40 in the checkpoint, 60 here")


def _views(old, new, iteration=40):
    common, opt = _checkpoint(old, iteration=iteration)
    return (rf.checkpoint_view(common, rf.adam_settings(opt.param_groups)),
            rf.run_view(new, build_scheduler(new, _optimizer(new)).state_dict(), 2))


def test_adam_settings_and_weight_decay_follow_the_same_flags():
    assert _compare(_cfg(), _cfg("--adam-beta2", "0.99", "--weight-decay", "0.1", "--adam-eps", "1e-6")) == [
        ("--weight-decay", 0.01, 0.1, rf.REFUSED), ("--adam-beta2", 0.95, 0.99, rf.REFUSED),
        ("--adam-eps", 1e-8, 1e-6, rf.REFUSED)]


def test_another_global_batch_size_names_the_schedule_in_samples():
    assert _compare(_cfg(), _cfg("--global-batch-size", "32")) == [
        ("--lr-warmup-iters", "320 samples", "640 samples", rf.REFUSED),
        (rf.DECAY_BY_TRAIN_ITERS, "640 samples", "1280 samples", rf.REFUSED),
        ("--global-batch-size", 16, 32, rf.COMMAND_LINE)]


def test_seed_and_grpo_shares_take_effect_with_a_warning():
    grpo = ["--grpo", "--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.85"]
    old, new = _cfg(*grpo), _cfg(*grpo[:2], "0.3", "--grpo-dynamic-share", "0.7", "--seed", "99")
    common, opt = _checkpoint(old, extensions={"tiered": True})
    changes = rf.compare(rf.checkpoint_view(common, rf.adam_settings(opt.param_groups)),
                         rf.run_view(new, build_scheduler(new, _optimizer(new)).state_dict(), 2))
    assert [(c.flag, c.saved, c.given, c.outcome, c.warn) for c in changes] == [
        ("--seed", 1234, 99, rf.COMMAND_LINE, True),
        ("--grpo-core-share", 0.15, 0.3, rf.COMMAND_LINE, True),
        ("--grpo-dynamic-share", 0.85, 0.7, rf.COMMAND_LINE, True)]
    assert changes[0].why == (
        "the training data order follows the new seed from sample 640 on (megatron builds the dataset's "
        "shuffle from it: samples trained on before may come again and others be left out of this epoch); "
        "the random streams (dropout) go on from the checkpoint's saved RNG state; the weights are the "
        "checkpoint's")
    assert changes[1].why == ("the checkpoint's tier map is kept until the next re-tier (every "
                              "--grpo-retier-interval 500 iterations after the warm-up), which plans with "
                              "the new shares")
    lines = rf.report("D", 40, changes, True, "run")
    assert lines[1] == ("WARNING: resume from D iteration 40: --grpo-core-share 0.15 in the checkpoint, 0.3 "
                        "here: " + changes[1].why)
    # Without GRPO on both sides its settings are not compared (check_record names GRPO on/off).
    assert _compare(_cfg(*grpo), _cfg("--grpo-retier-interval", "100")) == []


def test_refusal_names_both_values_the_two_flags_and_the_lr_each_gives():
    old, new = _cfg(), _cfg("--train-iters", "60", "--lr", "5e-4")
    common, opt = _checkpoint(old)
    saved = rf.checkpoint_view(common, rf.adam_settings(opt.param_groups))
    given = rf.run_view(new, build_scheduler(new, _optimizer(new)).state_dict(), 2)
    text = rf.refusal("D", 40, rf.compare(saved, given), saved, given, rank=1)
    lr_new = rf.lr_at(given["scheduler"], 640)
    assert 2e-4 < lr_new < 5e-4 and rf.lr_at(saved["scheduler"], 640) == pytest.approx(2e-4)
    assert text == (
        "--load D: checkpoint iteration 40 was written with other optimizer settings than this run's "
        "(rank 1): --lr 0.002 in the checkpoint, 0.0005 here; --train-iters (the lr decay, no "
        "--lr-decay-iters) 40 in the checkpoint, 60 here. As Megatron-LM, a resume does not pick one "
        "silently: pass --override-opt_param-scheduler to use this run's values from iteration 41 on "
        f"(iteration 41 then trains at lr {lr_new:.4g}), or --use-checkpoint-opt_param-scheduler to keep "
        "the checkpoint's (lr 0.0002); or give the checkpoint's values.")
    assert rf.refusal("D", 40, rf.compare(saved, given, override=True), saved, given, rank=1) is None


def _built(cfg, loaded):
    """This run's model after load_checkpoint: its scheduler, the optimizer's groups as loaded."""
    opt = _optimizer(loaded)
    return SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt, param_groups=opt.param_groups),
                           scheduler=build_scheduler(cfg, opt))


def test_restore_applies_the_chosen_values_to_megatrons_scheduler(capsys):
    common, _ = _checkpoint(_cfg())
    changed = ["--train-iters", "60", "--adam-beta2", "0.99", "--lr", "4e-3"]
    # Neither flag: refused (the loop's bare scheduler.load_state_dict kept the checkpoint's values).
    with pytest.raises(rf.ResumeFlagsError):
        rf.restore(_cfg(*changed), common, _built(_cfg(*changed), _cfg()), "D")
    assert capsys.readouterr().out == ""
    built = _built(_cfg(*changed), _cfg())
    rf.restore(_cfg(*changed, "--override-opt_param-scheduler"), common, built, "D")
    built.scheduler.step(increment=16)  # iteration 41
    group = built.optimizer.param_groups[0]
    assert built.scheduler.lr_decay_steps == 960 and built.scheduler.num_steps == 656
    # The group's lr bounds were the checkpoint's (megatron's get_lr reads them first): now this run's.
    assert (group["max_lr"], group["min_lr"], group["betas"]) == (4e-3, 2e-4, (0.9, 0.99))
    assert group["lr"] == rf.lr_at(built.scheduler.state_dict(), 656) and 2e-4 < group["lr"] < 4e-3
    assert group["lr"] == pytest.approx(2e-4 + (4e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * 21 / 40)))
    head, used = "WARNING: resume from D iteration 40: ", "this run's value is used (--override-opt_param-scheduler)"
    assert capsys.readouterr().out.splitlines() == [
        f"{head}--lr 0.002 in the checkpoint, 0.004 here: {used}",
        f"{head}--train-iters (the lr decay, no --lr-decay-iters) 40 in the checkpoint, 60 here: {used}",
        f"{head}--adam-beta2 0.95 in the checkpoint, 0.99 here: {used}"]
    # --use-checkpoint-opt_param-scheduler, and --no-load-optim (the groups hold this run's bounds):
    # the checkpoint's schedule, and its bounds in the groups.
    built = _built(_cfg(*changed), _cfg(*changed))
    rf.restore(_cfg(*changed, "--use-checkpoint-opt_param-scheduler", "--no-load-optim"), common, built, "D")
    built.scheduler.step(increment=16)
    group = built.optimizer.param_groups[0]
    assert built.scheduler.lr_decay_steps == 640 and (group["max_lr"], group["lr"]) == (2e-3, 2e-4)
    assert group["betas"] == (0.9, 0.99)  # not loaded: this run's


def test_a_checkpoint_past_train_iters_is_refused_before_loading():
    rf.check_not_past_end("D", 40, _cfg())  # a finished run (iteration = --train-iters) passes
    with pytest.raises(rf.ResumeFlagsError) as err:
        rf.check_not_past_end("D", 40, _cfg("--train-iters", "30"), rank=1)
    assert str(err.value) == (
        "--load D: its checkpoint is at iteration 40, past --train-iters 30: nothing is left to train "
        "(rank 1). Give --train-iters above 40 to train on (with --override-opt_param-scheduler or "
        "--use-checkpoint-opt_param-scheduler: --train-iters sets the lr decay), point --load at a "
        "checkpoint of iteration 30 or earlier, or start a new run from its weights with --init-from D.")


def test_the_two_flags_exclude_each_other():
    with pytest.raises(ConfigError) as err:
        _cfg("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    assert str(err.value).startswith("--override-opt_param-scheduler (this run's lr schedule")
    assert "--use-checkpoint-opt_param-scheduler (the checkpoint's win) exclude each other" in str(err.value)


def test_run_flags_are_plain_and_leave_out_paths_and_logging():
    flags = rf.run_flags(_cfg("--save", "s", "--metrics-file", "m"))
    assert flags["--seed"] == 1234 and flags["--data-path"] == ["data/x"] and flags["--grpo"] is False
    assert not {"--save", "--load", "--metrics-file", "--run-name", "--override-opt_param-scheduler"} & set(flags)


def test_an_old_checkpoint_without_run_flags_says_what_is_not_compared():
    common, opt = _checkpoint(_cfg())
    del common["run_flags"]
    new = _cfg("--seed", "5")
    saved = rf.checkpoint_view(common, rf.adam_settings(opt.param_groups))
    changes = rf.compare(saved, rf.run_view(new, build_scheduler(new, _optimizer(new)).state_dict(), 2))
    assert changes == [] and rf.report("D", 40, changes, False, "run") == [
        "[run] resume from D iteration 40: the checkpoint records no run flags (written before they were): "
        "--seed, GRPO and data settings are not compared"]
