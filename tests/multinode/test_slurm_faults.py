"""Failures on the local 2-node SLURM cluster end jobs quickly, with errors that name the rank
and host, and the next job resumes from the last checkpoint."""

import glob
import os
import re
import signal
import time

import pytest

from megatron_grpo.bench.slurm_cluster import rank_logs
from harness import SMALL_MODEL, losses, read_metrics

pytestmark = pytest.mark.multinode

BOUND_S = 60  # a dead peer must end the job in seconds, not after a 10-minute collective timeout


def _wait_for(what, predicate, timeout, job=None, cluster=None):
    t0 = time.monotonic()
    while not predicate():
        state = cluster.job_info(job).get("JobState") if job is not None else "RUNNING"
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job} ended while waiting for {what}")
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)


def _last_iteration(path):
    try:
        return len(read_metrics(path))
    except OSError:
        return 0


def test_killed_rank_fails_the_job_fast_and_the_next_job_resumes(sbatch, slurm_cluster, stdlib_data, tmp_path):
    ckpt, tracker = tmp_path / "ckpt", tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    # Many iterations: the job must still be running when a rank is killed.
    flags = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", 2000, "--eval-interval", 1000,
             "--save", ckpt, "--save-interval", 5]
    job, logs = sbatch(tmp_path, "killed", [*flags, "--metrics-file", tmp_path / "killed.jsonl"],
                       wait=False)
    # Kill once a checkpoint exists and the run is 2 iterations past it (so the resumed job
    # recomputes iterations the killed one logged).
    _wait_for("checkpoint 5 or later", lambda: tracker.exists(), 240, job, slurm_cluster)
    _wait_for("2 iterations past the checkpoint",
              lambda: _last_iteration(tmp_path / "killed.jsonl") >= int(tracker.read_text()) + 2,
              60, job, slurm_cluster)
    [pid_file] = glob.glob(os.path.join(logs, "rank-*.n2.pid"))
    victim_rank = int(os.path.basename(pid_file).split(".")[0].split("-")[1])
    pid = int(open(pid_file).read())
    os.kill(pid, signal.SIGKILL)
    killed = slurm_cluster.wait(job, timeout=BOUND_S + 60)
    assert killed.state == "FAILED"
    assert killed.seconds < BOUND_S, f"job took {killed.seconds:.1f} s to fail after the kill"
    out = killed.output
    assert f"error (rank {victim_rank} on n2): training process {pid} was killed by signal KILL" in out
    # The surviving rank reports the lost peer by address and host, not a bare traceback.
    survivor = 1 - victim_rank
    assert f"error (rank {survivor} on n1): peer failure (peer {slurm_cluster.node_addr('n2')} = n2)" in out
    assert "training failed (srun exit" in out

    last = int(tracker.read_text())
    logged = read_metrics(tmp_path / "killed.jsonl")
    assert logged[-1]["iteration"] >= last + 2
    resumed, resumed_logs = sbatch(tmp_path, "resumed", [
        *flags, "--load", ckpt, "--exit-after-iter", last + 3, "--log-interval", 1,
        "--metrics-file", tmp_path / "resumed.jsonl"])
    assert resumed.state == "COMPLETED", resumed.output[-4000:]
    assert f"start_iter={last}" in resumed.output
    again = read_metrics(tmp_path / "resumed.jsonl")
    assert [r["iteration"] for r in again] == [last + 1, last + 2, last + 3]
    # Same checkpoint, data position and RNG: the killed job's iterations recur bit for bit.
    assert losses(again)[:2] == losses(logged[last:last + 2])
    for entry in rank_logs(resumed_logs).values():  # both nodes continued from the checkpoint
        assert entry["progress"] == [last + 1, last + 2, last + 3]


def test_rendezvous_that_cannot_complete_fails_clearly(sbatch, slurm_cluster, stdlib_data, tmp_path):
    flags = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", 4]
    # Nothing listens at .99 on the cluster's bridge: every node waits, then gives up.
    host = f"{slurm_cluster.subnet}.99"
    job, _ = sbatch(tmp_path, "wrong_host", flags, RDZV_HOST=host, RDZV_TIMEOUT="10", timeout=120)
    assert job.state == "FAILED"
    assert job.seconds < 90, job.seconds
    # The first node to give up ends the step on both (srun --kill-on-bad-exit).
    reported = re.findall(rf"error \(node (n\d) \(node index \d of job {job.job_id}\)\): torchrun exited 1 "
                          rf"before starting any rank: the rendezvous at {re.escape(host)}:\d+ did not "
                          rf"complete within 10 s", job.output)
    assert reported and set(reported) <= {"n1", "n2"}, job.output[-3000:]

    # A one-node allocation asked to rendezvous with two nodes is refused before anything starts.
    one, _ = sbatch(tmp_path, "one_node", flags, nodes=1, NNODES="2", timeout=60)
    assert one.state == "FAILED" and one.seconds < 30
    assert (f"error (job {one.job_id} on n1): NNODES=2 but the allocation has 1 node(s) (n1): "
            f"a rendezvous for 2 could never complete") in one.output


def test_checkpoints_on_several_nodes_need_a_shared_filesystem(sbatch, stdlib_data, tmp_path):
    flags = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", 4, "--save", tmp_path / "ck"]
    job, _ = sbatch(tmp_path, "unshared", flags, SHARED_FS="0", timeout=60)
    assert job.state == "FAILED" and job.exit_code == 2
    assert (f"--save/--load ({tmp_path / 'ck'}) on 2 nodes needs a filesystem that all nodes "
            f"share") in job.output and "SHARED_FS=1" in job.output
    assert not (tmp_path / "ck").exists()  # refused before any node started
