"""One job per checkpoint directory: a job whose --save is held by another live job stops at
start, on every rank, naming the lock and its owner, and writes nothing there. Before, two
overlapping jobs on one --save both exited 0 and each replaced the other's checkpoints.

The first job is this test process holding the lock (what rank 0 of a running job holds): the
refusal is decided at start, so a second training run would only cost time."""

import os
import socket

from harness import SMALL_MODEL
from reliability_harness import rank_errors, run_job, torchrun_failure, tree_digest
from megatron_grpo.training import checkpointing
from megatron_grpo.training.safety.save_lock import LOCK_NAME, SaveLock

GROUP = "One job per checkpoint directory"


def test_second_job_on_a_held_save_directory_stops_at_start(stdlib_data, tmp_path, table):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    # The first job's checkpoint (stand-in content: nothing may touch it) and its lock.
    (ckpt / "iter_0000005").mkdir(parents=True)
    (ckpt / "iter_0000005" / "common.pt").write_bytes(b"the first job's checkpoint")
    (ckpt / checkpointing.TRACKER).write_text("5")
    first = SaveLock(str(ckpt))
    first.acquire()
    try:
        before = tree_digest(ckpt)
        job = run_job(tmp_path / "job", 2, [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", "4",
                                            "--seed", "99", "--save", ckpt, "--save-interval", "1",
                                            "--metrics-file", metrics], probe=False, timeout=240)
        after = tree_digest(ckpt)
        still = first.still_held()
    finally:
        first.release()
    assert after == before, (f"the second job (rc {job.rc}) changed the first job's directory: now "
                             f"{sorted(after)}")
    errors = rank_errors(job.err)
    lock = os.path.join(str(ckpt), LOCK_NAME)
    for rank in (0, 1):
        said = errors.get(rank, "")
        assert f"--save {ckpt} is in use by another job: {lock} is held by pid {os.getpid()} on host " \
               f"{socket.gethostname()}" in said, job.text[-4000:]
        assert f"remove {lock} and start again (lock taken by rank 0, at start; this is rank {rank})." in said
    summary = torchrun_failure(job.err)
    assert job.rc == 1 and "exitcode 2" in summary and not job.leftovers, job.text[-4000:]
    assert still is None, still
    assert not metrics.exists(), "the second job trained"
    table.row(GROUP, "a second 2-rank job (seed 99) with the --save of a live job (holding its lock, "
                     "checkpoint 5 written)",
              "the second job stops at start on every rank naming the lock and its owner; the first "
              "job's directory unchanged",
              f"rc {job.rc}; {summary}; rank 1 said \"{errors[1].replace(str(tmp_path) + '/', '')[:400]}\"; "
              f"directory unchanged (sha256 of every file, the lock included)", case="30.2")
