"""Unwritable and full checkpoint directories: the save fails with an error naming the path
(and the rank), the job ends, and any earlier checkpoint stays intact and loadable.

We run as root, so chmod cannot make a directory unwritable: a path under a regular file
(ENOTDIR), a read-only bind mount (EROFS) and a small tmpfs (ENOSPC) can. The mounts need root
and CAP_SYS_ADMIN; without them those rows say so."""

import contextlib
import shutil
import subprocess

import pytest

from harness import losses, read_metrics
from reliability_harness import (REF_ITERS, REF_SAVE_INTERVAL, run_job,
                                 torchrun_failure, tree_digest)
from megatron_grpo.training import checkpointing

pytestmark = pytest.mark.reliability_slow

GROUP = "Unwritable and full checkpoint directories"
EXPECTED = ("the save fails with an error naming the path and the rank; the job ends; an earlier "
            "checkpoint stays intact")


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


def _describe(job, path):
    """(the line reporting the cause, whether it is one of our one-line errors, whether it names
    the path). The rank that hit the error reports it; the other only sees a lost peer."""
    ours = [l for l in job.lines("error (rank") if "peer failure" not in l]
    raw = [l for l in job.err.splitlines() if l.startswith("[rank") and "Error:" in l]
    lines = ours or raw
    line = lines[0] if lines else ""
    return line, bool(ours), str(path) in line


def test_save_under_a_regular_file(reference, tmp_path, table):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint directory's parent should be\n")
    save = blocker / "ckpt"
    job = run_job(tmp_path / "job", 2, [*reference["args"], "--save", save, "--save-interval",
                                        REF_SAVE_INTERVAL, "--metrics-file", tmp_path / "m.jsonl"],
                  probe=False, timeout=240)
    assert job.rc not in (0, None)
    assert not job.leftovers
    line, one_line, named = _describe(job, save)
    assert named, job.err[-4000:]
    logged = len(read_metrics(tmp_path / "m.jsonl")) if (tmp_path / "m.jsonl").exists() else 0
    table.row(GROUP, f"--save {blocker.name}/ckpt where {blocker.name} is a regular file (ENOTDIR), "
                     f"--save-interval {REF_SAVE_INTERVAL}", EXPECTED,
              f"trained {REF_SAVE_INTERVAL} iterations ({logged} logged), then the first save "
              f"(iteration {REF_SAVE_INTERVAL}) failed: rc {job.rc}; "
              f"{torchrun_failure(job.err)}; "
              + ("one-line error: " if one_line else "raw traceback, no one-line error: ")
              + f"\"{line[:240]}\"; the path is named, the rank only by "
              f"torchrun's summary / the [rankN] prefix; nothing is checked before training starts, "
              f"so {REF_SAVE_INTERVAL} iterations were computed for nothing", ok=one_line)


def test_read_only_directory_with_an_earlier_checkpoint(reference, tmp_path, table):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    for it in (12, 16):
        shutil.rmtree(checkpointing.iteration_dir(str(ckpt), it))
    (ckpt / checkpointing.TRACKER).write_text("8")
    what = "--load D --save D with D a read-only bind mount holding checkpoint 8 (EROFS at the save of 12)"
    with mounted(table, what, ["mount", "--bind", str(ckpt), str(ckpt)],
                 ["mount", "-o", "remount,bind,ro", str(ckpt)]):
        before = tree_digest(ckpt)
        job = run_job(tmp_path / "job", 2, [*reference["args"], "--load", ckpt, "--save", ckpt,
                                            "--save-interval", REF_SAVE_INTERVAL,
                                            "--metrics-file", tmp_path / "m.jsonl"],
                      probe=False, timeout=240)
        after = tree_digest(ckpt)
    assert job.rc not in (0, None) and not job.leftovers
    assert "start_iter=8" in job.out
    assert after == before
    checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), 8))
    line, one_line, named = _describe(job, ckpt)
    assert named, job.err[-4000:]
    logged = [r["iteration"] for r in read_metrics(tmp_path / "m.jsonl")]
    table.row(GROUP, what, EXPECTED,
              f"resumed from 8, trained {logged[0]}..{logged[-1]}, the save of 12 failed: rc {job.rc}; "
              f"{torchrun_failure(job.err)}; "
              + ("one-line error: " if one_line else "raw traceback, no one-line error: ")
              + f"\"{line[:240]}\"; checkpoint 8 unchanged (sha256 of every file) "
              f"and verified", ok=one_line)


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
        line, one_line, named = _describe(job, ckpt)
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
    assert line, job.err[-4000:]
    table.row(GROUP, what, EXPECTED,
              f"the save of 8 failed: rc {job.rc}; {torchrun_failure(job.err)}; "
              + ("one-line error: " if one_line else "raw traceback, no one-line error: ")
              + f"\"{line[:240]}\"; left on disk: {', '.join(left)}; tracker "
              f"still 4, checkpoint 4 verified; after remounting with 64 MB, --load resumed from 4 "
              f"and iterations 5..{REF_ITERS} were bit-identical (the partial iter_0000008.tmp was replaced)",
              ok=one_line and named)
