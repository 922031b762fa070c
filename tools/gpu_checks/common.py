"""What tools/gpu_check.py and its phase modules share: constants (budget, exit statuses),
the assertion collector ``Expect``, the ``Result`` of a phase, the ``Command`` runner with its
timeout, the text table and the phase log.

Every phase asserts numbers through ``Expect`` (each assertion printed as ``ok`` / ``FAIL``
with its numbers), prints one table, and writes everything it printed, plus the tails of the
logs of the processes it started, to OUT/phase_<x>.log. OUT holds at most 8 files (the device
machine returns no more): summary.txt, results.json and one log per phase.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

BUDGET_S = 480.0
"""The whole device check, wheels included: 8 minutes of a 15-minute lease (start-up, the
transfers and one rerun of a phase fit in the rest)."""
CPU_BUDGET_S = 300.0
"""The CPU dry run (``--cpu``): tiny models, gloo, few iterations."""
EXIT_OK, EXIT_FAIL, EXIT_NOTHING_CHECKED = 0, 1, 2
STRICT_ENV = "MEGATRON_GRPO_STRICT_COMM"  # megatron_grpo.comm.wire.STRICT_ENV
PHASES = ("a", "b", "c", "d", "e", "f")
TITLES = {
    "a": "wheels and versions",
    "b": "tensor checks: compressors, error feedback, importance, streams, collectives at world "
         "size 1 vs CPU; release-while-pending; FusedAdam step counts",
    "c": "tiny bf16 model, 1 rank: GRPO warm-up = baseline; memory tier on = off",
    "d": "2 ranks on one device (gloo): weight hash, bytes = planner, memory tier on = off, "
         "hierarchy",
    "e": "~300M bf16 model, 2 ranks, 20 steps: step time and peak memory vs baseline, "
         "monitoring step",
    "f": "~300M bf16 model, 1 rank, 20 steps: the sampled backward vs baseline (FLOPs, "
         "fwd+bwd time, validation loss)",
}


class CheckSkipped(Exception):
    """A prerequisite is missing (no CUDA in a CUDA-only check); the message is the reason."""


class Expect:
    """Collects the assertions of one phase: every one is printed, all are evaluated."""

    def __init__(self, echo: bool = True) -> None:
        self.lines: List[str] = []
        self.failures: List[str] = []
        self.skips: List[str] = []
        self.asserted = 0
        self.numbers: Dict[str, object] = {}
        self.echo = echo

    def say(self, line: str) -> None:
        self.lines.append(line)
        if self.echo:
            print(line, flush=True)

    def that(self, ok: bool, what: str) -> bool:
        self.asserted += 1
        if not ok:
            self.failures.append(what)
        self.say(f"  {'ok  ' if ok else 'FAIL'} {what}")
        return bool(ok)

    def equal(self, got, want, what: str) -> bool:
        """``got == want``, both printed (a mismatch names its first differing position)."""
        ok = got == want
        detail = f"{got!r}" if ok else f"got {_short(got)}, want {_short(want)}{_first_diff(got, want)}"
        return self.that(ok, f"{what}: {detail}")

    def info(self, what: str) -> None:
        self.say(f"  info {what}")

    def skip_part(self, what: str) -> None:
        """A part that cannot run here (printed and listed; a SKIP is never a PASS)."""
        self.skips.append(what)
        self.say(f"  SKIP {what}")

    def number(self, key: str, value) -> None:
        self.numbers[key] = value

    def status(self) -> str:
        if self.failures:
            return "FAIL"
        if not self.asserted:  # a phase that asserted nothing must not read as a PASS
            self.failures.append("no assertion was made")
            return "FAIL"
        return "PASS"

    def summary(self) -> str:
        if self.failures:
            return "; ".join(self.failures)[:400]
        text = f"{self.asserted} assertions ok"
        return text + (f", {len(self.skips)} part(s) skipped" if self.skips else "")


def _short(value, n: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def _first_diff(got, want) -> str:
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                return f" (first difference at index {i}: {a!r} vs {b!r})"
        if len(got) != len(want):
            return f" (lengths {len(got)} vs {len(want)})"
    return ""


@dataclass
class Result:
    """What one phase found."""

    phase: str
    status: str  # PASS / FAIL / SKIP
    elapsed_s: float
    summary: str
    table: str = ""
    lines: List[str] = field(default_factory=list)
    numbers: Dict[str, object] = field(default_factory=dict)


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain text table (the one table each phase prints)."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = [" | ".join(c.ljust(w) for c, w in zip(cells[0], widths)),
           "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    return "\n".join(out)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return "-" if v is None else str(v)


@dataclass
class Command:
    rc: Optional[int]
    timed_out: bool
    elapsed_s: float
    log: str
    limit_s: float

    def tail(self, n: int = 5) -> str:
        return " | ".join(tail_lines(self.log, n))[-600:]


def tail_lines(path: str, n: int) -> List[str]:
    try:
        with open(path, errors="replace") as fh:
            lines = [line.rstrip() for line in fh if line.strip()]
    except OSError:
        return []
    return lines[-n:]


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL the process group of ``proc`` (started with start_new_session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(argv: List[str], log: str, limit_s: float, env: Optional[Dict] = None,
                cwd: str = ROOT) -> Command:
    """Run ``argv`` with stdout and stderr to ``log``; past ``limit_s`` its whole process group
    is killed (timed_out, rc None)."""
    t0 = time.time()
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(argv) + "\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                env=env if env is not None else dict(os.environ),
                                start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=max(1.0, limit_s))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
            kill_group(proc)
    return Command(rc, timed_out, time.time() - t0, log, limit_s)


def finite(v) -> bool:
    import math

    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def median(values) -> float:
    import statistics

    values = [v for v in values if finite(v)]
    return statistics.median(values) if values else float("nan")
