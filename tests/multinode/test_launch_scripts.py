"""The launch scripts without a cluster: environment check, flag plan (CUDA_DEVICE_MAX_CONNECTIONS
rule), and launch/run_local.sh training on one machine with per-rank logs. No root needed."""

import os
import socket
import subprocess
import sys

from megatron_grpo.bench.slurm_cluster import rank_logs
from harness import REPO, SMALL_MODEL, env, read_metrics


def _run(cmd, **extra):
    return subprocess.run(cmd, cwd=REPO, env=dict(env(), **extra), capture_output=True, text=True,
                          timeout=300)


def test_env_check_names_exactly_what_is_missing(tmp_path):
    prefix = str(tmp_path / "corpus")
    open(prefix + ".bin", "w").close()
    proc = _run(["bash", "launch/env.sh", "--device", "cpu", "--data-path", prefix], PYTHON=sys.executable)
    host = socket.gethostname()
    assert proc.returncode == 1
    missing = [ln for ln in proc.stdout.splitlines() if " MISSING " in ln]
    assert [ln.split("MISSING", 1)[1].split(":")[0].strip() for ln in missing] == [
        f"data {prefix}.idx", f"data {prefix}.meta.json"]
    assert f"[env {host}] ok       megatron-core 0.16.1" in proc.stdout
    assert f"[env {host}] 2 problem(s)" in proc.stderr
    proc = _run(["bash", "launch/env.sh", "--slurm"], PYTHON=sys.executable, SLURM_JOB_ID="",
                SLURM_JOB_NODELIST="", SLURM_JOB_NUM_NODES="")
    assert proc.returncode == 1 and "MISSING  SLURM_JOB_ID: not set" in proc.stdout
    proc = _run(["bash", "launch/env.sh"], PYTHON=str(tmp_path / "no-python"))
    assert proc.returncode == 1 and f"'{tmp_path / 'no-python'}' not found" in proc.stdout


def test_plan_applies_megatron_cuda_max_connections_rule(tmp_path):
    def plan(*flags, world=4):
        proc = _run([sys.executable, "launch/slurm/job_setup.py", "plan", "--world-size", str(world),
                     "--", "--data-path", "x", *flags])
        assert proc.returncode == 0, proc.stderr
        return dict(line.split("=", 1) for line in proc.stdout.splitlines())

    tp2 = plan("--tensor-model-parallel-size", "2", "--global-batch-size", "8")
    assert tp2["GRPO_CUDA_MAX_CONNECTIONS"] == "1" and tp2["GRPO_DP"] == "2"
    tp1 = plan("--global-batch-size", "16", "--save", "/ck")
    assert tp1["GRPO_CUDA_MAX_CONNECTIONS"] == "''" and tp1["GRPO_SAVE"] == "/ck"
    bad = _run([sys.executable, "launch/slurm/job_setup.py", "plan", "--world-size", "3", "--",
                "--data-path", "x", "--global-batch-size", "16"])
    assert bad.returncode == 2
    assert ("--global-batch-size (16) must be a multiple of --micro-batch-size x data-parallel "
            "size (4 x 3)") in bad.stderr


def test_run_local_trains_with_per_rank_logs(stdlib_data, tmp_path):
    logs = tmp_path / "ranks"
    proc = _run(["bash", "launch/run_local.sh", *SMALL_MODEL, "--data-path", stdlib_data,
                 "--train-iters", "4", "--log-interval", "2", "--metrics-file", str(tmp_path / "m.jsonl"),
                 "--data-cache-dir", str(tmp_path / "cache")],
                PYTHON=sys.executable, NPROC_PER_NODE="2", GRPO_DEVICE="cpu", LOG_DIR=str(logs))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    host = socket.gethostname()
    progress = {k: v["progress"] for k, v in rank_logs(str(logs)).items()}
    assert progress == {(0, host): [2, 4], (1, host): [2, 4]}
    assert sorted(os.listdir(logs)) == [f"rank-0000{r}.{host}.{ext}"
                                        for r in (0, 1) for ext in ("log", "pid")]
    assert [r["iteration"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3, 4]
