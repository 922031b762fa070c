"""Jobs for the reliability suite: torchrun + launch/pretrain_gpt.py (or the fault probe around
it), bounded in time, with every process they started accounted for.

tests/harness.py's run_training waits on pipes; a job here may be killed, hang or be signalled,
so output goes to files, each job gets its own session (one killpg reaches torchrun), and its
processes carry a job id in their environment: ranks start their own sessions (torchrun) and
their helpers (dist_checkpointing's Manager) may be orphaned, so /proc is searched for the id to
prove that nothing outlived the job, and to clean up if something did.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: harness

from harness import ENTRY, GRPO_SMALL, REPO, SMALL_MODEL, env, free_port  # noqa: E402
from megatron_grpo.training.metrics_log import read_logged  # noqa: E402

PROBE = os.path.join(HERE, "fault_probe.py")
JOB_ENV = "MEGATRON_GRPO_RELIABILITY_JOB"

# The reference run (conftest.py) and every run compared with it: GRPO on, 16 iterations,
# checkpoints every 4 (the lr schedule depends on --train-iters, so every run uses the same).
REF_ITERS = 16
REF_SAVE_INTERVAL = 4

# Waiting on events, not on wall-clock budgets a loaded machine exhausts: a job is given up on
# only when nothing it writes (output, probe records, metrics lines, files under the watched
# folders) changed for STALL_S seconds -- a hang, not slowness -- or after CAP_S in all.
STALL_S = 300
CAP_S = 3600


def base_args(data) -> List[str]:
    return [*SMALL_MODEL, *GRPO_SMALL, "--data-path", data, "--train-iters", str(REF_ITERS),
            "--eval-interval", "1000"]


@dataclass
class Job:
    rc: Optional[int]
    out: str
    err: str
    seconds: float
    workdir: str
    ended_at: float = 0.0
    """Wall time (time.time()) when torchrun exited (or the wait gave up)."""
    leftovers: List[int] = field(default_factory=list)
    """Processes of the job still alive after torchrun exited (then killed)."""

    @property
    def text(self) -> str:
        return self.out + self.err

    def fault(self) -> Optional[dict]:
        """What the probe recorded about the fault it injected (rank, what, time)."""
        path = os.path.join(self.workdir, "probe", "fault.json")
        return json.load(open(path)) if os.path.isfile(path) else None

    def records(self, rank: int) -> List[dict]:
        path = os.path.join(self.workdir, "probe", f"rank-{rank}.json")
        return json.load(open(path)) if os.path.isfile(path) else []

    def lines(self, needle: str) -> List[str]:
        return [line for line in self.text.splitlines() if needle in line]


class Running:
    """A started job: wait for progress, signal it, finish it."""

    def __init__(self, proc: subprocess.Popen, workdir: str, job_id: str, t0: float, files):
        self.proc, self.workdir, self.job_id, self.t0, self._files = proc, workdir, job_id, t0, files

    def rank_pid(self, rank: int) -> int:
        return int(open(os.path.join(self.workdir, "probe", f"rank-{rank}.pid")).read())

    def wait_for_records(self, metrics: str, n: int, timeout: float) -> int:
        """Block until the metrics file holds n per-iteration records, as logged (its headers
        not counted; the job must still run)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                have = len(read_logged(metrics))
            except OSError:
                have = 0
            if have >= n:
                return have
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended (rc {self.proc.returncode}) at {have} records, "
                                     f"waiting for {n}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {n} records after {timeout} s:\n{self._tail()}")
            time.sleep(0.05)

    def wait_for_text(self, needle: str, until: float) -> Optional[float]:
        """Wall time at which needle first showed in the job's output (polled every 0.1 s), or
        None if it had not by wall time ``until`` or the job ended without it."""
        while True:
            if any(needle in open(f.name).read() for f in self._files):
                return time.time()
            if time.time() > until or self.proc.poll() is not None:
                return None
            time.sleep(0.1)

    def _tail(self) -> str:
        return "".join(open(f.name).read()[-3000:] for f in self._files)

    def _activity(self, watch: Sequence) -> tuple:
        """(path, size, mtime) of every file the job writes: its output and probe records
        (under its workdir) and anything under ``watch`` (metrics file, checkpoint folder)."""
        seen = []
        for root in (self.workdir, *[str(w) for w in watch]):
            paths = [root] if os.path.isfile(root) else \
                [os.path.join(base, f) for base, _, files in os.walk(root) for f in files]
            for path in paths:
                try:
                    st = os.stat(path)
                except OSError:  # renamed or removed meanwhile (a save's tmp directory)
                    continue
                seen.append((path, st.st_size, st.st_mtime_ns))
        return tuple(sorted(seen))

    def wait_progressing(self, done, what: str, watch: Sequence = (), stall_s: float = STALL_S,
                         cap_s: float = CAP_S) -> None:
        """Block until ``done()``; the job must keep running meanwhile unless ``done`` is its end.
        Gives up (killing the job, raising with its output) only when the job wrote nothing for
        ``stall_s`` seconds or ran ``cap_s`` in all: load slows a job, it does not stop it."""
        t0 = last = time.monotonic()
        activity = None
        while not done():
            if self.proc.poll() is not None:
                if done():  # it happened just before the end
                    return
                raise AssertionError(f"job ended (rc {self.proc.returncode}) before {what}:\n{self._tail()}")
            now = time.monotonic()
            current = self._activity(watch)
            if current != activity:
                activity, last = current, now
            if now - last > stall_s or now - t0 > cap_s:
                why = (f"nothing written for {stall_s:.0f} s" if now - last > stall_s
                       else f"still running after {cap_s:.0f} s")
                job = self.finish(timeout=0)
                raise AssertionError(f"gave up waiting for {what} ({why}; {now - t0:.0f} s since the "
                                     f"start; killed {len(job.leftovers)} process(es)):\n{job.text[-6000:]}")
            time.sleep(0.2)

    def finish(self, timeout: float) -> Job:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None  # a hang: the test reports it; everything is killed below
        seconds, ended_at = time.monotonic() - self.t0, time.time()
        time.sleep(0.5)  # helpers dying with their rank (PR_SET_PDEATHSIG) need a moment
        leftovers = kill_job(self.job_id)
        for f in self._files:
            f.close()
        out, err = (open(f.name).read() for f in self._files)
        return Job(rc, out, err, seconds, self.workdir, ended_at, leftovers)


def start_job(workdir, nproc: int, args: Sequence[str], faults: Sequence[str] = (),
              probe: bool = True, extra_env: Optional[Dict[str, str]] = None) -> Running:
    """torchrun --nproc_per_node nproc [fault_probe.py --fault ...] | pretrain_gpt.py args;
    ``extra_env`` is added to the ranks' environment."""
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    job_id = uuid.uuid4().hex
    script = [PROBE, "--fault-out", os.path.join(workdir, "probe")] if probe else [ENTRY]
    for spec in faults:
        script += ["--fault", spec]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *script,
           *[str(a) for a in args]]
    e = env(extra_env)
    e[JOB_ENV] = job_id
    n = len([f for f in os.listdir(workdir) if f.startswith("job") and f.endswith(".out")])
    files = (open(os.path.join(workdir, f"job{n}.out"), "w"), open(os.path.join(workdir, f"job{n}.err"), "w"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=files[0], stderr=files[1],
                            start_new_session=True)
    return Running(proc, workdir, job_id, time.monotonic(), files)


def run_job(workdir, nproc: int, args: Sequence[str], faults: Sequence[str] = (),
            probe: bool = True, timeout: float = 300, extra_env: Optional[Dict[str, str]] = None) -> Job:
    return start_job(workdir, nproc, args, faults, probe, extra_env).finish(timeout)


def run_to_end(workdir, nproc: int, args: Sequence[str], watch: Sequence = (), faults: Sequence[str] = (),
               probe: bool = True, extra_env: Optional[Dict[str, str]] = None) -> Job:
    """run_job without a wall-clock budget: the job runs to its end as long as it makes progress
    (Running.wait_progressing; ``watch``: its metrics file, checkpoint folder)."""
    running = start_job(workdir, nproc, args, faults, probe, extra_env)
    running.wait_progressing(lambda: running.proc.poll() is not None, "the job's end", watch)
    return running.finish(timeout=0)


def run_until_fault(workdir, nproc: int, args: Sequence[str], faults: Sequence[str], watch: Sequence = (),
                    after_fault_s: float = 300, extra_env: Optional[Dict[str, str]] = None) -> Job:
    """Start a probe job, wait for the event its fault is tied to (the probe's fault.json, written
    just before it fires) as long as the job makes progress, then give the job ``after_fault_s``
    to end: a loaded machine delays the fault, it cannot make the test give up before it."""
    running = start_job(workdir, nproc, args, faults, True, extra_env)
    path = os.path.join(running.workdir, "probe", "fault.json")
    running.wait_progressing(lambda: os.path.isfile(path), "its fault", watch)
    return running.finish(after_fault_s)


def job_processes(job_id: str) -> List[int]:
    """Live processes whose environment carries this job id."""
    needle = f"{JOB_ENV}={job_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    with open(f"/proc/{name}/stat") as st:
                        if st.read().split(")")[-1].split()[0] != "Z":  # zombies are harmless
                            found.append(int(name))
        except OSError:
            continue
    return found


def kill_job(job_id: str) -> List[int]:
    """SIGKILL whatever of the job is still alive; returns those pids."""
    alive = job_processes(job_id)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive


def tree_digest(root) -> Dict[str, str]:
    """relative path -> sha256 of every file (and 'dir' for directories) under root."""
    out = {}
    root = str(root)
    for base, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(base, d), root)] = "dir"
        for f in files:
            path = os.path.join(base, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def first_line(text: str, needle: str) -> str:
    """The first line containing needle (for the table), or ''."""
    for line in text.splitlines():
        if needle in line:
            return line.strip()
    return ""


def rank_errors(text: str) -> Dict[int, str]:
    """rank -> its one-line "error (rank R on HOST): ..." message. Ranks share torchrun's stderr
    and print the message and its newline in two writes, so two ranks' lines can run together:
    split at every "error (rank"."""
    out: Dict[int, str] = {}
    for m in re.finditer(r"error \(rank (\d+) on [^)]*\): .*?(?=error \(rank \d+ on |\n|$)", text):
        out.setdefault(int(m.group(1)), m.group(0).strip())
    return out


def torchrun_failure(text: str) -> str:
    """torchrun's 'Root Cause' summary as one line: the rank and its exit code or signal."""
    root = text.split("Root Cause", 1)
    if len(root) < 2:
        return ""
    rank = re.search(r"rank\s*:\s*(\d+ \(local_rank: \d+\))", root[1])
    code = re.search(r"exitcode\s*:\s*(-?\d+)[^\n]*?(\((SIG\w+)\))?\s*$", root[1], re.M)
    what = f"exitcode {code.group(1)}" + (f" ({code.group(3)})" if code and code.group(3) else "") \
        if code else "exitcode ?"
    return f"torchrun root cause: rank {rank.group(1) if rank else '?'}, {what}"


def wait_for_fault(running: Running, timeout: float) -> dict:
    """Block until the probe has recorded its fault (DIR/probe/fault.json); returns it."""
    path = os.path.join(running.workdir, "probe", "fault.json")
    deadline = time.monotonic() + timeout
    while not os.path.isfile(path):
        if running.proc.poll() is not None:
            raise AssertionError(f"job ended (rc {running.proc.returncode}) before its fault:\n"
                                 f"{running._tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no fault after {timeout} s:\n{running._tail()}")
        time.sleep(0.05)
    time.sleep(0.05)  # written in one go; let it land
    return json.load(open(path))
