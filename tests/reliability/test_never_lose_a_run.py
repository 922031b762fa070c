"""Never lose a run: the cases its fixes were unit- or multiproc-tested for, run as a user
runs them -- torchrun launch/pretrain_gpt.py, 2 ranks, the reference run's model (GRPO on) -- each
recording what the run printed and did. (Items 2, 3, 5 and the full checkpoint disk of item 7 have
their rows in test_one_job_per_dir.py, test_launcher_death.py, test_nonfinite.py, test_disk.py; a
complete checkpoint the tracker does not name yet in test_kill.py's ``tracker`` case.)

* item 1: a lost tracker resumes from the newest verified iter_* (and a dead job's --save lock is
  taken over); a fresh run into verified checkpoints is refused at start;
* item 4: a resume with a changed lr schedule is refused, or honoured with
  --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler, with one WARNING per flag;
  a checkpoint past --train-iters is refused;
* item 6: a .bin 4 KiB short and a truncated .idx are refused at start, naming the file;
* item 7: the --metrics-file across a copytruncate rotation, a kill, a resume and a fresh run, and
  on a full disk (/dev/full).
The decision rules are unit-tested (tests/unit/test_checkpoint_checks.py, test_resume_flags.py,
test_data.py, test_metrics_log.py); here the whole job's exit code, messages and files count."""

import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness import REPO, losses
from reliability_harness import (REF_ITERS, REF_SAVE_INTERVAL, base_args, first_line, rank_errors, run_job,
                                 run_to_end, start_job, torchrun_failure, tree_digest)
from megatron_grpo.training.metrics_log import read_entries, read_logged, read_metrics
from megatron_grpo.training import checkpointing
from megatron_grpo.training.safety.save_lock import LOCK_NAME

pytestmark = pytest.mark.reliability_slow

OVERWRITE_GROUP = "Verified checkpoints are never overwritten"
LOCK_GROUP = "One job per checkpoint directory"  # test_one_job_per_dir.py's
FLAGS_GROUP = "Resume with changed flags"
DATA_GROUP = "Damaged training data"
METRICS_GROUP = "The metrics file"
TRACKER = checkpointing.TRACKER
OVERRIDE, USE_CHECKPOINT = "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"


def _short(text: str, tmp_path, n: int = 300) -> str:
    """A message for the table: the test's tmp folder cut, at most n characters."""
    text = text.replace(str(tmp_path) + "/", "")
    return text if len(text) <= n else text[:n] + "..."


def _copy(reference, tmp_path, drop=()):
    """A copy of the reference checkpoints (4, 8, 12, 16; tracker 16) without the iterations in drop."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    for it in drop:
        shutil.rmtree(checkpointing.iteration_dir(str(ckpt), it))
    return ckpt


def _refused_on_every_rank(job, needle):
    """Each rank's one-line error, which must contain needle; the job failed, nothing left running."""
    errors = rank_errors(job.err)
    for rank in (0, 1):
        assert needle in errors.get(rank, ""), job.text[-4000:]
    assert job.rc not in (0, None) and not job.leftovers, job.text[-4000:]
    return errors


# -- item 1: verified checkpoints are never overwritten ---------------------------------------------

def test_lost_tracker_resumes_from_the_newest_verified_checkpoint(reference, tmp_path, table):
    # D holds verified iter 4, 8, 12 and no tracker -- what a job killed between its save's rename
    # and its tracker write leaves -- and that job's --save lock (its owner is dead). Before: "no
    # checkpoint yet ... starting from scratch", and every iter_* replaced.
    ckpt = _copy(reference, tmp_path, drop=(16,))
    (ckpt / TRACKER).unlink()
    lock = ckpt / LOCK_NAME
    dead = subprocess.run([sys.executable, "-c", "import os, sys; from megatron_grpo.training.safety.save_lock "
                           "import SaveLock; SaveLock(sys.argv[1]).acquire(); print(os.getpid()); os._exit(0)",
                           str(ckpt)], cwd=REPO, capture_output=True, text=True, check=True)
    assert lock.exists()
    before = {k: v for k, v in tree_digest(ckpt).items() if k != LOCK_NAME}
    metrics = tmp_path / "m.jsonl"
    job = run_to_end(tmp_path / "job", 2, [*reference["args"], "--load", ckpt, "--save", ckpt,
                                           "--save-interval", REF_SAVE_INTERVAL, "--metrics-file", metrics],
                     watch=[metrics, ckpt], probe=False)
    assert job.rc == 0, job.text[-4000:]
    resumed = first_line(job.out, "WARNING: --load")
    assert resumed == (f"WARNING: --load {ckpt}: no {TRACKER}, but {ckpt}/iter_0000012 is a complete "
                       f"checkpoint (its manifest verified: every file's size and CRC32); resuming from "
                       f"iteration 12, the newest of 3 iter_* directories (a job killed between a save's "
                       f"rename and its tracker write leaves this)."), job.out[-3000:]
    assert "starting from scratch" not in job.text and "start_iter=12" in job.out
    records = read_metrics(str(metrics))
    assert [r["iteration"] for r in records] == list(range(13, REF_ITERS + 1))
    assert losses(records) == losses(reference["records"])[12:]
    after = tree_digest(ckpt)
    assert {k: v for k, v in after.items() if k in before} == before  # 4, 8, 12 untouched
    assert (ckpt / TRACKER).read_text() == str(REF_ITERS) and not lock.exists()
    checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), REF_ITERS))
    took_over = first_line(job.text, f"WARNING: --save {ckpt}: took over")
    assert took_over.startswith(f"WARNING: --save {ckpt}: took over {lock}, left by pid "
                                f"{dead.stdout.strip()} on host "), job.text[-3000:]
    table.row(OVERWRITE_GROUP, "--load D --save D, D holding verified iter_0000004/8/12 and no tracker "
                               "(a kill between a save's rename and its tracker write)",
              "resume from the newest verified directory, saying so; none of them replaced",
              f"rc {job.rc}; \"{_short(resumed, tmp_path)}\"; trained 13..{REF_ITERS} with losses "
              f"bit-identical to the uninterrupted run; iter_0000004/8/12 unchanged (sha256 of every "
              f"file), iter_0000016 written and verified, tracker {REF_ITERS}", case="30.1")
    table.row(LOCK_GROUP, "the same D holding the --save lock of a job that died (pid gone, this host)",
              "taken over with a WARNING naming the dead owner; released at the end",
              f"\"{_short(took_over, tmp_path, 260)}\"; the job trained and exited {job.rc}; lock file gone "
              f"after the run", case="30.2")


def test_a_fresh_run_into_verified_checkpoints_is_refused_at_start(reference, tmp_path, table):
    ckpt = _copy(reference, tmp_path)
    before = tree_digest(ckpt)
    metrics = tmp_path / "m.jsonl"
    job = run_job(tmp_path / "job", 2, [*reference["args"], "--save", ckpt, "--save-interval",
                                        REF_SAVE_INTERVAL, "--metrics-file", metrics], probe=False, timeout=240)
    errors = _refused_on_every_rank(job, f"--save {ckpt}: this run (iterations 1-{REF_ITERS}) would "
                                         f"replace complete, verified checkpoints there: iter_0000004, "
                                         f"iter_0000008, iter_0000012, iter_0000016")
    for said in errors.values():
        assert f"--load {ckpt}" in said and "--overwrite-checkpoints" in said, said
    assert tree_digest(ckpt) == before and not metrics.exists()
    table.row(OVERWRITE_GROUP, "a fresh run (no --load) with --save D, D holding verified checkpoints "
                               "4..16 of an earlier run",
              "refused at start on every rank, naming the directories, --load and --overwrite-checkpoints; "
              "nothing written",
              f"rc {job.rc}; {torchrun_failure(job.err)}; rank 0: \"{_short(errors[0], tmp_path, 400)}\"; "
              f"D unchanged (sha256 of every file), no metrics file", case="30.1")


# -- item 4: resume honours what the user changed, or says why not ----------------------------------

def _lrs(lr, min_lr, decay_iters, iterations):
    """The lr megatron's scheduler gives after k iterations of SMALL_MODEL's schedule (4 warm-up
    iterations, cosine, global batch 8): what a metrics record's lr holds."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sched = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=4 * 8,
        lr_decay_steps=decay_iters * 8, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=decay_iters * 8, wd_incr_style="constant")
    out = []
    for k in iterations:
        sched.num_steps = k * 8
        out.append(sched.get_lr({}))
    return out


NEW_LR = ["--train-iters", "24", "--lr", "6e-3", "--min-lr", "6e-4"]
RESUMES = {  # name -> (extra flags, what was tried)
    "refused": (NEW_LR, "resume checkpoint 16 of the 16-iteration run with --train-iters 24 --lr 6e-3 "
                        "--min-lr 6e-4, no flag"),
    "override": ([*NEW_LR, "--seed", "8", OVERRIDE, "--exit-after-iter", "18"],
                 f"the same with {OVERRIDE}, and --seed 7->8 (iterations 17, 18)"),
    "use-checkpoint": (["--train-iters", "24", "--grpo-core-share", "0.2", "--grpo-dynamic-share", "0.6",
                        USE_CHECKPOINT, "--exit-after-iter", "18"],
                       f"--train-iters 24 and GRPO shares core 0.15->0.2, dynamic 0.65->0.6 with "
                       f"{USE_CHECKPOINT} (iterations 17, 18)"),
    "past-end": (["--train-iters", "12"], "--load of checkpoint 16 with --train-iters 12"),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_with_changed_flags(reference, tmp_path, table, name):
    extra, tried = RESUMES[name]
    ckpt = _copy(reference, tmp_path)
    before = tree_digest(ckpt)
    metrics = tmp_path / "m.jsonl"
    args = [*reference["args"], *extra, "--load", ckpt, "--metrics-file", metrics]  # last --train-iters wins
    job = run_job(tmp_path / "job", 2, args, probe=False, timeout=300)
    assert tree_digest(ckpt) == before  # no --save: the checkpoint is only read
    head = f"WARNING: resume from {ckpt} iteration {REF_ITERS}: "
    warnings = [line for line in job.out.splitlines() if line.startswith("WARNING: resume from")]
    if name == "refused":
        errors = _refused_on_every_rank(job, f"--load {ckpt}: checkpoint iteration {REF_ITERS} was written "
                                             f"with other optimizer settings than this run's")
        for part in ("--lr 0.003 in the checkpoint, 0.006 here", "--min-lr 0.0003 in the checkpoint, 0.0006 here",
                     "--train-iters (the lr decay, no --lr-decay-iters) 16 in the checkpoint, 24 here",
                     OVERRIDE, USE_CHECKPOINT):
            assert part in errors[0] and part in errors[1], errors
        assert not metrics.exists()
        expected = "refused by every rank naming each changed flag with both values and the two flags to choose from"
        happened = f"rc {job.rc}; rank 0: \"{_short(errors[0], tmp_path, 500)}\"; no iteration, checkpoint unchanged"
    elif name == "past-end":
        errors = _refused_on_every_rank(job, f"--load {ckpt}: its checkpoint is at iteration {REF_ITERS}, "
                                             f"past --train-iters 12: nothing is left to train")
        assert not metrics.exists()
        expected = "refused before loading, saying what to do (before: exit 0, silent)"
        happened = f"rc {job.rc}; rank 0: \"{_short(errors[0], tmp_path, 400)}\""
    else:
        assert job.rc == 0, job.text[-4000:]
        lrs = [r["lr"] for r in read_metrics(str(metrics))]
        # rank 0 prints the WARNINGs, once: rank 1 prints none
        assert all(line.startswith("WARNING") for line in warnings) and len(set(warnings)) == len(warnings)
        if name == "override":
            assert lrs == _lrs(6e-3, 6e-4, 24, (17, 18)) and min(lrs) > 6e-4, lrs
            changed = ("--lr 0.003 in the checkpoint, 0.006 here", "--min-lr 0.0003 in the checkpoint, 0.0006 here",
                       "--train-iters (the lr decay, no --lr-decay-iters) 16 in the checkpoint, 24 here")
            assert warnings[:3] == [f"{head}{c}: this run's value is used ({OVERRIDE})" for c in changed], warnings
            assert len(warnings) == 4 and warnings[3].startswith(f"{head}--seed 7 in the checkpoint, 8 here: "), \
                warnings
            expected = ("the new lr and a 24-iteration decay from iteration 17; one WARNING per changed flag, "
                        "seed included")
        else:
            assert lrs == [3e-4, 3e-4], lrs  # the checkpoint's 16-iteration decay: at its --min-lr
            assert warnings[0] == (f"{head}--train-iters (the lr decay, no --lr-decay-iters) 16 in the checkpoint, "
                                   f"24 here: the checkpoint's value is used ({USE_CHECKPOINT})"), warnings
            shares = [w for w in warnings if "--grpo-core-share 0.15 in the checkpoint, 0.2 here" in w
                      or "--grpo-dynamic-share 0.65 in the checkpoint, 0.6 here" in w]
            assert len(warnings) == 1 + len(shares) and shares, warnings
            expected = "the checkpoint's schedule kept, saying so; the new GRPO shares used, with a WARNING"
        happened = (f"rc {job.rc}; lr at 17, 18: {', '.join(f'{x:.6g}' for x in lrs)}; rank 0 printed "
                    f"{len(warnings)} WARNING(s): " + "; ".join(f"\"{_short(w[len(head):], tmp_path, 200)}\""
                                                                for w in warnings))
    table.row(FLAGS_GROUP, tried, expected, happened, case="30.4")


# -- item 6: damaged data found at start, named ------------------------------------------------------

def _rank_tracebacks(err: str) -> int:
    """Tracebacks in the job's stderr other than torchrun's own (its ChildFailedError summary)."""
    chunks = err.split("Traceback (most recent call last):")[1:]
    return sum(1 for c in chunks if "torch/distributed/run.py" not in c.split("\n\n")[0][:3000])


@pytest.mark.parametrize("ext,cut", [(".bin", 4096), (".idx", 100)])
def test_truncated_dataset_file_is_refused_at_start(stdlib_data, tmp_path, table, ext, cut):
    prefix = str(tmp_path / "data" / "stdlib")
    os.makedirs(os.path.dirname(prefix))
    for e in (".bin", ".idx", ".meta.json"):
        shutil.copy(stdlib_data + e, prefix + e)
    size = os.path.getsize(prefix + ext)
    os.truncate(prefix + ext, size - cut)
    metrics = tmp_path / "m.jsonl"
    job = run_job(tmp_path / "job", 2, [*base_args(prefix), "--data-cache-dir", tmp_path / "cache",
                                        "--metrics-file", metrics], probe=False, timeout=240)
    head = (f"{prefix}.bin has {size - cut} bytes, {cut} fewer than" if ext == ".bin" else
            f"{prefix}.idx has {size - cut} bytes, but its header describes")
    errors = _refused_on_every_rank(job, head)
    for said in errors.values():
        assert "the file is truncated" in said and f"Rebuild dataset {prefix!r}" in said, said
    assert not metrics.exists() and _rank_tracebacks(job.err) == 0, job.err[-3000:]
    table.row(DATA_GROUP, f"the default corpus with its {ext} cut {cut} bytes short",
              "refused at start (before the first iteration) on every rank, naming the file and how to rebuild it",
              f"rc {job.rc}; {torchrun_failure(job.err)}; rank 0: \"{_short(errors[0], tmp_path, 400)}\"; "
              f"no iteration ran (no metrics file), no traceback", case="30.6")


# -- item 7: the metrics file is an append-only log ---------------------------------------------------

def _last_logged(path) -> int:
    try:
        return max((r["iteration"] for r in read_logged(str(path))), default=0)
    except OSError:
        return 0


def test_metrics_file_across_rotation_kill_resume_and_a_fresh_run(reference, tmp_path, table):
    ckpt, metrics, rotated = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "m.jsonl.1"
    args = [*reference["args"], "--save", ckpt, "--save-interval", REF_SAVE_INTERVAL, "--metrics-file", metrics]
    # Job 1, slowed (1 s before every iteration) so that the rotation and the kill land mid-run:
    # logrotate's copytruncate after 2 records, then kill -9 of the whole job once iteration 6 is
    # logged (checkpoint 4 written, the save of 8 two iterations away).
    running = start_job(tmp_path / "job1", 2, args, faults=["slow:1"])
    try:
        running.wait_for_records(str(metrics), 2, timeout=600)
        shutil.copyfile(metrics, rotated)
        os.truncate(metrics, 0)
        running.wait_progressing(lambda: _last_logged(metrics) >= 6, "iteration 6", [ckpt])
    finally:
        try:
            os.killpg(running.proc.pid, signal.SIGKILL)  # torchrun, its ranks: the whole job
        except ProcessLookupError:
            pass
        first = running.finish(timeout=60)
    data = metrics.read_bytes()
    nuls = data.count(b"\0")
    events = [e.get("event") for e in read_entries(str(metrics))]
    logged = [r["iteration"] for r in read_logged(str(metrics))]
    assert nuls == 0 and events[0] == "continued", (nuls, events)
    assert [r["iteration"] for r in read_logged(str(rotated))] == list(range(1, logged[0])), logged
    killed_after, last_ckpt = logged[-1], int((ckpt / TRACKER).read_text())
    assert first.rc not in (0, None) and last_ckpt == 4 and killed_after > last_ckpt, (first.rc, logged)
    # Job 2: the requeue, --load from the last checkpoint; iterations after it are logged again.
    job2 = run_to_end(tmp_path / "job2", 2, [*args, "--load", ckpt, "--exit-after-iter", str(killed_after + 1)],
                      watch=[metrics, ckpt], probe=False)
    assert job2.rc == 0, job2.text[-4000:]
    entries = read_entries(str(metrics))
    resume = [e for e in entries if e.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["from_iteration"] == last_ckpt, entries
    logged2 = [r["iteration"] for r in read_logged(str(metrics))]
    twice = sorted(i for i in set(logged2) if logged2.count(i) == 2)
    assert twice == list(range(last_ckpt + 1, killed_after + 1)), logged2
    one = read_metrics(str(metrics))
    # one record per iteration, the ones before the rotation in the rotated file
    assert [r["iteration"] for r in one] == list(range(logged[0], killed_after + 2))
    assert losses(one) == losses(reference["records"])[logged[0] - 1:killed_after + 1]
    # Job 3: a fresh run (no --load, a new --save) into the same file: appended after a header.
    kept = metrics.read_bytes()
    job3 = run_to_end(tmp_path / "job3", 2, [*reference["args"], "--metrics-file", metrics, "--exit-after-iter", "2"],
                      watch=[metrics], probe=False)
    assert job3.rc == 0, job3.text[-4000:]
    assert metrics.read_bytes().startswith(kept)
    said = first_line(job3.out, f"--metrics-file {metrics} holds")
    assert said.endswith(f"--metrics-file {metrics} holds {len(kept)} bytes of earlier runs: appending this run "
                         f"after a run_start record (readers take the last run's records)"), job3.out[-3000:]
    assert [r["iteration"] for r in read_metrics(str(metrics))] == [1, 2]
    assert [e.get("event") for e in read_entries(str(metrics)) if "event" in e][-1] == "run_start"
    table.row(METRICS_GROUP, "copytruncate rotation of --metrics-file (copy, then truncate in place) after "
                             "2 iterations of a running 2-rank job",
              "no NUL bytes; the writer goes on at the file's new start, noting the rotation",
              f"{nuls} NUL bytes in {len(data)} bytes; the file starts with a '{events[0]}' record, then "
              f"iterations {logged[0]}..{logged[-1]}; the rotated copy holds 1..{logged[0] - 1}", case="30.7")
    table.row(METRICS_GROUP, f"kill -9 of that job after iteration {killed_after} (checkpoint {last_ckpt}), "
                             f"then --load (the requeue)",
              "the resumed segment is marked; readers take one record per iteration",
              f"resume job rc {job2.rc}; a 'resume' record from_iteration {resume[0]['from_iteration']}; "
              f"iterations {twice[0]}..{twice[-1]} logged twice (before and after it); read_metrics gives "
              f"{one[0]['iteration']}..{one[-1]['iteration']} once each, losses bit-identical to the "
              f"uninterrupted run", case="30.7")
    table.row(METRICS_GROUP, "a fresh run (no --load) with the same --metrics-file",
              "the earlier runs kept; this run appended after a run header, saying so",
              f"rc {job3.rc}; the file's first {len(kept)} bytes unchanged; \"{_short(said, tmp_path)}\"; "
              f"readers give iterations 1, 2 of this run", case="30.7")


def test_metrics_file_on_a_full_disk(stdlib_data, tmp_path, table):
    # /dev/full: every write fails with ENOSPC. Before: a bare OSError traceback ended training.
    job = run_job(tmp_path / "job", 2, [*base_args(stdlib_data), "--metrics-file", "/dev/full",
                                        "--exit-after-iter", "3"], probe=False, timeout=240)
    assert job.rc == 0 and "Traceback" not in job.text, job.text[-4000:]  # (torchrun's only on failure)
    warned = [line for line in job.text.splitlines() if "WARNING: --metrics-file /dev/full" in line]
    assert len(warned) == 2, job.text[-3000:]  # the first failure, and the count at the end
    assert ("WARNING: --metrics-file /dev/full: writing failed ([Errno 28] No space left on device); training "
            "continues without metrics") in warned[0], warned
    assert "3 record(s) could not be written (iterations 1..3)" in warned[1], warned
    assert "start_iter=0" in job.out
    table.row(METRICS_GROUP, "--metrics-file /dev/full (every write: ENOSPC), 3 iterations",
              "training continues without metrics (documented in metrics_log.py), one WARNING naming the path, "
              "the lost records counted at the end",
              f"rc {job.rc}, no traceback; \"{warned[0][:240]}\"; at the end: \"{warned[1][:200]}\"",
              case="30.7")
