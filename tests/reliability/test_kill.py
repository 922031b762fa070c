"""kill -9 of one rank mid-step and mid-save: the job fails within a bounded time, naming the
rank, and the next job (--load) resumes from the last complete checkpoint bit for bit, ignoring
or replacing whatever the killed save left half-written.

No wall-clock budget decides whether the fault is reached: the probe fires it at an event (an
iteration's backward, a point inside a save) and the test waits for that event as long as the
job makes progress (reliability_harness.run_until_fault); only the time from the kill to the
job's end is bounded (BOUND_S), which is what these tests are about."""

import pytest

from harness import losses, read_metrics
from reliability_harness import (REF_ITERS, REF_SAVE_INTERVAL, first_line, run_to_end,
                                 run_until_fault, torchrun_failure)
from megatron_grpo.training import checkpointing

pytestmark = pytest.mark.reliability_slow

GROUP = "kill -9 of one rank"
BOUND_S = 45  # from the kill to torchrun's exit: a dead peer must not cost a collective timeout


def _failed_fast(job, victim):
    fault = job.fault()
    assert fault is not None and fault["rank"] == victim, job.text[-4000:]
    assert job.rc not in (0, None), f"rc {job.rc}:\n{job.text[-4000:]}"
    took = job.ended_at - fault["time"]
    assert took < BOUND_S, f"{took:.1f} s from the kill to torchrun's exit"
    summary = torchrun_failure(job.err)
    assert f"rank {victim} (local_rank: {victim})" in summary and "-9" in summary, job.err[-3000:]
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"
    survivor = 1 - victim
    said = first_line(job.err, f"error (rank {survivor} on")
    return took, summary, said


def _resume(tmp_path, reference, ckpt, from_iter):
    metrics = str(tmp_path / "resumed.jsonl")
    job = run_to_end(tmp_path / "resume", 2, [*reference["args"], "--save", ckpt, "--load", ckpt,
                                              "--save-interval", REF_SAVE_INTERVAL, "--metrics-file", metrics],
                     watch=[metrics, ckpt], probe=False)
    assert job.rc == 0, job.text[-4000:]
    assert f"start_iter={from_iter}" in job.out
    resumed = read_metrics(metrics)
    assert [r["iteration"] for r in resumed] == list(range(from_iter + 1, REF_ITERS + 1))
    assert losses(resumed) == losses(reference["records"])[from_iter:]
    assert resumed[-1]["val_loss"] == reference["records"][-1]["val_loss"]
    assert (ckpt / checkpointing.TRACKER).read_text() == str(REF_ITERS)
    assert not list(ckpt.glob("*.tmp")), "the half-written save is still there"
    for it in range(from_iter + REF_SAVE_INTERVAL, REF_ITERS + 1, REF_SAVE_INTERVAL):
        checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), it))
    return len(resumed)


def test_kill_9_mid_step_then_resume(reference, tmp_path, table):
    # Rank 1 dies inside the backward pass of iteration 11: checkpoint 8 is the last complete.
    ckpt, k = tmp_path / "ckpt", 11
    job = run_until_fault(tmp_path / "job", 2, [*reference["args"], "--save", ckpt, "--save-interval",
                                                REF_SAVE_INTERVAL, "--metrics-file", tmp_path / "m.jsonl"],
                          faults=[f"kill:1:{k}"], watch=[tmp_path / "m.jsonl", ckpt])
    took, summary, said = _failed_fast(job, 1)
    last = (k - 1) // REF_SAVE_INTERVAL * REF_SAVE_INTERVAL
    assert (ckpt / checkpointing.TRACKER).read_text() == str(last)
    n = _resume(tmp_path, reference, ckpt, last)
    table.row(GROUP, f"SIGKILL of rank 1 inside the backward pass of iteration {k} "
                     f"(checkpoints every {REF_SAVE_INTERVAL})",
              f"job fails within {BOUND_S} s naming the rank; --load resumes from {last} bit-identically",
              f"torchrun rc {job.rc} {took:.1f} s after the kill; {summary}; rank 0: "
              f"\"{said[:160] or 'no message (ended by torchrun)'}\"; no process left; resumed "
              f"{n} iterations from {last}, losses bit-identical")


@pytest.mark.parametrize("victim,point", [(1, "rng"), (0, "manifest"), (0, "tracker")])
def test_kill_9_mid_save_then_resume(reference, tmp_path, table, victim, point):
    # The save of iteration 12 dies: rng = rank 1 while writing its own files (its shards are
    # on disk), manifest = rank 0 with every shard written but before the manifest,
    # tracker = rank 0 after iter_0000012 is complete, before the tracker names it.
    ckpt, k = tmp_path / "ckpt", 12
    job = run_until_fault(tmp_path / "job", 2, [*reference["args"], "--save", ckpt, "--save-interval",
                                                REF_SAVE_INTERVAL, "--metrics-file", tmp_path / "m.jsonl"],
                          faults=[f"kill-save:{victim}:{k}:{point}"], watch=[tmp_path / "m.jsonl", ckpt])
    took, summary, said = _failed_fast(job, victim)
    last = k - REF_SAVE_INTERVAL
    assert (ckpt / checkpointing.TRACKER).read_text() == str(last)
    left = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(f"iter_{k:07d}"))
    if point == "tracker":
        assert left == [f"iter_{k:07d}"]  # complete, but not yet named by the tracker
        checkpointing.verify_checkpoint(str(ckpt / left[0]))
    else:
        assert left == [f"iter_{k:07d}.tmp"]  # half-written, never mistaken for a checkpoint
        assert not (ckpt / left[0] / checkpointing.MANIFEST).exists()
    # A complete, verified directory the tracker does not name is resumed from, with a WARNING,
    # never replaced; a half-written one is ignored and replaced.
    resumed_from = k if point == "tracker" else last
    n = _resume(tmp_path, reference, ckpt, resumed_from)
    table.row(GROUP, f"SIGKILL of rank {victim} inside the save of iteration {k} ({point} point: "
              + {"rng": "rank 1 writing its RNG file, shards written",
                 "manifest": "all shards written, manifest not yet",
                 "tracker": "directory complete, tracker not yet moved"}[point] + ")",
              f"job fails naming the rank; --load resumes from {resumed_from}"
              + (" (the complete directory, with a WARNING)" if point == "tracker" else
                 "; the partial save is ignored"),
              f"torchrun rc {job.rc} {took:.1f} s after the kill; {summary}; left on disk: {left[0]} "
              f"{'(complete, tracker still ' + str(last) + ')' if point == 'tracker' else '(no manifest)'}; "
              f"resume loaded {resumed_from}"
              + ("" if point == "tracker" else f", replaced {left[0]}") + f", {n} iterations bit-identical",
              case="30.1" if point == "tracker" else "")
