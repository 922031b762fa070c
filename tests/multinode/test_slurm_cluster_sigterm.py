"""The real local SLURM cluster, interrupted: SIGTERM to the process that holds it (as
`timeout`, a cancelled CI job or `kill` send to pytest) leaves no daemon and no network
namespace behind (megatron_grpo.bench.slurm_cluster.down_on_signals; the fast test with a cluster double
is tests/unit/test_down_on_signals.py). Its own cluster, beside the session's (they coexist);
starting one takes about a second."""

import os
import signal
import subprocess
import sys

import pytest

from megatron_grpo.bench.slurm_cluster import unavailable_reason

pytestmark = pytest.mark.multinode
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from megatron_grpo.bench.slurm_cluster import LocalCluster, down_on_signals

cluster = LocalCluster({root!r})
with down_on_signals(cluster):
    cluster.up()
    print("up", cluster.tag, flush=True)
    time.sleep(120)
"""


def _left(root, tag):
    """Processes started from the cluster's directory, and its namespaces."""
    procs = []
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if root in cmd and "python" not in cmd:
            procs.append(cmd)
    namespaces = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout.split() if n.startswith(tag)]
    return procs, namespaces


def test_sigterm_takes_the_real_cluster_down(slurm_cluster_packages, tmp_path):
    root = str(tmp_path / "cluster")
    os.makedirs(root)
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(repo=REPO, root=root)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()  # the event: the cluster is up
        assert line[:1] == ["up"], line
        tag = line[1]
        procs, namespaces = _left(root, tag)
        assert any("slurmctld" in p for p in procs) and len(namespaces) == 2  # it was up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _left(root, tag) == ([], [])


@pytest.fixture
def slurm_cluster_packages():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"local SLURM cluster unavailable: {reason}")
    from megatron_grpo.bench.slurm_cluster import install_packages

    install_packages()
