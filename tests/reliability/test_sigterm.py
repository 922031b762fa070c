"""SIGTERM (SLURM preemption) -> every rank stops at the same iteration, a complete checkpoint of
that iteration is written, the job exits, and --load continues bit for bit."""

import os
import signal

import pytest

from harness import losses, read_metrics
from reliability_harness import REF_ITERS, REF_SAVE_INTERVAL, first_line, run_job, start_job
from megatron_grpo.training import checkpointing

GROUP = "SIGTERM (SLURM preemption)"


def _resume_and_compare(tmp_path, reference, ckpt, metrics, stopped_at):
    """--load the preemption checkpoint (the requeue idiom: --save = --load) and compare every
    later iteration with the uninterrupted reference run."""
    job = run_job(tmp_path / "resume", 2, [*reference["args"], "--save", ckpt, "--load", ckpt,
                                           "--save-interval", REF_SAVE_INTERVAL, "--metrics-file", metrics],
                  probe=False)
    assert job.rc == 0, job.text[-4000:]
    assert f"start_iter={stopped_at}" in job.out
    resumed = read_metrics(metrics)[stopped_at:]
    ref = reference["records"]
    assert [r["iteration"] for r in resumed] == list(range(stopped_at + 1, REF_ITERS + 1))
    assert losses(resumed) == losses(ref)[stopped_at:]
    assert resumed[-1]["val_loss"] == ref[-1]["val_loss"]
    assert resumed[-1]["grpo_tier_map"] == ref[-1]["grpo_tier_map"]
    assert not job.leftovers
    return len(resumed)


def _check_checkpoint(ckpt, iteration):
    assert (ckpt / checkpointing.TRACKER).read_text() == str(iteration)
    manifest = checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), iteration))
    assert not list(ckpt.glob("*.tmp"))
    return len(manifest["files"])


def test_sigterm_on_one_rank_saves_that_iteration_on_all_and_resumes_bit_identically(
        reference, tmp_path, table):
    # Only rank 1 is signalled (before iteration 6); rank 0 learns of it through the per-iteration
    # agreement, so both finish iteration 6, save it together and leave. A local flag would let
    # rank 1 leave alone and rank 0 hang in iteration 7's collectives.
    ckpt, metrics, k = tmp_path / "ckpt", str(tmp_path / "m.jsonl"), 6
    job = run_job(tmp_path / "job", 2, [*reference["args"], "--save", ckpt, "--save-interval",
                                        REF_SAVE_INTERVAL, "--metrics-file", metrics],
                  faults=[f"sigterm:1:{k}"])
    assert job.rc == 0, job.text[-4000:]
    said = first_line(job.out, "SIGTERM on")
    assert said.endswith(f"SIGTERM on 1 of 2 rank(s): stopped after iteration {k} of {REF_ITERS}; "
                         f"saved checkpoint {checkpointing.iteration_dir(str(ckpt), k)}; "
                         f"resume with --load {ckpt}"), said
    first = read_metrics(metrics)
    assert [r["iteration"] for r in first] == list(range(1, k + 1))
    assert losses(first) == losses(reference["records"])[:k]
    # The agreement's all-reduce is not step traffic: wire_bytes per iteration as without it
    # (the reference run's, and tests/multiproc/test_training.py's analytic figures).
    assert [r["wire_bytes"] for r in first] == [r["wire_bytes"] for r in reference["records"][:k]]
    nfiles = _check_checkpoint(ckpt, k)
    assert not job.leftovers
    n = _resume_and_compare(tmp_path, reference, str(ckpt), metrics, k)
    table.row(GROUP, f"SIGTERM to rank 1 only, before iteration {k} (rank 0 never signalled); "
                     f"--save-interval {REF_SAVE_INTERVAL}",
              "all ranks stop after the same iteration, save it, exit 0; --load resumes bit-identically",
              f"torchrun rc {job.rc} after {job.seconds:.0f} s; rank 0 printed \"{said.split('] ', 1)[-1]}\"; "
              f"iter_{k:07d} complete ({nfiles} files verified), tracker {k}; resumed "
              f"{n} iterations, losses and val_loss bit-identical to the uninterrupted run; "
              f"wire_bytes unchanged by the agreement")


@pytest.mark.reliability_slow
@pytest.mark.parametrize("who", ["torchrun", "every process"])
def test_sigterm_from_outside_mid_run(reference, tmp_path, table, who):
    # SLURM preemption signals every task of the step (here: torchrun and every rank, as
    # slurmstepd does); plain torchrun forwards its own SIGTERM to each rank's process group.
    # Ranks sleep 0.3 s per iteration so the signal lands mid-run, at no particular point.
    ckpt, metrics = tmp_path / "ckpt", str(tmp_path / "m.jsonl")
    running = start_job(tmp_path / "job", 2, [*reference["args"], "--save", ckpt, "--save-interval",
                                              REF_SAVE_INTERVAL, "--metrics-file", metrics],
                        faults=["slow:0.3"])
    running.wait_for_records(metrics, 5, timeout=240)
    os.killpg(running.proc.pid, signal.SIGTERM)
    if who == "every process":
        for rank in (0, 1):
            os.killpg(running.rank_pid(rank), signal.SIGTERM)
    job = running.finish(timeout=120)
    said = first_line(job.out, "SIGTERM on")
    assert said, job.text[-4000:]
    k = int(said.split("stopped after iteration ")[1].split()[0])
    assert k >= 5
    assert [r["iteration"] for r in read_metrics(metrics)] == list(range(1, k + 1))
    nfiles = _check_checkpoint(ckpt, k)
    assert not job.leftovers
    # torchrun itself was signalled: it reports that and exits 1 once its ranks are done.
    assert job.rc != 0 and "SignalException" in job.err
    n = _resume_and_compare(tmp_path, reference, str(ckpt), metrics, k)
    table.row(GROUP, f"SIGTERM to {'torchrun (it forwards to each rank)' if who == 'torchrun' else 'torchrun and every rank, as SLURM does'}, "
                     f"after iteration 5 was logged",
              "checkpoint of the iteration in progress, ranks exit; resume bit-identical",
              f"ranks stopped after iteration {k}: \"{said.split('] ', 1)[-1].split(';')[0]}\"; "
              f"iter_{k:07d} complete ({nfiles} files), tracker {k}; torchrun rc {job.rc} "
              f"(its own SignalException) {job.seconds:.0f} s after start; no process left; "
              f"resumed {n} iterations bit-identically")


@pytest.mark.reliability_slow
def test_sigterm_without_save_exits_cleanly(reference, tmp_path, table):
    metrics, k = str(tmp_path / "m.jsonl"), 3
    job = run_job(tmp_path / "job", 2, [*reference["args"], "--metrics-file", metrics],
                  faults=[f"sigterm:0:{k}"])
    assert job.rc == 0, job.text[-4000:]
    said = first_line(job.out, "SIGTERM on")
    assert said.endswith(f"stopped after iteration {k} of {REF_ITERS}; no --save, so no checkpoint"), said
    assert [r["iteration"] for r in read_metrics(metrics)] == list(range(1, k + 1))
    table.row(GROUP, f"SIGTERM to rank 0 before iteration {k}, no --save",
              "stop after the iteration, exit 0, say there is no checkpoint",
              f"rc {job.rc}; \"{said.split('] ', 1)[-1]}\"")
