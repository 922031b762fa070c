"""megatron_grpo.bench.slurm_cluster.down_on_signals: SIGTERM or SIGINT to a process holding the local SLURM
cluster takes the cluster down before the process dies of that signal (an interrupted
suite left munged, slurmctld, both slurmd and two network namespaces running). A cluster double
records its teardown; tests/multinode/test_slurm_cluster_sigterm.py does it with the real cluster."""

import os
import signal
import subprocess
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from megatron_grpo.bench.slurm_cluster import down_on_signals

class Double:
    def down(self):
        with open({marker!r}, "a") as fh:
            fh.write("down\\n")
        return []

if {guarded}:
    with down_on_signals(Double()):
        print("ready", flush=True)
        time.sleep(60)
else:
    print("ready", flush=True)
    time.sleep(60)
"""


def _interrupt(tmp_path, signum, guarded=True):
    marker = tmp_path / "down.txt"
    code = SCRIPT.format(repo=REPO, marker=str(marker), guarded=guarded)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"  # the handlers are installed: signal now
        proc.send_signal(signum)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, (marker.read_text() if marker.exists() else "")


def test_sigterm_takes_the_cluster_down_once_then_ends_the_process(tmp_path):
    rc, marker = _interrupt(tmp_path, signal.SIGTERM)
    assert marker == "down\n"
    assert rc == -signal.SIGTERM  # died of the same signal, as it would have without the cluster


def test_sigint_takes_the_cluster_down_then_raises_keyboard_interrupt(tmp_path):
    rc, marker = _interrupt(tmp_path, signal.SIGINT)
    assert marker == "down\n"
    # The KeyboardInterrupt went up uncaught, and Python ends such a process by SIGINT.
    assert rc == -signal.SIGINT


def test_without_it_sigterm_leaves_the_cluster_up(tmp_path):
    rc, marker = _interrupt(tmp_path, signal.SIGTERM, guarded=False)
    assert rc == -signal.SIGTERM and marker == ""


def test_down_removes_the_daemons_when_the_controller_does_not_answer(monkeypatch, tmp_path):
    """scancel / squeue timing out (a controller that hangs, a loaded machine) must not stop
    down() from terminating the daemons: the teardown that runs on SIGTERM depends on it."""
    import subprocess

    from megatron_grpo.bench import slurm_cluster

    class Proc:
        def __init__(self):
            self.terminated = False

        def poll(self):
            return 0 if self.terminated else None

        def terminate(self):
            self.terminated = True

        def wait(self, timeout=None):
            return 0

    def hanging(cmd, timeout=30, check=True, env=None):
        if cmd[0] in ("scancel", "squeue"):
            raise subprocess.TimeoutExpired(cmd, timeout)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(slurm_cluster, "_run", hanging)
    cluster = slurm_cluster.LocalCluster(str(tmp_path))
    cluster.tag = "mg-test-double"  # no link of this name exists: the link wait ends at once
    daemons = {"n1": Proc(), "n2": Proc(), "slurmctld": Proc(), "munged": Proc()}
    cluster.procs = dict(daemons)
    problems = cluster.down()
    assert [name for name, p in daemons.items() if not p.terminated] == []
    assert problems == ["jobs not cancelled (TimeoutExpired); their processes are killed"]
