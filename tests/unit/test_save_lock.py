"""The --save lock (megatron_grpo/training/safety/save_lock.py): who may take over a lock, and what the
refusal says. The owners are real processes of this host (alive, exited, zombie, a reused pid)
or lock files written as another host's job would write them."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from megatron_grpo.training.safety import save_lock
from megatron_grpo.training.safety.save_lock import (LOCK_NAME, STALE_AFTER_S, Owner, SaveLock, SaveLockError,
                                              process_state, this_process)

OTHER_NS = "pid:[4026532999]"
"""A PID namespace that is not this process's (a container's)."""


def _owner_of(pid: int, host: str = None) -> Owner:
    state = process_state(pid)
    return replace(this_process(), pid=pid, host=host or socket.gethostname(),
                   start_ticks=state[1] if state else None, job="4242")


def _write(root, owner: Owner, age_s: float = 0.0, drop=(), **fields):
    """The lock file ``owner`` would write, with ``fields`` set and the keys ``drop`` left out."""
    path = os.path.join(str(root), LOCK_NAME)
    data = {k: v for k, v in dict(asdict(owner), **fields).items() if k not in drop}
    with open(path, "w") as fh:
        json.dump(data, fh)
    if age_s:
        _age(path, age_s)
    return path


def _age(path, age_s: float):
    now = os.stat(path).st_mtime
    os.utime(path, (now - age_s, now - age_s))


def _heartbeat_refusal(root, path, owner: Owner, whose: str, age_s: int) -> str:
    """The refusal of a fresh lock under the heartbeat rule (the owner cannot be looked up)."""
    host = socket.gethostname()
    return (f"--save {root} is in use by another job: {path} is held by {owner.describe()} ({whose}: "
            f"refreshed {age_s} s ago; its owner cannot be looked up from {host}, and the lock counts as "
            f"stale only after {STALE_AFTER_S:.0f} s without a refresh). Two jobs saving into one directory "
            f"replace each other's checkpoints. Wait for that job to end, or point --save at another "
            f"directory; if that job is gone (check on {owner.host} or with `squeue -j {owner.job}`), "
            f"remove {path} and start again")


def _token(path):
    return json.load(open(path))["token"]


def _fake_squeue(bin_dir, out: str = "", err: str = "", rc: int = 0):
    path = os.path.join(str(bin_dir), "squeue")
    with open(path, "w") as fh:
        fh.write(f"#!/bin/sh\necho \"$*\" >> {bin_dir}/squeue.calls\nprintf '{out}'\n"
                 f"printf '{err}' >&2\nexit {rc}\n")
    os.chmod(path, 0o755)


@pytest.fixture(autouse=True)
def squeue(tmp_path_factory, monkeypatch):
    """A squeue of our own on PATH (default: no controller to ask), so no test asks a real one."""
    bin_dir = tmp_path_factory.mktemp("bin")
    _fake_squeue(bin_dir, err="squeue: error: Unable to contact slurm controller", rc=1)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)  # outside a SLURM job: nothing recorded
    return bin_dir


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_live_owner_on_this_host_is_refused(tmp_path, sleeper):
    owner = _owner_of(sleeper.pid)
    path = _write(tmp_path, owner)
    with pytest.raises(SaveLockError) as err:
        SaveLock(str(tmp_path)).acquire()
    said = str(err.value)
    host = socket.gethostname()
    assert said.startswith(f"--save {tmp_path} is in use by another job: {path} is held by pid {sleeper.pid} "
                           f"on host {host}, SLURM job 4242, lock taken {owner.started} (its owner is "
                           f"running on this host)."), said
    assert f"check with `ps -p {sleeper.pid}`), remove {path} and start again" in said
    assert _token(path) == owner.token  # untouched


def test_exited_owner_is_taken_over_with_a_warning(tmp_path, sleeper):
    owner = _owner_of(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    path = _write(tmp_path, owner)
    lock = SaveLock(str(tmp_path))
    warning = lock.acquire()
    try:
        assert warning == (f"WARNING: --save {tmp_path}: took over {path}, left by {owner.describe()}: "
                           f"process {sleeper.pid} has exited. That job can no longer save here.")
        assert _token(path) == lock.me.token and lock.still_held() is None
        assert json.load(open(path))["pid"] == os.getpid()
    finally:
        lock.release()
    assert not os.path.exists(path)


def test_zombie_owner_counts_as_exited(tmp_path):
    proc = subprocess.Popen(["sleep", "60"])
    owner = _owner_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    while process_state(proc.pid)[0] != "Z":  # killed, not reaped
        time.sleep(0.01)
    _write(tmp_path, owner)
    lock = SaveLock(str(tmp_path))
    try:
        assert f"process {proc.pid} has exited" in lock.acquire()
    finally:
        lock.release()
        proc.wait()


def test_reused_pid_is_not_the_owner(tmp_path):
    # The pid is alive (it is this process) but started at another time: another process.
    owner = _owner_of(os.getpid())
    owner = replace(owner, start_ticks=owner.start_ticks - 1)
    _write(tmp_path, owner)
    lock = SaveLock(str(tmp_path))
    try:
        assert (f"pid {os.getpid()} now belongs to another process (started at tick {owner.start_ticks + 1}, "
                f"the owner at tick {owner.start_ticks})") in lock.acquire()
    finally:
        lock.release()


def _another_boot(tmp_path, sleeper, monkeypatch):
    # A reboot, or another machine of this name: the pid cannot be looked up (before: taken over
    # at once as "rebooted", a live job's lock included).
    owner = replace(_owner_of(os.getpid()), boot_id="another-boot")
    whose = (f"owner on host {socket.gethostname()}, boot id another-boot, not this host's "
             f"{save_lock.boot_id()} (rebooted since, or another machine of this name)")
    return owner, _write(tmp_path, owner, age_s=120), whose


def _dead_pid_owner(sleeper):
    owner = _owner_of(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    return owner


def _another_pid_namespace(tmp_path, sleeper, monkeypatch):
    # A container sharing the host name (docker --network=host): its owner's pid means nothing
    # here (no such process, as with this dead pid), so a live owner would look dead (before:
    # taken over at once).
    owner = _dead_pid_owner(sleeper)
    whose = (f"owner on host {socket.gethostname()}, in PID namespace {OTHER_NS}, not this "
             f"process's {os.readlink('/proc/self/ns/pid')} (another container)")
    return owner, _write(tmp_path, owner, age_s=120, pid_ns=OTHER_NS), whose


def _older_version(tmp_path, sleeper, monkeypatch):
    # Written before the namespace was recorded: read (its owner named), but where its pid lives
    # is unknown, so a dead-looking pid is not taken over while the lock is fresh.
    owner = _dead_pid_owner(sleeper)
    whose = (f"owner on host {socket.gethostname()}, PID namespace not recorded (a lock written "
             f"by an older version)")
    return owner, _write(tmp_path, owner, age_s=120, drop=("pid_ns",)), whose


def _own_namespace_unreadable(tmp_path, sleeper, monkeypatch):
    # This process cannot tell whether it shares the owner's pid space: the pid is not trusted.
    owner = _dead_pid_owner(sleeper)
    path = _write(tmp_path, owner, age_s=120)  # as this process writes it: its namespace recorded
    monkeypatch.setattr(save_lock, "pid_namespace", lambda: "", raising=False)
    whose = (f"owner on host {socket.gethostname()}, PID namespace unknown here (/proc/self/ns/pid "
             f"cannot be read)")
    return owner, path, whose


@pytest.mark.parametrize("case", [_another_boot, _another_pid_namespace, _older_version,
                                  _own_namespace_unreadable],
                         ids=["another-boot", "another-pid-namespace", "older-version",
                              "own-namespace-unreadable"])
def test_an_owner_whose_pid_cannot_be_judged_follows_the_heartbeat_rule(tmp_path, sleeper, monkeypatch,
                                                                        case):
    """Where this process cannot look the owner's pid up, the lock's age decides: fresh,
    refused naming why; stale, taken over with a warning naming the same."""
    owner, path, whose = case(tmp_path, sleeper, monkeypatch)
    held = _refused_fresh_taken_over_stale(tmp_path, path, owner, whose)
    assert held["pid_ns"] == save_lock.pid_namespace()  # the new lock records its own


def _refused_fresh_taken_over_stale(tmp_path, path, owner, whose: str) -> dict:
    """The heartbeat rule on a lock 120 s old: refused naming ``whose``, the lock untouched;
    then, aged past stale, taken over with a warning naming the same. Returns the new lock."""
    with pytest.raises(SaveLockError) as err:
        SaveLock(str(tmp_path)).acquire()
    assert str(err.value) == _heartbeat_refusal(tmp_path, path, owner, whose, 120)
    assert _token(path) == owner.token
    _age(path, STALE_AFTER_S)
    lock = SaveLock(str(tmp_path))
    try:
        assert lock.acquire().startswith(f"WARNING: --save {tmp_path}: took over {path}, left by "
                                         f"{owner.describe()}: {whose}: not refreshed for ")
        held = json.load(open(path))
        assert held["token"] == lock.me.token
        return held
    finally:
        lock.release()


def test_other_host_fresh_is_refused(tmp_path):
    owner = _owner_of(os.getpid(), host="node-b17")
    path = _write(tmp_path, owner, age_s=120)
    with pytest.raises(SaveLockError) as err:
        SaveLock(str(tmp_path)).acquire()
    said = str(err.value)
    assert f"is held by pid {os.getpid()} on host node-b17, SLURM job 4242" in said
    assert (f"(owner on host node-b17: refreshed 120 s ago; its owner cannot be looked up from "
            f"{socket.gethostname()}, and the lock counts as stale only after {STALE_AFTER_S:.0f} s without "
            f"a refresh)") in said, said
    assert f"(check on node-b17 or with `squeue -j 4242`), remove {path} and start again" in said
    assert _token(path) == owner.token


def test_other_host_stale_is_taken_over(tmp_path):
    owner = _owner_of(os.getpid(), host="node-b17")
    path = _write(tmp_path, owner, age_s=STALE_AFTER_S + 60)
    lock = SaveLock(str(tmp_path))
    try:
        warning = lock.acquire()
        assert f"left by {owner.describe()}: owner on host node-b17: not refreshed for " in warning
        assert f"s (stale after {STALE_AFTER_S:.0f} s; a live owner refreshes it every 30 s)" in warning
        assert _token(path) == lock.me.token
    finally:
        lock.release()


def test_unreadable_lock_follows_the_age_rule(tmp_path):
    path = os.path.join(str(tmp_path), LOCK_NAME)
    open(path, "w").write("{not json")
    with pytest.raises(SaveLockError, match="held by an owner this lock file does not name"):
        SaveLock(str(tmp_path)).acquire()
    old = os.stat(path).st_mtime - STALE_AFTER_S - 1
    os.utime(path, (old, old))
    lock = SaveLock(str(tmp_path))
    try:
        assert "left by an owner it does not name (unreadable): unreadable lock: not refreshed" in lock.acquire()
    finally:
        lock.release()


def test_a_second_acquisition_in_one_process_is_refused_and_release_keeps_the_others(tmp_path):
    first = SaveLock(str(tmp_path))
    assert first.acquire() is None
    with pytest.raises(SaveLockError, match="its owner is running on this host"):
        SaveLock(str(tmp_path)).acquire()
    path = first.path
    # Another job took it over (this one was frozen past the stale time): no save, and release
    # leaves the new owner's lock.
    other = replace(_owner_of(os.getpid(), host="node-c3"), token="other")
    os.remove(path)
    _write(tmp_path, other)
    assert first.still_held() == (
        f"--save {tmp_path}: this job's lock {path} was taken over by {other.describe()} (a job that "
        f"stopped refreshing it for {STALE_AFTER_S:.0f} s, e.g. suspended or cut off from the filesystem, "
        f"loses it). No checkpoint is saved over the other job's; this job stops")
    first.release()
    assert _token(path) == "other"


def test_heartbeat_refreshes_the_lock(tmp_path):
    lock = SaveLock(str(tmp_path), heartbeat_s=0.05)
    lock.acquire()
    try:
        old = time.time() - 1000
        os.utime(lock.path, (old, old))
        deadline = time.monotonic() + 10
        while os.stat(lock.path).st_mtime < old + 500 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.stat(lock.path).st_mtime > old + 500
    finally:
        lock.release()
    assert not os.path.exists(lock.path)


def test_a_takeover_under_way_is_not_raced(tmp_path, sleeper):
    # Another job is taking the dead lock over (its .takeover file is fresh): this one does not
    # remove the lock as well, and says what to remove if nothing is starting.
    owner = _owner_of(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    path = _write(tmp_path, owner)
    open(path + ".takeover", "w").write("node-x 1\n")
    with pytest.raises(SaveLockError) as err:
        SaveLock(str(tmp_path)).acquire()
    assert str(err.value) == (f"--save {tmp_path}: could not take {path} ({path}.takeover says another job is "
                              f"taking it over; if no other job is starting on this directory, remove "
                              f"{path}.takeover). Run one job per --save directory")
    assert _token(path) == owner.token


def test_a_requeued_slurm_job_takes_over_its_earlier_run(tmp_path, monkeypatch):
    # Same job id, run 0 on another node, refreshed just now (SIGKILLed after its KillWait):
    # SLURM ended it before this run 1, so there is nothing to wait for.
    owner = replace(_owner_of(os.getpid(), host="node-b17"), job="777", restart=0)
    path = _write(tmp_path, owner)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = SaveLock(str(tmp_path))
    try:
        assert lock.acquire().endswith(
            f"left by {owner.describe()}: an earlier run of this SLURM job 777 (run 0; this is run 1, "
            f"requeued), which SLURM ended before this run. That job can no longer save here.")
        assert json.load(open(path))["restart"] == 1
    finally:
        lock.release()
    # The same run of the same job (two steps of one batch script on one --save) is refused.
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    _write(tmp_path, owner)
    with pytest.raises(SaveLockError, match=r"refreshed \d+ s ago"):
        SaveLock(str(tmp_path)).acquire()


@pytest.mark.parametrize("out,err,rc,verdict", [
    ("RUNNING\\n", "", 0, "is RUNNING (squeue)"),
    ("SUSPENDED\\n", "", 0, "is SUSPENDED (squeue)"),
    ("TIMEOUT\\n", "", 0, "has ended (squeue: TIMEOUT)"),
])
def test_another_hosts_slurm_job_is_looked_up_with_squeue(tmp_path, squeue, out, err, rc, verdict):
    # Refreshed just now: without squeue the lock would be refused for STALE_AFTER_S.
    owner = _owner_of(os.getpid(), host="node-b17")
    path = _write(tmp_path, owner)
    _fake_squeue(squeue, out, err, rc)
    lock = SaveLock(str(tmp_path))
    if "ended" in verdict:
        try:
            assert lock.acquire() == (f"WARNING: --save {tmp_path}: took over {path}, left by {owner.describe()}: "
                                      f"owner on host node-b17: SLURM job 4242 {verdict}. That job can no longer "
                                      f"save here.")
        finally:
            lock.release()
    else:
        with pytest.raises(SaveLockError) as err_info:
            lock.acquire()
        assert f"(owner on host node-b17: SLURM job 4242 {verdict})" in str(err_info.value)
        assert _token(path) == owner.token
    assert open(squeue / "squeue.calls").read() == "--noheader --jobs 4242 --format %T\n"


@pytest.mark.parametrize("out,err,rc", [
    ("", "", 0),
    ("", "slurm_load_jobs error: Invalid job id specified", 1),
])
def test_a_slurm_job_squeue_never_listed_follows_the_heartbeat_rule(tmp_path, squeue, out, err, rc):
    # Not listed: ended, or a job squeue cannot show (another cluster's on this filesystem,
    # another user's under PrivateData=jobs). Before: taken over at once as ended.
    owner = _owner_of(os.getpid(), host="node-b17")
    path = _write(tmp_path, owner, age_s=120)
    _fake_squeue(squeue, out, err, rc)
    whose = ("owner on host node-b17, SLURM job 4242 not listed by squeue (ended, or not visible from here: "
             "another cluster's or another user's job)")
    _refused_fresh_taken_over_stale(tmp_path, path, owner, whose)


def _later_job(root) -> str:
    """What a job started later on ``root`` says at start. Its own process, as a resubmitted job's
    rank 0 is: a run looks the owner up once, at start, so nothing of this process's memory may
    count. Same environment (this test's squeue on PATH, SLURM variables)."""
    code = ("import sys\n"
            "from megatron_grpo.training.safety.save_lock import SaveLock, SaveLockError\n"
            "lock = SaveLock(sys.argv[1])\n"
            "try:\n"
            "    print(lock.acquire())\n"
            "except SaveLockError as exc:\n"
            "    print(f'refused: {exc}')\n"
            "lock.release()\n")
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_slurm_job_squeue_listed_to_an_earlier_job_and_lists_no_more_has_ended(tmp_path, squeue, monkeypatch):
    # A job started while the owner ran is refused (squeue: RUNNING). The owner then dies without
    # removing its lock, and the job resubmitted after it finds squeue no longer lists it: ended,
    # and its lock, refreshed 2 minutes ago, is taken over at once instead of after STALE_AFTER_S.
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "hpc1")
    owner = _owner_of(os.getpid(), host="node-b17")
    path = _write(tmp_path, owner)
    _fake_squeue(squeue, "RUNNING\\n")
    with pytest.raises(SaveLockError, match=r"SLURM job 4242 is RUNNING \(squeue\)"):
        SaveLock(str(tmp_path)).acquire()
    _fake_squeue(squeue, "")
    _age(path, 120)
    assert _later_job(tmp_path) == (
        f"WARNING: --save {tmp_path}: took over {path}, left by {owner.describe()}: owner on host node-b17: "
        f"SLURM job 4242 has ended (squeue: not listed, listed earlier to user {os.getuid()} on cluster "
        f"hpc1). That job can no longer save here.")
    assert not os.path.exists(path)  # the later job released it
    # A job id squeue never listed here may only be invisible: the heartbeat rule.
    other = replace(owner, job="4243")
    path = _write(tmp_path, other, age_s=120)
    with pytest.raises(SaveLockError, match="SLURM job 4243 not listed by squeue"):
        SaveLock(str(tmp_path)).acquire()
    assert _token(path) == other.token
    assert open(squeue / "squeue.calls").read().split("\n") == [
        "--noheader --jobs 4242 --format %T", "--noheader --jobs 4242 --format %T",
        "--noheader --jobs 4243 --format %T", ""]


@pytest.mark.parametrize("first,later", [("hpc1", "hpc2"), ("", "hpc1"), ("hpc1", "")])
def test_a_listing_counts_only_for_the_same_cluster(tmp_path, squeue, monkeypatch, first, later):
    # Another cluster on the same filesystem asks its own controller, which never shows this
    # cluster's jobs. Outside a SLURM job the cluster is unknown: nothing recorded, nothing relied on.
    owner = _owner_of(os.getpid(), host="node-b17")
    path = _write(tmp_path, owner, age_s=120)
    _fake_squeue(squeue, "RUNNING\\n")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", first)
    with pytest.raises(SaveLockError, match=r"SLURM job 4242 is RUNNING \(squeue\)"):
        SaveLock(str(tmp_path)).acquire()
    assert os.path.exists(tmp_path / save_lock.LISTED_NAME) == bool(first)
    _fake_squeue(squeue, "")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", later)
    with pytest.raises(SaveLockError, match=r"SLURM job 4242 not listed by squeue .* refreshed \d+ s ago"):
        SaveLock(str(tmp_path)).acquire()
    assert _token(path) == owner.token


def test_the_listing_record_keeps_the_newest_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "hpc1")
    (tmp_path / save_lock.LISTED_NAME).write_text("{not json")  # unreadable: started afresh
    for job in range(100, 100 + save_lock.LISTED_KEEP + 1):
        save_lock.note_listed(str(tmp_path), str(job))
    save_lock.note_listed(str(tmp_path), "101")  # listed again: the newest
    jobs = json.load(open(tmp_path / ".megatron_grpo_squeue_listed.json"))[f"hpc1:{os.getuid()}"]
    assert len(jobs) == save_lock.LISTED_KEEP and jobs[-1] == "101" and "100" not in jobs
    assert save_lock.listed_before(str(tmp_path), "102") and not save_lock.listed_before(str(tmp_path), "100")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "hpc2")
    assert not save_lock.listed_before(str(tmp_path), "102")
