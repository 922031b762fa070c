"""kill -9 of the launcher (the torchrun agent): its ranks stop within a bounded time, without
saving. Before, they were reparented to PID 1, trained to the end and wrote checkpoints the next
job (resubmitted because this one "died") then raced with.

Two launch paths: torchrun starting the ranks itself (``torchrun launch/pretrain_gpt.py``), and
the path of launch/run_local.sh and the SLURM script, where torchrun starts
launch/slurm/rank_exec.sh, which starts the training process in its own session: there the
agent is the rank's grandparent, and the wrapper outlives the agent."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from harness import ENTRY, REPO, SMALL_MODEL, env, free_port
from reliability_harness import JOB_ENV, job_processes, kill_job
from megatron_grpo.training import checkpointing
from megatron_grpo.training.safety import checkpoint_dirs

GROUP = "kill -9 of the launcher"
BOUND_S = 20  # from the agent's death to the last rank process gone (the watch polls every second)
SAVE_INTERVAL = 5
GONE = "this rank stops now without saving a checkpoint (exit status 4)"
RANK_EXEC = os.path.join(REPO, "launch", "slurm", "rank_exec.sh")


def _start(workdir, path: str, args):
    job_id = uuid.uuid4().hex
    e = env({JOB_ENV: job_id, "GRPO_LOG_DIR": str(workdir / "ranks")})
    rdzv = ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    if path == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, ENTRY, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--no-python", "bash", RANK_EXEC,
               sys.executable, ENTRY, *args]
    out = open(workdir / "job.out", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, job_id, out


def _present(ckpt):
    """Iterations of every iter_N and iter_N.tmp under ckpt (a save under way counts)."""
    return {int(p.name[5:].split(".")[0]) for p in ckpt.glob("iter_*")}


@pytest.mark.parametrize("path", ["torchrun", "rank_exec"])
def test_ranks_stop_without_saving_when_the_agent_is_killed(stdlib_data, tmp_path, table, path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    tracker = ckpt / checkpointing.TRACKER
    args = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", "200", "--eval-interval", "1000",
            "--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL), "--metrics-file", str(metrics)]
    proc, job_id, out = _start(tmp_path, path, args)
    try:
        # The event: the first checkpoint is complete (its tracker is written), not a time budget.
        deadline = time.monotonic() + 300  # a hang guard only
        while not (tracker.exists() and tracker.read_text() == str(SAVE_INTERVAL)):
            assert proc.poll() is None, f"job ended (rc {proc.returncode}):\n{open(out.name).read()[-4000:]}"
            assert time.monotonic() < deadline, f"no checkpoint after 300 s:\n{open(out.name).read()[-4000:]}"
            time.sleep(0.05)
        ranks = [p for p in job_processes(job_id) if p != proc.pid]
        os.kill(proc.pid, signal.SIGKILL)  # not reaped until the end: a zombie agent must count as dead
        killed_at = time.monotonic()
        before = _present(ckpt)  # right after the kill: a save under way then may still complete
        while job_processes(job_id) and time.monotonic() - killed_at < BOUND_S:
            time.sleep(0.1)
        took = time.monotonic() - killed_at
        left = job_processes(job_id)
        text = open(out.name).read()
        after = checkpoint_dirs.iteration_dirs(str(ckpt))
        assert not left, (f"{len(left)} process(es) of the job still alive {BOUND_S} s after the agent was "
                          f"killed (ranks then: {ranks}); checkpoints now {after}, at the kill "
                          f"{sorted(before)}:\n{text[-3000:]}")
        assert set(after) <= before, f"checkpoints {sorted(set(after) - before)} were written after the kill"
        newest = int(tracker.read_text())
        assert newest in before
        checkpointing.verify_checkpoint(checkpointing.iteration_dir(str(ckpt), newest))
        said = {r: [line for line in text.splitlines() if line.startswith(f"error (rank {r} on ")]
                for r in (0, 1)}
        for r in (0, 1):  # a rank that lost its peer first also names the launcher, not the peer
            assert len(said[r]) == 1 and GONE in said[r][0], text[-3000:]
        assert not (ckpt / ".megatron_grpo_save.lock").exists(), "the dead job left its --save lock"
        how = ("ranks started by torchrun" if path == "torchrun"
               else "torchrun -> rank_exec.sh -> rank, as run_local.sh and the SLURM script")
        table.row(GROUP, f"kill -9 of the torchrun agent ({how}) after checkpoint {SAVE_INTERVAL} of a "
                         f"200-iteration run",
                  f"every rank stops within {BOUND_S} s, saves nothing, says why",
                  f"all {len(ranks)} processes of the job gone {took:.1f} s after the kill; checkpoints "
                  f"{sorted(after)}, tracker {newest}; rank 0 said \"{said[0][0][:170]}...\"", case="30.3")
    finally:
        kill_job(job_id)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        out.close()
