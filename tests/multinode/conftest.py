"""Fixtures of the multi-node tests: one local 2-node SLURM cluster per session and a helper that
submits the project's real sbatch script in CPU/gloo mode (the corpus, stdlib_data, is
tests/conftest.py's)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: harness

from megatron_grpo.bench.slurm_cluster import (ClusterError, LocalCluster, down_on_signals,  # noqa: E402
                                               install_packages, unavailable_reason)
from harness import REPO  # noqa: E402

SBATCH = os.path.join(REPO, "launch", "slurm", "pretrain_gpt_grpo.sbatch")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"local SLURM cluster unavailable: {reason}")
    try:
        install_packages()
    except (ClusterError, OSError, TimeoutError) as exc:
        if os.environ.get("CI"):  # CI must run these tests, not silently skip them
            pytest.fail(f"cannot install the SLURM/munge packages: {exc}")
        pytest.skip(f"SLURM/munge packages missing and not installable: {exc}")
    cluster = LocalCluster(str(tmp_path_factory.mktemp("slurm")))
    with down_on_signals(cluster):  # SIGTERM / SIGINT to pytest leave nothing running either
        cluster.up()
        try:
            yield cluster
        finally:
            leftovers = cluster.down()
            assert not leftovers, f"local cluster teardown left: {leftovers}"


@pytest.fixture(scope="session")
def sbatch(slurm_cluster):
    """sbatch(workdir, name, flags, nodes=2, timeout=240, **env) -> (JobResult, rank log dir).

    CPU mode, shared filesystem (the nodes share this machine's), node-local data caches under
    workdir/local, per-rank logs in workdir/NAME.ranks, job output in workdir/NAME.out."""

    def submit(workdir, name, flags, nodes=2, timeout=240, wait=True, **env):
        workdir = str(workdir)
        logs = os.path.join(workdir, f"{name}.ranks")
        job_env = dict(GRPO_ROOT=REPO, PYTHON=sys.executable, GRPO_DEVICE="cpu", SHARED_FS="1",
                       NODE_LOCAL_DIR=os.path.join(workdir, "local"), LOG_DIR=logs,
                       PYTHONWARNINGS="ignore", RDZV_TIMEOUT="60",
                       OMP_NUM_THREADS="1")  # as harness.run_training: results compared bit for bit
        job_env.update(env)
        job_id = slurm_cluster.submit(SBATCH, [str(f) for f in flags], env=job_env, nodes=nodes,
                                      output=os.path.join(workdir, f"{name}.out"), chdir=REPO)
        if not wait:
            return job_id, logs
        return slurm_cluster.wait(job_id, timeout), logs

    return submit
