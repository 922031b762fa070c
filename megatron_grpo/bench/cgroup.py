"""A cgroup v1 memory limit around a benchmark command: the fixed memory cap of ``bench memcap``.

The whole job (torchrun's agent and every rank) runs inside one memory cgroup whose
``memory.limit_in_bytes`` is the cap, so "does this model train under the cap" is answered by the
kernel, as it is for a SLURM job under ``ConstrainRAMSpace``: over the cap the kernel's OOM killer
ends a process, torchrun stops the other ranks and the run fails. ``oom_kills()`` (from
``memory.oom_control``) tells such a failure from any other, so a crash is never counted as
"does not fit". Needs root and the v1 memory controller (``/sys/fs/cgroup/memory``);
:func:`unavailable` says why not otherwise, and the benchmark reports that instead of a figure.
"""

from __future__ import annotations

import os
import time
from typing import List, Optional, Sequence

ROOT = "/sys/fs/cgroup/memory"


def unavailable(root: str = ROOT) -> Optional[str]:
    """None when a memory cgroup can be made under ``root``; else the reason."""
    if not os.path.isfile(os.path.join(root, "memory.limit_in_bytes")):
        return (f"no cgroup v1 memory controller at {root} (memory.limit_in_bytes missing); the "
                f"capped benchmark needs one")
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (run as root to make a memory cgroup)"
    return None


class MemoryCgroup:
    """One memory cgroup with a hard limit; ``command(argv)`` runs argv inside it.

    Use as a context manager: the group is made on entry and removed on exit (after its
    processes have ended)."""

    def __init__(self, name: str, limit_bytes: int, root: str = ROOT) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self.path = os.path.join(root, name)
        self.limit_bytes = int(limit_bytes)

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _write(self, name: str, value: str) -> None:
        with open(self._file(name), "w") as fh:
            fh.write(value)

    def __enter__(self) -> "MemoryCgroup":
        if os.path.isdir(self.path):  # a stale group of a killed benchmark: reuse its name
            self._remove()
        os.mkdir(self.path)
        self._write("memory.limit_in_bytes", str(self.limit_bytes))
        # No swap here; where there is some, the cap covers memory plus swap (else a run that
        # does not fit pages out and crawls instead of failing).
        if os.path.exists(self._file("memory.memsw.limit_in_bytes")):
            self._write("memory.memsw.limit_in_bytes", str(self.limit_bytes))
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)  # fails while a process is still in the group
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def command(self, argv: Sequence[str]) -> List[str]:
        """argv run inside the group: a shell puts itself in, then execs argv (its children,
        torchrun's ranks, inherit the group)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', self._file("cgroup.procs"), *argv]

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended in this group so far."""
        with open(self._file("memory.oom_control")) as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        raise RuntimeError(f"{self._file('memory.oom_control')} has no oom_kill line (kernel "
                           f"older than 4.13): an OOM cannot be told from another failure")

    def max_usage_bytes(self) -> int:
        """The group's peak charge (resident memory and page cache of every process in it)."""
        with open(self._file("memory.max_usage_in_bytes")) as fh:
            return int(fh.read())
