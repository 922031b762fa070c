"""A resume with flags that differ from the checkpoint's, 2 gloo ranks.

One checkpoint at iteration 8 of a 12-iteration run (SMALL_MODEL: lr 3e-3 -> 3e-4, cosine, 4 warm-up
iterations, global batch 8), resumed four ways:
* --train-iters 16, --lr, --min-lr and --adam-beta2 changed, no flag: refused by every rank, naming
  each flag with both values and the two flags to choose from (Megatron-LM refuses too: its
  OptimizerParamScheduler._check_and_set asserts); nothing written;
* the same with --override-opt_param-scheduler: the new lr and the 16-iteration decay from
  iteration 9 on (before: the 12-iteration decay, at --min-lr from iteration 12, and the new lr
  ignored);
* --train-iters 16 --seed 8 with --use-checkpoint-opt_param-scheduler: the checkpoint's schedule,
  one WARNING per flag whose checkpoint value wins, on rank 0 only, and one for the seed;
* --train-iters 6: the checkpoint is past it; refused before loading (before: exit 0, silent).
"""

import socket
from types import SimpleNamespace

import pytest

from harness import SMALL_MODEL, file_digests, read_metrics, run_training

GBS, WARMUP = 8, 4  # SMALL_MODEL's
OVERRIDE, USE_CHECKPOINT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"


def _lrs(lr, min_lr, decay_iters, iterations):
    """The lr megatron's scheduler gives after ``k`` iterations (what a record's lr holds)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sched = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=WARMUP * GBS,
        lr_decay_steps=decay_iters * GBS, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=decay_iters * GBS, wd_incr_style="constant")
    out = []
    for k in iterations:
        sched.num_steps = k * GBS
        out.append(sched.get_lr({}))
    return out



@pytest.fixture(scope="module")
def saved(stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume_flags")
    base = [*SMALL_MODEL, "--data-path", stdlib_data, "--eval-interval", "1000", "--eval-iters", "0"]
    ckpt = str(tmp / "ck")
    run_training(2, [*base, "--train-iters", "12", "--save", ckpt, "--save-interval", "8",
                     "--exit-after-iter", "8"])
    return dict(base=base, ckpt=ckpt, tmp=tmp)


def test_changed_schedule_and_adam_flags_are_refused_naming_both_values(saved):
    before = file_digests(saved["ckpt"])
    metrics = saved["tmp"] / "refused.jsonl"
    proc = run_training(2, [*saved["base"], "--train-iters", "16", "--lr", "6e-3", "--min-lr", "6e-4",
                            "--adam-beta2", "0.99", "--load", saved["ckpt"], "--metrics-file", str(metrics)],
                        check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    host = socket.gethostname()
    for rank in (0, 1):
        said = [line for line in proc.stderr.splitlines()
                if line.startswith(f"error (rank {rank} on {host}): ")]
        assert len(said) == 1, proc.stderr[-4000:]
        text = said[0]
        for part in (f"--load {saved['ckpt']}: checkpoint iteration 8 was written with other optimizer settings "
                     f"than this run's (rank {rank}): ",
                     "--lr 0.003 in the checkpoint, 0.006 here", "--min-lr 0.0003 in the checkpoint, 0.0006 here",
                     "--train-iters (the lr decay, no --lr-decay-iters) 12 in the checkpoint, 16 here",
                     "--adam-beta2 0.95 in the checkpoint, 0.99 here",
                     f"pass {OVERRIDE} to use this run's values from iteration 9 on",
                     f"or {USE_CHECKPOINT} to keep the checkpoint's"):
            assert part in text, text
    assert file_digests(saved["ckpt"]) == before and not metrics.exists()


def test_override_takes_the_new_lr_and_extends_the_decay(saved):
    metrics = saved["tmp"] / "override.jsonl"
    proc = run_training(2, [*saved["base"], "--train-iters", "16", "--lr", "6e-3", "--min-lr", "6e-4",
                            OVERRIDE, "--load", saved["ckpt"], "--metrics-file", str(metrics)])
    records = read_metrics(str(metrics))
    assert [r["iteration"] for r in records] == list(range(9, 17))
    lrs = [r["lr"] for r in records]
    assert lrs == _lrs(6e-3, 6e-4, 16, range(9, 17))
    assert min(lrs[:-1]) > 6e-4 and lrs[-1] == pytest.approx(6e-4)  # decays until iteration 16
    head = f"WARNING: resume from {saved['ckpt']} iteration 8: "
    used = f"this run's value is used ({OVERRIDE})"
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: resume from")]
    assert warnings == [
        f"{head}--lr 0.003 in the checkpoint, 0.006 here: {used}",
        f"{head}--min-lr 0.0003 in the checkpoint, 0.0006 here: {used}",
        f"{head}--train-iters (the lr decay, no --lr-decay-iters) 12 in the checkpoint, 16 here: {used}"
    ], proc.stdout[-3000:]


def test_use_checkpoint_keeps_its_schedule_and_warns_once(saved):
    metrics = saved["tmp"] / "use_checkpoint.jsonl"
    proc = run_training(2, [*saved["base"], "--train-iters", "16", "--seed", "8", USE_CHECKPOINT,
                            "--load", saved["ckpt"], "--metrics-file", str(metrics)])
    records = read_metrics(str(metrics))
    assert [r["iteration"] for r in records] == list(range(9, 17))
    lrs = [r["lr"] for r in records]
    assert lrs == _lrs(3e-3, 3e-4, 12, range(9, 17))
    assert min(lrs[:3]) > 3e-4 and lrs[3:] == [pytest.approx(3e-4)] * 5  # at --min-lr from 12
    head = f"WARNING: resume from {saved['ckpt']} iteration 8: "
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: resume from")]
    assert warnings[0] == (
        f"{head}--train-iters (the lr decay, no --lr-decay-iters) 12 in the checkpoint, 16 here: the "
        f"checkpoint's value is used ({USE_CHECKPOINT})"), proc.stdout[-3000:]
    assert len(warnings) == 2 and warnings[1].startswith(
        f"{head}--seed 7 in the checkpoint, 8 here: the training data order follows the new seed from "
        f"sample 64 on"), warnings


def test_checkpoint_past_train_iters_is_refused(saved):
    metrics = saved["tmp"] / "past.jsonl"
    proc = run_training(1, [*saved["base"], "--train-iters", "6", "--load", saved["ckpt"],
                            "--metrics-file", str(metrics)], check=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("error (rank 0 on")]
    assert len(said) == 1 and said[0].endswith(
        f"--load {saved['ckpt']}: its checkpoint is at iteration 8, past --train-iters 6: nothing is left "
        f"to train (rank 0). Give --train-iters above 8 to train on (with {OVERRIDE} or {USE_CHECKPOINT}: "
        f"--train-iters sets the lr decay), point --load at a checkpoint of iteration 6 or earlier, or "
        f"start a new run from its weights with --init-from {saved['ckpt']}."), proc.stderr[-3000:]
    assert not metrics.exists()
