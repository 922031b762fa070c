"""kill -9 of one rank in the hierarchy: 4 ranks as two distributed-optimizer
instances of 2, GRPO between them with the stable tier synced only at its updates (every 4
steps) and its delayed accumulators carried in between. A rank dies between two stable syncs:
the job fails within a bounded time naming the rank, and the next job resumes from the last
checkpoint -- taken mid-period, with accumulators and error-feedback residuals in it -- and
trains the uninterrupted run's losses bit for bit.

The periodic variant trains the dynamic tier locally in each instance (deltas synced every 3
steps: 9, 12, 15) and the stable tier in local mode (synced every 8): the checkpoint at 10 holds
per-instance masters, moments, anchors and delta residuals."""

import pytest

from harness import losses, read_metrics
from reliability_harness import base_args, first_line, run_job, torchrun_failure
from megatron_grpo.training import checkpointing

pytestmark = pytest.mark.reliability_slow

NPROC, ITERS, SAVE_EVERY, KILL_AT = 4, 16, 5, 13
BOUND_S = 45
# Delayed stable tier (the flag after GRPO_SMALL's wins): its accumulators live across steps,
# so a checkpoint at 10 (stable updates at 12 and 16) is taken in the middle of a period.
HIER = ["--num-distributed-optimizer-instances", "2", "--save-interval", str(SAVE_EVERY),
        "--train-iters", str(ITERS)]
MODES = {"delayed": ["--grpo-stable-mode", "delayed"],
         "periodic": ["--grpo-dynamic-sync-interval", "3", "--grpo-stable-mode", "local",
                      "--grpo-stable-interval", "8"]}


def _args(data, ckpt, metrics, mode):
    return [*base_args(data), *HIER, *MODES[mode], "--save", str(ckpt), "--metrics-file", str(metrics)]


@pytest.mark.parametrize("mode", list(MODES))
def test_kill_9_between_stable_syncs_of_the_hierarchy_then_resume(stdlib_data, tmp_path, table, mode):
    ref_metrics = tmp_path / "ref.jsonl"
    ref = run_job(tmp_path / "ref", NPROC, _args(stdlib_data, tmp_path / "ref_ckpt", ref_metrics, mode),
                  probe=False, timeout=400)
    assert ref.rc == 0, ref.text[-4000:]
    reference = read_metrics(ref_metrics)
    assert [r["iteration"] for r in reference] == list(range(1, ITERS + 1))
    if mode == "delayed":
        # The checkpoint at 10 is mid-period: the stable tier synced last at 8 and next at 12,
        # and GRPO is tiered (residuals and accumulators exist).
        updates = [r["iteration"] for r in reference if r.get("grpo_stable_update") and r.get("grpo_tiered")]
        assert 10 not in updates and any(u > 10 for u in updates), updates
        assert reference[9].get("grpo_tiered") and reference[9]["grpo_ef_bytes"] > 0
    else:
        # Mid-period at 10: the instances last agreed on the dynamic tier at 9, on stable never
        # since tiering; both sync after it.
        synced = {r["iteration"]: r["grpo_outer_synced"] for r in reference if r.get("grpo_outer_synced")}
        assert 10 not in synced and synced[12] == "d" and "s" in synced[14], synced

    victim, ckpt = 3, tmp_path / "ckpt"
    job = run_job(tmp_path / "job", NPROC, _args(stdlib_data, ckpt, tmp_path / "m.jsonl", mode),
                  faults=[f"kill:{victim}:{KILL_AT}"], timeout=400)
    fault = job.fault()
    assert fault is not None and fault["rank"] == victim, job.text[-4000:]
    assert job.rc not in (0, None)
    assert job.ended_at - fault["time"] < BOUND_S, f"{job.ended_at - fault['time']:.1f} s to exit"
    summary = torchrun_failure(job.err)
    assert f"rank {victim} (local_rank: {victim})" in summary and "-9" in summary, job.err[-3000:]
    assert not job.leftovers, f"processes outlived the job: {job.leftovers}"
    last = (KILL_AT - 1) // SAVE_EVERY * SAVE_EVERY
    assert (ckpt / checkpointing.TRACKER).read_text() == str(last)

    resumed_metrics = tmp_path / "resumed.jsonl"
    again = run_job(tmp_path / "resume", NPROC,
                    [*_args(stdlib_data, ckpt, resumed_metrics, mode), "--load", str(ckpt)],
                    probe=False, timeout=400)
    assert again.rc == 0, again.text[-4000:]
    assert f"start_iter={last}" in again.out
    resumed = read_metrics(resumed_metrics)
    assert [r["iteration"] for r in resumed] == list(range(last + 1, ITERS + 1))
    assert losses(resumed) == losses(reference)[last:]
    assert [r["grpo_tier_map"] for r in resumed] == [r["grpo_tier_map"] for r in reference[last:]]
    said = first_line(job.err, "error (rank")
    what = ("delayed stable tier" if mode == "delayed" else
            "dynamic tier trained locally, deltas synced every 3; stable tier local, every 8")
    table.row("kill -9 of one rank", f"SIGKILL of rank {victim} of 4 (two distributed-optimizer "
              f"instances, {what}) inside the backward of iteration {KILL_AT}, between "
              f"two syncs (checkpoints every {SAVE_EVERY})",
              f"job fails within {BOUND_S} s naming the rank; --load resumes from the mid-period "
              f"checkpoint {last} bit-identically",
              f"torchrun rc {job.rc} {job.ended_at - fault['time']:.1f} s after the kill; {summary}; "
              f"a survivor: \"{said[:160] or 'no message (ended by torchrun)'}\"; no process left; "
              f"resumed {len(resumed)} iterations from {last}, losses and tier maps bit-identical")
