"""A rank's watch on its launcher (megatron_grpo/training/safety/launcher_watch.py): when the launcher
counts as gone, and that the process then exits with LAUNCHER_GONE_EXIT, saying why, without
running its SIGTERM handler or any finally block."""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_grpo.training.safety.launcher_watch import (LAUNCHER_GONE_EXIT, PID_ENV, START_ENV, LauncherWatch,
                                                   from_environment, start_ticks)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def launcher():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_gone_when_the_launcher_exits_is_a_zombie_or_its_pid_is_reused(launcher):
    ticks = start_ticks(launcher.pid)
    watch = LauncherWatch(launcher.pid, ticks, os.getppid(), "test launcher")
    assert watch.gone() is None
    assert LauncherWatch(launcher.pid, ticks + 1, os.getppid(), "x").gone() == \
        f"pid {launcher.pid} now belongs to another process"
    launcher.kill()
    while start_ticks(launcher.pid) is not None:  # a zombie until reaped
        time.sleep(0.01)
    assert watch.gone() == f"process {launcher.pid} has exited"
    launcher.wait()
    assert watch.gone() == f"process {launcher.pid} has exited"


def test_gone_when_the_parent_changed():
    watch = LauncherWatch(os.getppid(), start_ticks(os.getppid()), os.getppid() + 100000, "x")
    assert watch.gone() == (f"this rank's parent process {os.getppid() + 100000} exited (the rank now "
                            f"belongs to pid {os.getppid()})")


def test_which_launcher_is_watched():
    assert from_environment(environ={}) is None  # python launch/pretrain_gpt.py: no launcher
    direct = from_environment("ckpt", environ={"TORCHELASTIC_RUN_ID": "x"})
    assert (direct.launcher_pid, direct.launcher_ticks, direct.parent_pid) == \
        (os.getppid(), start_ticks(os.getppid()), os.getppid())
    wrapped = from_environment(environ={"TORCHELASTIC_RUN_ID": "x", PID_ENV: "1234", START_ENV: "99"})
    assert (wrapped.launcher_pid, wrapped.launcher_ticks, wrapped.parent_pid) == (1234, 99, os.getppid())


CHILD = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {repo!r})
    from megatron_grpo.training.safety.launcher_watch import from_environment
    signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM handler ran (it would save)", flush=True))
    watch = from_environment("/ckpt")
    watch.poll_s = 0.1
    watch.before_exit(lambda: print("lock released", flush=True))
    watch.start()
    print("watching", flush=True)
    try:
        time.sleep(60)
    finally:
        print("finally ran (a save could run here)", flush=True)
""")


def test_the_rank_exits_without_saving_when_the_launcher_dies(launcher):
    env = dict(os.environ, RANK="3", **{PID_ENV: str(launcher.pid), START_ENV: str(start_ticks(launcher.pid))})
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=REPO)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline() == "watching\n"
        launcher.send_signal(signal.SIGKILL)  # left a zombie: its parent (this test) does not reap it yet
        t0 = time.monotonic()
        rc = child.wait(timeout=20)
        took = time.monotonic() - t0
        out, err = child.communicate()
    finally:
        child.kill()
        child.wait()
    assert rc == LAUNCHER_GONE_EXIT and took < 5, (rc, took, err)
    assert out == "lock released\n"  # no SIGTERM handler, no finally
    assert err.startswith(f"error (rank 3 on {os.uname().nodename}): the launcher (torchrun agent, via "
                          f"launch/slurm/rank_exec.sh, pid {launcher.pid}) is gone (process {launcher.pid} "
                          f"has exited); this rank stops now without saving a checkpoint (exit status 4); "
                          f"the checkpoints already in --save /ckpt are kept: resume from them with --load "
                          f"/ckpt."), err


OUT_OF_FILES = textwrap.dedent("""
    import os, resource, sys, time
    sys.path.insert(0, {repo!r})
    from megatron_grpo.training.safety.launcher_watch import from_environment
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    watch = from_environment("/ckpt")
    watch.poll_s = 0.1
    watch.start()
    held = []  # every descriptor this process may have, as a save that ran out holds them
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    time.sleep(1.0)  # ten polls
    watch.check()  # as before a save
    print("alive", flush=True)
    time.sleep(60)
""")


def test_out_of_descriptors_names_the_open_file_limit_not_the_launcher(launcher):
    """A rank that ran out of descriptors cannot read /proc: its watch once took that for a dead
    launcher and killed the rank mid-save, blaming a live torchrun. Now it says which limit was
    hit, keeps the rank running while the launcher lives, and still sees the launcher go."""
    env = dict(os.environ, RANK="3", **{PID_ENV: str(launcher.pid), START_ENV: str(start_ticks(launcher.pid))})
    child = subprocess.Popen([sys.executable, "-c", OUT_OF_FILES.format(repo=REPO, limit=256)], env=env,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = child.stdout.readline()
        launcher.kill()
        launcher.wait()  # reaped: a pid that is gone, which kill(pid, 0) sees without a descriptor
        rc = child.wait(timeout=20)
        out, err = child.communicate()
    finally:
        child.kill()
        child.wait()
    assert line == "alive\n", err
    limit, gone = err.splitlines()
    assert limit == (f"error (rank 3 on {os.uname().nodename}): this process has reached its open-file limit "
                     f"(EMFILE, errno 24: Too many open files; `ulimit -n` is 256 here, hard limit "
                     f"{resource.getrlimit(resource.RLIMIT_NOFILE)[1]}); raise it before the job starts, e.g. "
                     f"`ulimit -n 65536` in the sbatch script (up to the hard limit; above it needs the node's "
                     f"limits.conf). The launcher watch cannot read /proc/{launcher.pid}/stat now, so it checks "
                     f"the launcher (torchrun agent, via launch/slurm/rank_exec.sh, pid {launcher.pid}) by its pid "
                     f"alone; the launcher is not what failed. Whatever else this rank opens meanwhile (a "
                     f"checkpoint, the data, the SSD tier's file) fails the same way.")
    assert rc == LAUNCHER_GONE_EXIT and f"(process {launcher.pid} has exited)" in gone, (rc, err)
