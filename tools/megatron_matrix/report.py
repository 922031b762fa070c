"""What tools/megatron_matrix.sh reads back from a version's runs: pytest's counts and failed
tests, the GRPO run's metrics, and the results table. Runs in the side environment (it reads
the metrics file with the project's own reader); tests/unit/test_megatron_matrix.py imports it
by path.

    python report.py pytest LOG                      # shell assignments: PASSED= FAILED= ...
    python report.py failures LOG                    # the FAILED/ERROR lines of pytest's summary
    python report.py grpo METRICS_JSONL ITERATIONS   # shell assignments: GRPO_OK= GRPO_VAL= GRPO_NOTE=
    python report.py row RESULTS_MD VERSION KIND RAN RESULT   # append a row (header if new)
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
_SUMMARY = re.compile(r"^=*\s*(no tests ran|\d+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b.*\bin [\d.]+s)")


def pytest_counts(text: str) -> Dict[str, int]:
    """The counts of pytest's closing line ('3 failed, 830 passed, 9 skipped in 201.5s'), 0 for
    those it does not name; all zero and ``found`` 0 when the log has no closing line (the
    session crashed or was killed)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "found": 0}
    for line in reversed(text.splitlines()):
        if _SUMMARY.match(line.strip()):
            for n, what in _COUNT.findall(line):
                key = "errors" if what.startswith("error") else what
                if key in counts:
                    counts[key] = int(n)
            counts["found"] = 1
            break
    return counts


def pytest_failures(text: str) -> List[str]:
    """The 'FAILED test - reason' and 'ERROR test - reason' lines of pytest's short summary."""
    return [line.strip() for line in text.splitlines() if re.match(r"^(FAILED|ERROR) \S", line.strip())]


@dataclass
class GrpoCheck:
    ok: bool
    val_loss: Optional[float]
    iterations: int
    zero_grad_iterations: List[int] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def summary(self) -> str:
        val = "-" if self.val_loss is None else f"{self.val_loss:.4f}"
        head = f"grpo run {self.iterations} it val {val}"
        return f"{head} grad_norm>0 ok" if self.ok else f"{head} " + "; ".join(self.notes)


def _ranges(xs: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> '1-3,7'."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def check_grpo_records(records: List[dict], iterations: int) -> GrpoCheck:
    """The run logged every iteration 1..``iterations``, each with a finite gradient norm > 0 and
    an applied update, and a finite validation loss at the end. A norm of 0.0 means the
    optimizer read no gradient (the clip and the update then see nothing), which a version
    change in megatron's grad-norm path can cause silently."""
    notes: List[str] = []
    its = [r.get("iteration") for r in records]
    if its != list(range(1, iterations + 1)):
        notes.append(f"iterations logged {its[:3]}..{its[-3:]} ({len(its)}), expected 1..{iterations}")
    zero = [r["iteration"] for r in records if r.get("grad_norm") is not None and r["grad_norm"] == 0.0]
    missing = [r["iteration"] for r in records if r.get("grad_norm") is None]
    bad = [r["iteration"] for r in records if r.get("grad_norm") is not None
           and not math.isfinite(r["grad_norm"])]
    skipped = [r["iteration"] for r in records if r.get("skipped")]
    if zero:
        notes.append(f"grad_norm 0.0 at iteration(s) {_ranges(zero)}")
    if missing:
        notes.append(f"no grad_norm at iteration(s) {_ranges(missing)}")
    if bad:
        notes.append(f"non-finite grad_norm at iteration(s) {_ranges(bad)}")
    if skipped:
        notes.append(f"update skipped at iteration(s) {_ranges(skipped)}")
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    val = vals[-1] if vals else None
    if val is None or not math.isfinite(val):
        notes.append(f"no finite validation loss (got {val})")
    return GrpoCheck(not notes, val, len(records), zero, notes)


def check_grpo_metrics(path: str, iterations: int) -> GrpoCheck:
    if not os.path.exists(path):
        return GrpoCheck(False, None, 0, notes=[f"no metrics file {path} (the run failed before "
                                                f"its first iteration; see its log)"])
    sys.path.insert(0, REPO)
    from megatron_grpo.training.metrics_log import read_metrics

    return check_grpo_records(read_metrics(path), iterations)


HEADER = ("| megatron-core | install | what ran | result | date |\n"
          "|---|---|---|---|---|\n")


def append_row(md_path: str, version: str, kind: str, ran: str, result: str,
               date: Optional[str] = None) -> str:
    """Append one row to the markdown results table (header first when the file is new)."""
    date = date or time.strftime("%Y-%m-%d %H:%M")
    cells = [c.replace("|", "/").replace("\n", " ") for c in (version, kind, ran, result, date)]
    row = "| " + " | ".join(cells) + " |\n"
    new = not os.path.exists(md_path) or os.path.getsize(md_path) == 0
    with open(md_path, "a") as fh:
        if new:
            fh.write(HEADER)
        fh.write(row)
    return row


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, rest = argv[0], list(argv[1:])
    if cmd in ("pytest", "failures") and len(rest) == 1:
        with open(rest[0], errors="replace") as fh:
            text = fh.read()
        if cmd == "failures":
            for line in pytest_failures(text):
                print(line)
        else:
            for k, v in pytest_counts(text).items():
                print(f"{k.upper()}={v}")
        return 0
    if cmd == "grpo" and len(rest) == 2:
        check = check_grpo_metrics(rest[0], int(rest[1]))
        print(f"GRPO_OK={int(check.ok)}")
        print(f"GRPO_VAL={'-' if check.val_loss is None else f'{check.val_loss:.4f}'}")
        print(f"GRPO_NOTE={_quote(check.summary())}")
        return 0
    if cmd == "row" and len(rest) == 5:
        print(append_row(*rest), end="")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
