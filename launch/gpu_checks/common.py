"""Shared pieces of launch/gpu_check.py and its check modules: the constants (budget, exit
statuses, goals), the assertion collector ``Expect`` with ``CheckSkipped``, the ``Result`` /
``Check`` / ``Command`` records and the table of checks ``CHECKS``.

They live here, not in the runner, because both check modules (tensor_checks, run_checks) and
the runner (launch/gpu_check.py) need them, and the check modules must not import the runner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

BUDGET_S = 480.0  # the "under 8 minutes on one CUDA device"
EXIT_OK, EXIT_FAIL, EXIT_NOTHING_CHECKED = 0, 1, 2
STRICT_ENV = "MEGATRON_GRPO_STRICT_COMM"  # megatron_grpo.comm.wire.STRICT_ENV
DP_GOAL = 1.5  # batched host time per bucket, t(dp=512) / t(dp=8) (issue 7 item 5)
OFFLOAD_SKIP = "memory tier not built yet (issue 10): no megatron_grpo/offload module"


class CheckSkipped(Exception):
    """A prerequisite of the check is missing; the message is the reason."""


class Expect:
    """Collects the assertions of one check: every one is printed, all are evaluated."""

    def __init__(self, echo: bool = True) -> None:
        self.lines: List[str] = []
        self.failures: List[str] = []
        self.asserted = 0
        self.numbers: Dict[str, object] = {}
        self.heads: List[str] = []
        self.echo = echo

    def _say(self, line: str) -> None:
        self.lines.append(line)
        if self.echo:
            print(line, flush=True)

    def that(self, ok: bool, what: str) -> bool:
        self.asserted += 1
        if not ok:
            self.failures.append(what)
        self._say(f"  {'ok  ' if ok else 'FAIL'} {what}")
        return bool(ok)

    def info(self, what: str) -> None:
        self._say(f"  info {what}")

    def number(self, key: str, value) -> None:
        self.numbers[key] = value

    def headline(self, what: str) -> None:
        """A figure for the summary table (printed as info too)."""
        self.heads.append(what)
        self.info(what)

    def summary(self) -> str:
        if self.failures:
            return "; ".join(self.failures)[:500]
        return "; ".join(self.heads)[:500] or f"{self.asserted} assertions ok"

    @staticmethod
    def skip(reason: str) -> None:
        raise CheckSkipped(reason)

    def status(self) -> str:
        if self.failures:
            return "FAIL"
        if not self.asserted:  # a check that asserted nothing must not read as a PASS
            self.failures.append("no assertion was made")
            return "FAIL"
        return "PASS"


@dataclass
class Result:
    name: str
    status: str
    elapsed_s: float
    summary: str
    lines: List[str] = field(default_factory=list)
    numbers: Dict[str, object] = field(default_factory=dict)


@dataclass
class Check:
    name: str
    number: str
    title: str
    kind: str  # "worker": subprocess of this script; "host": runs commands from the orchestrator
    cap_s: float


CHECKS = [
    Check("cpu_mode_noop", "1", "CPU mode is a no-op where CUDA exists", "worker", 60),
    Check("compress_cuda", "2a", "compressors on CUDA: int4/int8/topk bytes and decode identical "
          "to CPU", "worker", 120),
    Check("error_feedback_cuda", "2b", "ErrorFeedback staged commit/discard on CUDA, bit-identical "
          "to CPU", "worker", 60),
    Check("importance_cuda", "2c", "ImportanceTracker on CUDA: scores, no host sync, side stream",
          "worker", 60),
    Check("interval_timer_cuda", "2d", "IntervalTimer with torch.cuda.Event measures a known "
          "sleep kernel", "worker", 60),
    Check("bench_compress", "2e", f"bench_compress --device cuda (one bucket; --dp 8 64 512): "
          f"batched t(dp=512) <= {DP_GOAL}x t(dp=8)", "host", 200),
    Check("side_stream_overlap", "3a", "importance on the controller's side stream overlaps the "
          "main stream (CUDA events)", "worker", 90),
    Check("grpo_run_timing", "3b", "GRPO runs on 1 GPU, strict comm: grpo_timing cuda_events, "
          "importance > 0, 0 < RU <= 1", "host", 330),
    Check("bf16_baseline_vs_grpo", "4a", "bf16 baseline vs GRPO (tiny, ~330M): finish, finite "
          "decreasing loss, tiers d+s; peak memory, step time", "host", 330),
    Check("te_spec", "4b", "the bf16 runs use the transformer-engine spec when it is importable",
          "host", 60),
    Check("pinned_offload", "5", "pinned-memory offload (memory tier)", "host", 60),
    Check("runtime_budget", "6", f"whole check under {BUDGET_S / 60:.0f} minutes", "host", 5),
]
CHECK_BY_NAME = {c.name: c for c in CHECKS}


@dataclass
class Command:
    rc: Optional[int]
    timed_out: bool
    elapsed_s: float
    log: str
    limit_s: float

    def tail(self, n: int = 5) -> str:
        try:
            with open(self.log, errors="replace") as fh:
                lines = [l.rstrip() for l in fh.readlines() if l.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])[-600:]
