"""Unwritable and full checkpoint directories. A --save that cannot be written at start is
refused before training, by every rank, naming the path (rank 0's write probe). A save that fails
later (the filesystem turned read-only, or full) ends the job with a one-line error naming the path
and the rank, and any earlier checkpoint stays intact and loadable.

We run as root, so chmod cannot make a directory unwritable: a path under a regular file
(ENOTDIR), a read-only bind mount (EROFS) and a small tmpfs (ENOSPC) can. The mounts need root
and CAP_SYS_ADMIN; without them those rows say so."""

import contextlib
import re
import shutil
import subprocess

import pytest

from harness import losses, read_metrics
from reliability_harness import (REF_ITERS, REF_SAVE_INTERVAL, rank_errors, run_job, start_job,
                                 torchrun_failure, tree_digest)
from megatron_grpo.training import checkpointing
from megatron_grpo.training.safety.save_lock import LOCK_NAME

pytestmark = pytest.mark.reliability_slow

GROUP = "Unwritable and full checkpoint directories"
EXPECTED = ("the save fails with an error naming the path and the rank; the job ends; an earlier "
            "checkpoint stays intact")
EXPECTED_AT_START = ("refused before training, by every rank, with a one-line error naming the path "
                     "and the rank; the job ends; nothing on disk changes")


@contextlib.contextmanager
def mounted(table, what, *commands):
    """Run the mount commands (each a list); umount at the end. Skip (with a row) if mounting
    is not possible here."""
    target = commands[0][-1]
    for cmd in commands:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            subprocess.run(["umount", target], capture_output=True)
            reason = (proc.stderr or proc.stdout).strip()
            table.row(GROUP, what, EXPECTED, f"not tried: `{' '.join(cmd)}` failed here: {reason}", ok=False)
            pytest.skip(f"cannot mount: {reason}")
    try:
        yield target
    finally:
        subprocess.run(["umount", target], check=True)


def _refused_at_start(job, save, reason):
    """Every rank's one-line error for a --save the probe could not write: asserted exactly."""
    errors = rank_errors(job.err)
    for rank in (0, 1):
        assert errors.get(rank, "").endswith(
            f": --save {save}: cannot write checkpoints there ({reason}; write probe of rank 0, before "
            f"training; this is rank {rank}). Point --save at a directory this job can create and "
            f"write, or make {save} writable."), job.err[-4000:]
    summary = torchrun_failure(job.err)
    assert job.rc == 1 and "exitcode 2" in summary and not job.leftovers, job.err[-4000:]
    assert "Traceback" not in job.err.split("Root Cause")[0].split("error (rank")[0], job.err[-4000:]
    return errors[1], summary


def test_save_under_a_regular_file(reference, tmp_path, table):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint directory's parent should be\n")
    save = blocker / "ckpt"
    metrics = tmp_path / "m.jsonl"
    job = run_job(tmp_path / "job", 2, [*reference["args"], "--save", save, "--save-interval",
                                        REF_SAVE_INTERVAL, "--metrics-file", metrics],
                  probe=False, timeout=240)
    said, summary = _refused_at_start(job, save, f"[Errno 20] Not a directory: '{save}'")
    assert not metrics.exists() and "start_iter=" not in job.out  # no model built, no iteration
    assert blocker.read_text().startswith("a file where")
    table.row(GROUP, f"--save {blocker.name}/ckpt where {blocker.name} is a regular file (ENOTDIR), "
                     f"--save-interval {REF_SAVE_INTERVAL}", EXPECTED_AT_START,
              f"refused before the model was built (no iteration, no metrics file): rc {job.rc}; "
              f"{summary}; each rank printed e.g. \"{said}\"; no traceback", ok=True)


def _earlier_checkpoint(reference, tmp_path):
    """A copy of the reference checkpoints cut back to iteration 8."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    for it in (12, 16):
        shutil.rmtree(checkpointing.iteration_dir(str(ckpt), it))
    (ckpt / checkpointing.TRACKER).write_text("8")
    return ckpt


def test_read_only_directory_is_refused_at_start(reference, tmp_path, table):
    ckpt = _earlier_checkpoint(reference, tmp_path)
    what = "--load D --save D with D a read-only bind mount holding checkpoint 8 (EROFS at start)"
    with mounted(table, what, ["mount", "--bind", str(ckpt), str(ckpt)],
                 ["mount", "-o", "remount,bind,ro", str(ckpt)]):
        before = tree_digest(ckpt)
        job = run_job(tmp_path / "job", 2, [*reference["args"], "--load", ckpt, "--save", ckpt,
                                            "--save-interval", REF_SAVE_INTERVAL,
                                            "--metrics-file", tmp_path / "m.jsonl"],
                      probe=False, timeout=240)
        after = tree_digest(ckpt)
    probe_file = [l for l in job.err.splitlines() if "write_probe" in l][0].split("'")[1]
    said, summary = _refused_at_start(job, ckpt, f"[Errno 30] Read-only file system: '{probe_file}'")
    assert probe_file.startswith(f"{ckpt}/.megatron_grpo_write_probe.")
    assert after == before and not (tmp_path / "m.jsonl").exists()
    checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), 8))
    table.row(GROUP, what, EXPECTED_AT_START,
              f"refused before the model was built or checkpoint 8 read: rc {job.rc}; {summary}; each "
              f"rank printed e.g. \"{said}\"; checkpoint 8 unchanged (sha256 of every file) and "
              f"verified", ok=True)


def test_directory_turning_read_only_mid_run(reference, tmp_path, table):
    ckpt = _earlier_checkpoint(reference, tmp_path)
    metrics = tmp_path / "m.jsonl"
    what = ("--load D --save D, D a bind mount holding checkpoint 8, remounted read-only after "
            "iteration 9 (EROFS at the save of 12)")
    with mounted(table, what, ["mount", "--bind", str(ckpt), str(ckpt)]):
        before = tree_digest(ckpt)
        # 1 s before every iteration: the remount lands well before the save of 12.
        running = start_job(tmp_path / "job", 2, [*reference["args"], "--load", ckpt, "--save", ckpt,
                                                  "--save-interval", REF_SAVE_INTERVAL,
                                                  "--metrics-file", metrics], faults=["slow:1"])
        running.wait_for_records(str(metrics), 1, timeout=180)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ckpt)], check=True)
        job = running.finish(timeout=180)
        after = tree_digest(ckpt)
    assert "start_iter=8" in job.out
    # The job's --save lock (save_lock) cannot be removed from a read-only directory: the next
    # job on this host takes it over (its owner has exited). Nothing else changed.
    assert after.pop(LOCK_NAME, None) is not None and f"could not remove {ckpt}/{LOCK_NAME}" in job.err
    assert after == before
    checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), 8))
    logged = [r["iteration"] for r in read_metrics(metrics)]
    errors = rank_errors(job.err)
    tmp = checkpointing.iteration_dir(str(ckpt), 12) + ".tmp"
    assert errors.get(0, "").endswith(
        f": --save {ckpt}: saving iteration 12 failed on rank 0 (OSError: [Errno 30] Read-only file "
        f"system: '{tmp}'). Free space on its filesystem or make it writable (or point --save "
        f"elsewhere); its latest complete checkpoint, iteration 8, is intact: resume with --load "
        f"{ckpt}."), job.err[-4000:]
    assert "peer failure" in errors.get(1, ""), job.err[-4000:]  # rank 1 waited for rank 0
    summary = torchrun_failure(job.err)
    assert job.rc == 1 and logged == list(range(9, 12)) and not job.leftovers, job.err[-4000:]
    table.row(GROUP, what, EXPECTED,
              f"resumed from 8, trained {logged[0]}..{logged[-1]}, the save of 12 failed: rc {job.rc}; "
              f"{summary}; one-line error: \"{errors[0]}\"; rank 1: \"{errors[1][:120]}...\"; "
              f"checkpoint 8 unchanged (sha256 of every file) and verified", ok=True)


def test_full_disk_then_resume_after_space_is_freed(reference, tmp_path, table):
    # One checkpoint of this model is ~5.4 MB: 8 MB holds the first (iteration 4), not the second.
    disk = tmp_path / "disk"
    disk.mkdir()
    what = "--save on an 8 MB tmpfs: checkpoint 4 fits, checkpoint 8 does not (ENOSPC)"
    metrics = tmp_path / "m.jsonl"
    with mounted(table, what, ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)]):
        ckpt = disk / "ckpt"
        job = run_job(tmp_path / "job", 2, [*reference["args"], "--save", ckpt, "--save-interval",
                                            REF_SAVE_INTERVAL, "--metrics-file", metrics],
                      probe=False, timeout=240)
        assert job.rc not in (0, None) and not job.leftovers
        assert (ckpt / checkpointing.TRACKER).read_text() == "4"
        checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), 4))
        left = sorted(p.name for p in ckpt.iterdir())
        errors = rank_errors(job.err)
        # Make room (what an operator would do) and resume: checkpoint 4 must be as good as new.
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed_job = run_job(tmp_path / "resume", 2, [*reference["args"], "--load", ckpt, "--save", ckpt,
                                                      "--save-interval", REF_SAVE_INTERVAL,
                                                      "--metrics-file", tmp_path / "r.jsonl"],
                              probe=False, timeout=240)
        assert resumed_job.rc == 0, resumed_job.text[-4000:]
        resumed = read_metrics(tmp_path / "r.jsonl")
        assert [r["iteration"] for r in resumed] == list(range(5, REF_ITERS + 1))
        assert losses(resumed) == losses(reference["records"])[4:]
        assert not list(ckpt.glob("*.tmp"))
    # The writer fails on every rank and every rank raises; rank 0 (the coordinator) holds each
    # rank's cause: ENOSPC, or torch.save's zip writer failing on it ("unexpected pos ..."), and
    # says first that the disk is full.
    tail = (f"Free space on its filesystem or make it writable (or point --save elsewhere); its "
            f"latest complete checkpoint, iteration 4, is intact: resume with --load {ckpt}.")
    said0, said1 = errors.get(0, ""), errors.get(1, "")
    assert re.search(rf": --save {re.escape(str(ckpt))}: saving iteration 8 failed on rank 0 \(no space "
                     rf"left on {re.escape(str(ckpt))}: \d+ bytes free after the failure; rank \d+: ", said0), said0
    cause = re.search(r"rank \d+: Worker failure: (\[Errno 28\] No space left on device|\[enforce fail at "
                      r"inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+)", said0)
    assert cause and said0.endswith(tail), said0
    assert said1.endswith(f": --save {ckpt}: saving iteration 8 failed on rank 1 (the checkpoint writer "
                          f"reported a failure; rank 0's error names the rank and the cause). {tail}"), said1
    summary = torchrun_failure(job.err)
    assert "exitcode 2" in summary, summary
    table.row(GROUP, what, EXPECTED,
              f"the save of 8 failed: rc {job.rc}; {summary}; one-line error on each rank, rank 0's: "
              f"\"{said0}\"; left on disk: {', '.join(left)}; tracker "
              f"still 4, checkpoint 4 verified; after remounting with 64 MB, --load resumed from 4 "
              f"and iterations 5..{REF_ITERS} were bit-identical (the partial iter_0000008.tmp was replaced)",
              ok=True, case="30.7")
