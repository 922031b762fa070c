"""Ranks die with their launcher.

When the torchrun agent is killed (``kill -9``, an OOM kill, a node agent gone), nothing tells
its ranks: they are reparented to PID 1 (or a subreaper), train to the end and write
checkpoints, while the job counts as dead and gets resubmitted onto the same --save. A rank
therefore watches its launcher and, once it is gone, exits at once with ``LAUNCHER_GONE_EXIT``
and saves nothing (the checkpoints already written stay; a save cut short leaves an
``iter_N.tmp`` that is never loaded).

Which process is the launcher:

* ``torchrun launch/pretrain_gpt.py``: the agent is the rank's parent (recorded at start);
* launch/run_local.sh and the SLURM script: torchrun starts launch/slurm/rank_exec.sh, which
  starts the training process in a session of its own. The agent is the grandparent there, and
  the wrapper outlives it, so the wrapper exports the agent's pid and start time
  (``GRPO_LAUNCHER_PID``, ``GRPO_LAUNCHER_START``) and the rank watches that process;
* neither (``python launch/pretrain_gpt.py``, tests calling ``run()``): there is no launcher
  to watch, and nothing is started.

Gone means: the direct parent changed (the rank was reparented), or the launcher pid is no
longer the process recorded at start (exited, a zombie not yet reaped, or a reused pid: the
start time in ``/proc/<pid>/stat`` differs). A thread polls every ``POLL_S`` seconds, which also
covers a rank blocked in a collective whose peers are gone; ``check()`` looks once more right
before every save, so no save starts after the launcher died.

Out of file descriptors (EMFILE: this process at its `ulimit -n`; ENFILE: the node's table
full), /proc cannot be read, which says nothing about the launcher. The watch then checks the
launcher by its pid alone (``kill(pid, 0)``, no descriptor needed) and says once, on stderr, which
limit was hit, its value and how to raise it: a save that ran out of descriptors must not be
reported as a dead launcher (the rank was killed by its own watch, blaming a live torchrun).

Why not PR_SET_PDEATHSIG: it fires only for the direct parent (the wrapper, not the agent, on
the SLURM path), it fires when the parent *thread* that forked the rank exits, and the signal
must not be SIGTERM: the loop's SIGTERM handler saves a checkpoint (preemption). A poll needs
none of that and says why the rank stopped.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import sys
import threading
from typing import Callable, List, Optional, Tuple

LAUNCHER_GONE_EXIT = 4
"""A rank's exit status when its launcher is gone (launch/pretrain_gpt.py: 2 bad input, 3 lost peer)."""
PID_ENV, START_ENV = "GRPO_LAUNCHER_PID", "GRPO_LAUNCHER_START"
POLL_S = 1.0
FD_ERRNOS = (errno.EMFILE, errno.ENFILE)
"""Out of file descriptors: a failed read of /proc that says nothing about the process read."""


def process_state(pid: int) -> Optional[Tuple[str, int]]:
    """(state letter, start time in clock ticks since boot: /proc/<pid>/stat fields 3 and 22) of
    ``pid``, or None if there is no such process or no /proc. The command name may hold spaces
    and ')': the fields are counted after the last ')'. Raises the OSError when this process
    cannot open the file for lack of descriptors (``FD_ERRNOS``): the process may well be alive."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
    except OSError as exc:
        if exc.errno in FD_ERRNOS:
            raise
        return None
    except IndexError:
        return None
    return rest[0], int(rest[19])


def start_ticks(pid: int) -> Optional[int]:
    """``pid``'s start time, or None if there is no such live process (a zombie has exited).
    Raises where ``process_state`` does (out of descriptors)."""
    state = process_state(pid)
    return None if state is None or state[0] in "ZX" else state[1]


def _where() -> str:
    return f"{os.environ.get('RANK', '0')} on {socket.gethostname()}"


def open_files_problem(exc: OSError) -> str:
    """Which descriptor limit ``exc`` (EMFILE or ENFILE) hit, its value, and how to raise it."""
    if exc.errno == errno.ENFILE:
        return (f"the node's open-file table is full (ENFILE, errno {errno.ENFILE}: {os.strerror(errno.ENFILE)}): "
                f"other processes on this node hold too many files open; close them, or raise the node's "
                f"limit (sysctl fs.file-max)")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"this process has reached its open-file limit (EMFILE, errno {errno.EMFILE}: "
            f"{os.strerror(errno.EMFILE)}; `ulimit -n` is {soft} here, hard limit {hard}); raise it before "
            f"the job starts, e.g. `ulimit -n 65536` in the sbatch script (up to the hard limit; above it "
            f"needs the node's limits.conf)")


def _ticks_at_start(pid: int) -> Optional[int]:
    try:
        return start_ticks(pid)
    except OSError:  # out of descriptors already: the pid is still watched, without the reuse check
        return None


class LauncherWatch:
    """Exit this process (``LAUNCHER_GONE_EXIT``) when ``launcher_pid`` (started at
    ``launcher_ticks``) is gone or the parent is no longer ``parent_pid``."""

    def __init__(self, launcher_pid: int, launcher_ticks: Optional[int], parent_pid: int,
                 what: str, save_dir: Optional[str] = None, poll_s: float = POLL_S):
        self.launcher_pid, self.launcher_ticks, self.parent_pid = launcher_pid, launcher_ticks, parent_pid
        self.what, self.save_dir, self.poll_s = what, save_dir, poll_s
        self._before_exit: List[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.out_of_files: Optional[str] = None
        """The descriptor problem last seen reading /proc (said once on stderr), or None."""

    def gone(self) -> Optional[str]:
        """Why the launcher counts as gone, or None."""
        if os.getppid() != self.parent_pid:
            return (f"this rank's parent process {self.parent_pid} exited (the rank now belongs to pid "
                    f"{os.getppid()})")
        if not os.path.isdir("/proc"):  # no start times: whether the pid exists at all
            return self._pid_gone()
        try:
            now = start_ticks(self.launcher_pid)
        except OSError as exc:  # out of descriptors: not a sign of the launcher, see the module doc
            self._report_out_of_files(exc)
            return self._pid_gone()
        if now is None:
            return f"process {self.launcher_pid} has exited"
        if self.launcher_ticks is not None and now != self.launcher_ticks:
            return f"pid {self.launcher_pid} now belongs to another process"
        return None

    def _pid_gone(self) -> Optional[str]:
        """Whether the launcher pid exists, asked without a descriptor (a zombie or a reused pid
        passes)."""
        try:
            os.kill(self.launcher_pid, 0)
        except ProcessLookupError:
            return f"process {self.launcher_pid} has exited"
        except PermissionError:
            pass
        return None

    def _report_out_of_files(self, exc: OSError) -> None:
        problem = open_files_problem(exc)
        if problem == self.out_of_files:
            return
        self.out_of_files = problem
        # One write: ranks share the job's output.
        sys.stderr.write(f"error (rank {_where()}): {problem}. The launcher watch cannot read "
                         f"/proc/{self.launcher_pid}/stat now, so it checks the launcher ({self.what}, "
                         f"pid {self.launcher_pid}) by its pid alone; the launcher is not what failed. "
                         f"Whatever else this rank opens meanwhile (a checkpoint, the data, the SSD "
                         f"tier's file) fails the same way.\n")
        sys.stderr.flush()

    def before_exit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (e.g. release the --save lock) before the exit; its errors are ignored."""
        self._before_exit.append(fn)

    def check(self) -> None:
        """Exit now if the launcher is gone (called before every save)."""
        why = self.gone()
        if why is not None:
            self._exit(why)

    def _exit(self, why: str) -> None:
        rank = _where()
        kept = (f"the checkpoints already in --save {self.save_dir} are kept: resume from them with "
                f"--load {self.save_dir}" if self.save_dir else "there is no --save")
        # One write (ranks share the job's output): the message must not be cut by the exit.
        sys.stderr.write(f"error (rank {rank}): the launcher ({self.what}, pid {self.launcher_pid}) is gone "
                         f"({why}); this rank stops now without saving a checkpoint (exit status "
                         f"{LAUNCHER_GONE_EXIT}); {kept}. Look for why the launcher died (OOM killer, "
                         f"kill, node failure) in the job's log and the system log.\n")
        sys.stderr.flush()
        for fn in self._before_exit:
            try:
                fn()
            except Exception:  # noqa: BLE001 - exiting regardless; nothing may delay it
                pass
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        # os._exit: no finally, no atexit, no SIGTERM handler, so no code path can save; exits
        # from the watch thread too, whatever the main thread is blocked in.
        os._exit(LAUNCHER_GONE_EXIT)

    def start(self) -> "LauncherWatch":
        def poll():
            while not self._stop.wait(self.poll_s):
                why = self.gone()
                if why is not None:
                    self._exit(why)

        self._thread = threading.Thread(target=poll, name="megatron_grpo-launcher-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None


def from_environment(save_dir: Optional[str] = None, environ=None) -> Optional[LauncherWatch]:
    """The watch for how this process was launched (module docstring), not started; None when
    there is no launcher. A launcher that is already gone is reported by the first check."""
    environ = os.environ if environ is None else environ
    parent = os.getppid()
    if environ.get(PID_ENV, "").isdigit():
        start = environ.get(START_ENV, "")
        return LauncherWatch(int(environ[PID_ENV]), int(start) if start.isdigit() else None, parent,
                             "torchrun agent, via launch/slurm/rank_exec.sh", save_dir)
    if "TORCHELASTIC_RUN_ID" in environ:
        return LauncherWatch(parent, _ticks_at_start(parent), parent, "torchrun agent", save_dir)
    return None
