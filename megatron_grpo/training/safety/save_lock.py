"""One job per checkpoint directory: the --save lock.

Two jobs saving into one directory (a resubmitted job while the first still runs, two users, a
copied batch script) each replace the other's ``iter_N`` and tracker: the directory ends up
with one job's checkpoints, or a mix, and both jobs exit 0. Rank 0 therefore holds
``D/.megatron_grpo_save.lock`` from the start of the run (before --load reads D and before any
save) to its end, whatever the end (clean, SIGTERM save, error, launcher gone).

The lock is a small JSON file naming its owner: pid, host, the kernel's boot id, the PID
namespace (``/proc/self/ns/pid``, e.g. ``pid:[4026531836]``) and the process start time
(``/proc/<pid>/stat`` field 22, clock ticks since boot), so a pid that was reused by another
process is not mistaken for the owner. SLURM jobs see D on a shared filesystem (NFS, Lustre,
GPFS), where flock is not reliable across nodes and a process on another node cannot be looked
up, hence the rules:

* the owner shares this process's pid space (same host name, same boot id, same PID namespace):
  the lock is held while that process lives (pid alive, same start time); a dead owner's lock is
  taken over with a WARNING. The host name alone is not enough: containers that share it (docker
  or podman --network=host) have their own PID namespace, where a live owner's pid looks dead;
  a differing boot id is a reboot or another machine of the same name. A lock that does not
  record a namespace (written by an older version) or a namespace this process cannot read
  counts as not shared;
* otherwise (another host, or a pid space not shared): the lock is held while its owner keeps it
  fresh. Rank 0 refreshes the lock file's mtime every ``HEARTBEAT_S`` seconds (a thread, so a
  long save interval or a slow step does not age it); a lock not refreshed for ``STALE_AFTER_S``
  seconds (its node died or lost the filesystem) is taken over with a WARNING. The age is
  measured against the filesystem's own clock (the mtime of a file written just now), not this
  node's;
* before that, an owner that was a SLURM job (not this one) is looked up with squeue: one it
  lists as ended is taken over at once, one it lists otherwise (running, pending, suspended) is
  refused. One it does not list counts as ended only if squeue listed it before to a job of the
  same user on the same cluster (``LISTED_NAME`` in D records that; a job looks the owner up once,
  at start, so the record must outlive it: typically the job refused while the owner ran is
  resubmitted after it died); else it may just be invisible from here (a job of another cluster
  on the same filesystem, another user's under PrivateData=jobs) and the heartbeat rule decides,
  as it does where squeue cannot be asked;
* a lock that cannot be read (not ours: a partial write is impossible, see below) follows the
  heartbeat rule on its mtime;
* a requeued SLURM job (same SLURM_JOB_ID, higher SLURM_RESTART_COUNT) takes over its earlier
  run's lock at once, wherever that ran: SLURM ends a job before running it again, and the
  requeue idiom (--save D --load D) must not wait for the stale time.

Creation is atomic and shared-filesystem safe: the content is written to a private file and
``os.link``-ed to the lock's name, which fails if the name exists (O_EXCL is not atomic on every
NFS); a filesystem without hard links falls back to O_CREAT|O_EXCL. A takeover removes the dead
lock under a second link-created file (``.takeover``), after reading it again, so two jobs that
both judged it dead cannot both end up owning D. Before every save rank 0 checks that the lock
is still its own (a job frozen past ``STALE_AFTER_S``, e.g. SLURM suspend, may have lost it), and
the save is refused if not.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import torch.distributed as dist

from megatron_grpo.training.safety.checkpoint_dirs import CheckpointError
from megatron_grpo.training.safety.launcher_watch import process_state

LOCK_NAME = ".megatron_grpo_save.lock"
HEARTBEAT_S = 30.0
"""Rank 0 refreshes the lock's mtime this often while the run lives."""
STALE_AFTER_S = 600.0
"""A lock of another host not refreshed for this long is taken over (20 missed heartbeats)."""
TAKEOVER_STALE_S = 60.0
"""A ``.takeover`` file older than this was left by a job that died inside a takeover."""


SLURM_ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
               "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT")
"""squeue states of a job whose processes have all ended (COMPLETING has not: it still runs)."""


class SaveLockError(CheckpointError):
    """--save is in use by another job (or the lock was lost); the message says what to do."""


@dataclass
class Owner:
    """Who holds a lock (what the lock file holds)."""

    pid: int
    host: str
    boot_id: str
    start_ticks: Optional[int]
    """/proc/<pid>/stat field 22 (None where /proc is missing)."""
    started: str
    """When the lock was taken, for people (this host's clock)."""
    job: str
    """SLURM_JOB_ID, or '' outside SLURM."""
    token: str
    """Unique per acquisition: 'still ours' compares it."""
    restart: int = 0
    """SLURM_RESTART_COUNT: a requeued job keeps its id and counts its runs."""
    pid_ns: str = ""
    """/proc/self/ns/pid's link, e.g. 'pid:[4026531836]'; '' if unreadable or in a lock written
    by an older version (then the pid is not looked up: the heartbeat rule decides)."""

    def describe(self) -> str:
        job = f", SLURM job {self.job}" if self.job else ""
        return f"pid {self.pid} on host {self.host}{job}, lock taken {self.started}"


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's PID namespace, e.g. 'pid:[4026531836]' ('' where it cannot be read)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process() -> Owner:
    state = process_state(os.getpid())
    return Owner(pid=os.getpid(), host=socket.gethostname(), boot_id=boot_id(),
                 start_ticks=state[1] if state else None,
                 started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), job=os.environ.get("SLURM_JOB_ID", ""),
                 token=uuid.uuid4().hex, restart=_restart_count(), pid_ns=pid_namespace())


def _restart_count() -> int:
    text = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


LISTED_NAME = ".megatron_grpo_squeue_listed.json"
"""In --save's directory: the SLURM job ids squeue listed, by cluster and user ({"cluster:uid":
[job, ...]}). What squeue shows depends on both (another cluster's jobs, PrivateData=jobs), so a
job it listed to this user on this cluster and lists no more has ended; one it never listed may
only be invisible from here."""
LISTED_KEEP = 64
"""Job ids kept per cluster and user (the newest): the record only spares a wait, so it stays small."""


def squeue_viewer() -> str:
    """Whose view of squeue this process has: 'cluster:uid', or '' outside a SLURM job (the
    cluster unknown, a record could come from another cluster's squeue on the same filesystem)."""
    cluster = os.environ.get("SLURM_CLUSTER_NAME", "")
    return f"{cluster}:{os.getuid()}" if cluster else ""


def _read_listed(root: str) -> dict:
    try:
        with open(os.path.join(root, LISTED_NAME)) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def listed_before(root: str, job: str) -> bool:
    """Whether squeue listed SLURM job ``job`` to this cluster and user before (``note_listed``)."""
    return bool(squeue_viewer()) and job in _read_listed(root).get(squeue_viewer(), [])


def note_listed(root: str, job: str) -> None:
    """Record that squeue lists ``job`` to this cluster and user, for later jobs on ``root``.
    Best effort: a record lost (an unwritable directory, two jobs writing at once: the last
    one's stays) only leaves a later job to the heartbeat rule."""
    viewer = squeue_viewer()
    if not viewer:
        return
    record = _read_listed(root)
    jobs = [j for j in record.get(viewer, []) if isinstance(j, str) and j != job]
    record[viewer] = (jobs + [job])[-LISTED_KEEP:]
    path = os.path.join(root, LISTED_NAME)
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.new"
    try:
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)  # readers see the old record or the new one, never a part
    except OSError:
        pass


def slurm_job_state(job: str) -> Optional[str]:
    """SLURM job ``job``'s state as squeue reports it ('' once squeue lists it no more), or None
    where SLURM cannot be asked (no squeue, no controller, a timeout)."""
    try:
        out = subprocess.run(["squeue", "--noheader", "--jobs", job, "--format", "%T"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:  # a purged job id is an error; so is an unreachable controller
        return "" if "invalid job id" in out.stderr.lower() else None
    return out.stdout.strip().split("\n")[0].strip()


def pid_space_shared(owner: Owner) -> Tuple[bool, str]:
    """(whether ``owner``'s pid means the same process here, why not). Only then may /proc judge
    it: a container sharing the host name but not the PID namespace sees no such pid (or another
    process under it) while the owner runs."""
    if owner.host != socket.gethostname():
        return False, ""
    mine = boot_id()
    if not owner.boot_id or not mine:
        return False, "boot id unknown"
    if owner.boot_id != mine:
        return False, (f"boot id {owner.boot_id}, not this host's {mine} (rebooted since, or another "
                       f"machine of this name)")
    ns = pid_namespace()
    if not owner.pid_ns:
        return False, "PID namespace not recorded (a lock written by an older version)"
    if not ns:
        return False, "PID namespace unknown here (/proc/self/ns/pid cannot be read)"
    if owner.pid_ns != ns:
        return False, f"in PID namespace {owner.pid_ns}, not this process's {ns} (another container)"
    return True, ""


def owner_alive(owner: Owner) -> Tuple[bool, str]:
    """(whether ``owner``, a process of this pid space (``pid_space_shared``), still runs; why
    not). A zombie is dead."""
    state = process_state(owner.pid)
    if state is None or state[0] in "ZX":
        return False, f"process {owner.pid} has exited"
    if owner.start_ticks is not None and state[1] != owner.start_ticks:
        return False, (f"pid {owner.pid} now belongs to another process (started at tick {state[1]}, "
                       f"the owner at tick {owner.start_ticks})")
    return True, ""


def _read(path: str) -> Tuple[bool, Optional[Owner]]:
    """(the lock exists, its owner or None when unreadable)."""
    try:
        with open(path) as fh:
            text = fh.read()
    except FileNotFoundError:
        return False, None
    except OSError:
        return True, None
    try:
        owner = Owner(**json.loads(text))
    except (ValueError, TypeError):
        return True, None
    typed = all(isinstance(v, int) for v in (owner.pid, owner.restart)) and \
        (owner.start_ticks is None or isinstance(owner.start_ticks, int)) and isinstance(owner.pid_ns, str)
    return True, owner if typed else None


def fs_now(root: str) -> float:
    """The filesystem's clock: the mtime of a file written just now (nodes' clocks may differ
    from the file server's; a lock's age is measured on one clock)."""
    probe = os.path.join(root, f".megatron_grpo_clock.{socket.gethostname()}.{os.getpid()}")
    with open(probe, "w") as fh:
        fh.write("now\n")
    try:
        return os.stat(probe).st_mtime
    finally:
        os.remove(probe)


def _create(path: str, text: str) -> bool:
    """Create ``path`` holding ``text`` atomically; False if it exists."""
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.new"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(tmp, path)  # the name appears with its whole content, or not at all
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        return _create_excl(path, text)  # a filesystem without hard links
    finally:
        os.remove(tmp)


def _create_excl(path: str, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return True


class SaveLock:
    """Rank 0's hold on --save ``root``. ``acquire`` at start, ``confirm`` before each save,
    ``release`` at the end (idempotent; only removes a lock that is still this one)."""

    def __init__(self, root: str, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.root = root
        self.path = os.path.join(root, LOCK_NAME)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.me: Optional[Owner] = None
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    # -- deciding about someone else's lock ------------------------------------------------------

    def judge(self, owner: Optional[Owner], age_s: float) -> Tuple[bool, str]:
        """(may take it over, why). ``age_s``: seconds since the lock was last refreshed."""
        host = socket.gethostname()
        job = os.environ.get("SLURM_JOB_ID", "")
        if owner is not None and job and owner.job == job and owner.restart < _restart_count():
            # SLURM ends every process of a job before it runs the job again (requeue, preemption).
            return True, (f"an earlier run of this SLURM job {job} (run {owner.restart}; this is run "
                          f"{_restart_count()}, requeued), which SLURM ended before this run")
        shared, unshared = pid_space_shared(owner) if owner is not None else (False, "")
        if shared:
            alive, why = owner_alive(owner)
            return (False, "its owner is running on this host") if alive else (True, why)
        whose = "unreadable lock" if owner is None else f"owner on host {owner.host}"
        if unshared:  # same host name, yet its pid cannot be looked up from this process
            whose += f", {unshared}"
        state = slurm_job_state(owner.job) if owner is not None and owner.job and owner.job != job else None
        if state:  # listed, in any state: a later job of this user here may rely on it
            note_listed(self.root, owner.job)
        elif state == "" and not listed_before(self.root, owner.job):
            # Never listed to this user on this cluster: ended, or invisible from here (another
            # cluster's job on the same filesystem, another user's under PrivateData=jobs). Taking
            # over a live job's lock stops it at its next save, so wait for the heartbeat rule.
            state = None
            whose += (f", SLURM job {owner.job} not listed by squeue (ended, or not visible from here: "
                      f"another cluster's or another user's job)")
        if state is not None:  # SLURM knows whether that job still runs: no need to wait
            if state == "":
                cluster, uid = squeue_viewer().rsplit(":", 1)
                return True, (f"{whose}: SLURM job {owner.job} has ended (squeue: not listed, listed "
                              f"earlier to user {uid} on cluster {cluster})")
            if state in SLURM_ENDED:
                return True, f"{whose}: SLURM job {owner.job} has ended (squeue: {state})"
            return False, f"{whose}: SLURM job {owner.job} is {state} (squeue)"
        if age_s > self.stale_after_s:
            return True, (f"{whose}: not refreshed for {age_s:.0f} s (stale after {self.stale_after_s:.0f} s; "
                          f"a live owner refreshes it every {self.heartbeat_s:.0f} s)")
        return False, (f"{whose}: refreshed {age_s:.0f} s ago; its owner cannot be looked up from "
                       f"{host}, and the lock counts as stale only after {self.stale_after_s:.0f} s "
                       f"without a refresh")

    def _refusal(self, owner: Optional[Owner], why: str) -> str:
        who = owner.describe() if owner else "an owner this lock file does not name (unreadable)"
        if owner is not None and pid_space_shared(owner)[0]:
            check = f"check with `ps -p {owner.pid}`"
        elif owner is not None:
            check = f"check on {owner.host}" + (f" or with `squeue -j {owner.job}`" if owner.job else "")
        else:
            check = "check that no job is using it"
        return (f"--save {self.root} is in use by another job: {self.path} is held by {who} ({why}). "
                f"Two jobs saving into one directory replace each other's checkpoints. Wait for that "
                f"job to end, or point --save at another directory; if that job is gone ({check}), "
                f"remove {self.path} and start again")

    # -- acquire / confirm / release -------------------------------------------------------------

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a WARNING when a dead owner's lock was taken over. Raises
        SaveLockError when another job holds it."""
        me = this_process()
        warning, busy = None, ""
        for _ in range(10):
            if _create(self.path, json.dumps(asdict(me))):
                self.me = me
                self._start_heartbeat()
                return warning
            exists, owner = _read(self.path)
            if not exists:
                continue  # released just now: try again
            try:
                age = fs_now(self.root) - os.stat(self.path).st_mtime
            except FileNotFoundError:
                continue
            may, why = self.judge(owner, age)
            if not may:
                raise SaveLockError(self._refusal(owner, why))
            if self._remove_if_unchanged(owner):
                who = owner.describe() if owner else "an owner it does not name (unreadable)"
                warning = (f"WARNING: --save {self.root}: took over {self.path}, left by {who}: {why}. "
                           f"That job can no longer save here.")
            else:  # another job is taking it over now (it then holds it): look again
                busy = self.path + ".takeover"
                time.sleep(0.2)
        why = (f"{busy} says another job is taking it over; if no other job is starting on this "
               f"directory, remove {busy}" if busy else "it changed owner ten times in a row")
        raise SaveLockError(f"--save {self.root}: could not take {self.path} ({why}). Run one job per --save "
                            f"directory")

    def _remove_if_unchanged(self, judged: Optional[Owner]) -> bool:
        """Remove the lock if it still is the one judged, under the ``.takeover`` file; False if
        another job is taking it over (or already did)."""
        guard = self.path + ".takeover"
        if not _create(guard, f"{socket.gethostname()} {os.getpid()}\n"):
            try:  # a job that died inside its takeover left it (the window is a few syscalls)
                if fs_now(self.root) - os.stat(guard).st_mtime > TAKEOVER_STALE_S:
                    os.remove(guard)
            except FileNotFoundError:
                pass
            return False
        try:
            exists, now = _read(self.path)
            if not exists:
                return True  # removed meanwhile: the caller creates its own
            same = now is None if judged is None else (now is not None and now.token == judged.token)
            if same:
                os.remove(self.path)
            return same
        finally:
            os.remove(guard)

    def still_held(self) -> Optional[str]:
        """None while the lock file is this acquisition's, else why not (taken over, removed)."""
        if self.me is None:
            return None
        exists, owner = _read(self.path)
        if owner is not None and owner.token == self.me.token:
            return None
        now = "removed" if not exists else (f"taken over by {owner.describe()}" if owner else "replaced")
        return (f"--save {self.root}: this job's lock {self.path} was {now} (a job that stopped "
                f"refreshing it for {self.stale_after_s:.0f} s, e.g. suspended or cut off from the "
                f"filesystem, loses it). No checkpoint is saved over the other job's; this job stops")

    def refresh(self) -> None:
        try:
            os.utime(self.path)
        except OSError:
            pass  # an unwritable or vanished lock: the check before the next save reports it

    def _start_heartbeat(self) -> None:
        self._stop.clear()

        def beat():
            while not self._stop.wait(self.heartbeat_s):
                if self.still_held() is None:
                    self.refresh()

        self._beat = threading.Thread(target=beat, name="megatron_grpo-save-lock", daemon=True)
        self._beat.start()

    def release(self) -> None:
        """Stop the heartbeat; remove the lock if it is still this acquisition's."""
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=5)
        self._beat = None
        if self.me is not None and self.still_held() is None:
            try:
                os.remove(self.path)
            except OSError as exc:  # e.g. the directory turned read-only: the next job takes it over
                print(f"WARNING: --save {self.root}: could not remove {self.path} ({exc}); the next "
                      f"job on this host takes it over (its owner has exited)", file=sys.stderr, flush=True)
        self.me = None


def _collective(problem: Optional[str]) -> Optional[str]:
    out = [problem]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(out, src=0)
    return out[0]


def acquire(lock: SaveLock) -> None:
    """Collective, at start: rank 0 takes the lock (printing a takeover WARNING); every rank
    raises the same SaveLockError if another job holds it."""
    problem = None
    if dist.get_rank() == 0:
        try:
            warning = lock.acquire()
            if warning:
                print(warning, flush=True)
        except (SaveLockError, OSError) as exc:
            problem = str(exc) if isinstance(exc, SaveLockError) else \
                f"--save {lock.root}: cannot take {lock.path} ({exc})"
    problem = _collective(problem)
    if problem is not None:
        raise SaveLockError(f"{problem} (lock taken by rank 0, at start; this is rank {dist.get_rank()}).")


def confirm(lock: SaveLock) -> None:
    """Collective, before a save: every rank raises if rank 0's lock is no longer its own."""
    problem = _collective(lock.still_held() if dist.get_rank() == 0 else None)
    if problem is not None:
        raise SaveLockError(f"{problem} (checked by rank 0 before the save; this is rank {dist.get_rank()}).")
