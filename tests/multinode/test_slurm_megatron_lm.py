"""launch/slurm/megatron_lm_grpo.sbatch on the local 2-node SLURM cluster: a Megatron-LM
"checkout" (megatron-core 0.19.2's training package and a pretrain_gpt.py-shaped script) trains
through the GRPO runner, one rank per node, gloo across the nodes' network namespaces."""

import json
import os
import shutil
import sys

from harness import REPO

SCRIPT = os.path.join(REPO, "launch", "slurm", "megatron_lm_grpo.sbatch")
INSTALL = os.path.join(sys.prefix, "megatron-lm-0.19.2")
SHIM = os.path.join(REPO, "tests", "megatron_lm", "py311")
DRIVER = os.path.join(REPO, "tests", "megatron_lm", "gpt_driver.py")
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--vocab-size", "512",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--log-interval", "5",
         "--eval-iters", "0", "--eval-interval", "1000", "--train-iters", "16",
         "--grpo", "--grpo-compress", "all", "--grpo-bucket-mb", "0.05", "--grpo-warmup-iters", "4",
         "--grpo-retier-interval", "6", "--rerun-mode", "disabled"]


def test_a_megatron_lm_checkout_trains_with_grpo_on_two_nodes(slurm_cluster, tmp_path):
    # What a user's checkout holds, for the script: the megatron package and pretrain_gpt.py.
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    os.symlink(os.path.join(INSTALL, "megatron"), mlm / "megatron")
    shutil.copy(DRIVER, mlm / "pretrain_gpt.py")
    metrics = tmp_path / "grpo.jsonl"
    env = dict(GRPO_ROOT=REPO, PYTHON=sys.executable, MEGATRON_LM=str(mlm), PYTHONPATH=SHIM,
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", RDZV_TIMEOUT="60")
    job = slurm_cluster.run_job(SCRIPT, [*FLAGS, "--grpo-metrics-file", str(metrics)], env=env,
                                output=str(tmp_path / "job.out"), chdir=REPO, timeout=300)
    assert job.state == "COMPLETED" and job.exit_code == 0, job.output[-4000:]
    assert "x 1 rank(s)" in job.output and "finished" in job.output
    records = [json.loads(line) for line in open(metrics) if '"iteration"' in line]
    assert [r["iteration"] for r in records] == list(range(1, 17))
    # Both ranks on their own node: every gradient byte crosses the link between them.
    assert all(r["wire_bytes_inter_node"] >= 0.9 * r["wire_bytes"] > 0 for r in records)
    assert "d" in records[-1]["grpo_tier_map"]
    assert records[-1]["wire_bytes"] < 0.3 * records[0]["wire_bytes"]
    assert records[-1]["loss"] < records[0]["loss"]


def test_the_script_names_what_is_missing(slurm_cluster, tmp_path):
    env = dict(GRPO_ROOT=REPO, PYTHON=sys.executable, MEGATRON_LM=str(tmp_path / "nowhere"))
    job = slurm_cluster.run_job(SCRIPT, ["--grpo"], env=env, output=str(tmp_path / "job.out"),
                                chdir=REPO, timeout=60)
    assert job.exit_code == 2
    assert f"MEGATRON_LM='{tmp_path / 'nowhere'}' has no pretrain_gpt.py" in job.output
