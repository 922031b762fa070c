"""The reliability suite's fixtures: the slow gate, the shared reference run, and the table of
what was tried and what happened, which a session leaves in its results folder (outside the
checkout) for tests/reliability/report.py to turn into docs/reliability.md.

Slow gate: tests marked ``reliability_slow`` (minutes on 2 cores) are skipped unless selected
with ``-m reliability_slow`` (or any -m expression naming it without "not") or with
MEGATRON_GRPO_SLOW=1. The README/CI command (``pytest tests``) therefore runs only the fast part.

Results: every session that recorded a row writes results.json (rows, outcomes, durations,
and whether the whole suite ran: every test file here collected, nothing deselected or picked
by node id, the slow tests not gated off, every test reported) into
$MEGATRON_GRPO_RELIABILITY_RESULTS or <tmp>/megatron_grpo_reliability, never into the checkout
(a folder inside it is refused at start). No test writes docs/reliability.md; regenerate it with
``MEGATRON_GRPO_SLOW=1 .venv/bin/python -m pytest tests/reliability`` and then
``.venv/bin/python tests/reliability/report.py --out docs/reliability.md`` (report.py refuses the
results of a partial session).
"""

import glob
import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: harness

from harness import REPO, read_metrics  # noqa: E402
from reliability_harness import REF_ITERS, REF_SAVE_INTERVAL, base_args, run_to_end  # noqa: E402
import report  # noqa: E402

SLOW_MARK = "reliability_slow"
GATE_REASON = "reliability_slow test (minutes): run with -m reliability_slow or MEGATRON_GRPO_SLOW=1"

# -- the slow gate ---------------------------------------------------------------------------------


def _slow_enabled(config) -> bool:
    if os.environ.get("MEGATRON_GRPO_SLOW") == "1":
        return True
    expr = config.getoption("markexpr") or ""
    return re.search(rf"(?<!not ){SLOW_MARK}\b", expr) is not None


def _ours(item) -> bool:
    return str(item.fspath).startswith(HERE + os.sep)


def pytest_configure(config):
    if report.inside(report.results_dir(), REPO):
        raise pytest.UsageError(
            f"{report.RESULTS_ENV}={report.results_dir()} is inside the checkout {REPO}: the suite "
            f"never writes there; point it at a folder outside (default: unset, "
            f"<tmp>/megatron_grpo_reliability)")


_STATE = {"items": [], "deselected": 0, "reported": set(), "gated": 0}


def pytest_collection_modifyitems(config, items):
    slow = _slow_enabled(config)
    for item in items:
        if _ours(item) and item.get_closest_marker(SLOW_MARK) and not slow:
            item.add_marker(pytest.mark.skip(reason=GATE_REASON))


def pytest_deselected(items):
    _STATE["deselected"] += sum(1 for i in items if _ours(i))


def pytest_collection_finish(session):
    _STATE["items"] = [i.nodeid for i in session.items if _ours(i)]


# -- the table -------------------------------------------------------------------------------------

ROWS = []  # dicts: group, tried, expected, happened, verdict, test
DURATIONS = {}  # nodeid -> seconds (setup + call: a session fixture counts for its first user)
OUTCOMES = {}  # nodeid -> passed / failed / skipped (worst of the phases)


class Table:
    """``table.row(group, tried, expected, happened, ok=True, case="")``: one line of the results
    (and of docs/reliability.md, once report.py is run).
    ``ok`` False marks a gap: the suite ran it and the result falls short of what is expected
    (the test asserts what does hold; the gap is in the table and in the report).
    ``case``: the issue case the row is evidence for, e.g. "30.1" (report.ISSUE_30)."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def row(self, group: str, tried: str, expected: str, happened: str, ok: bool = True,
            case: str = "") -> None:
        ROWS.append(dict(group=group, tried=tried, expected=expected, happened=happened,
                         verdict="as expected" if ok else "GAP", test=self.nodeid, case=case))


@pytest.fixture
def table(request):
    return Table(request.node.nodeid)


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith("tests/reliability/"):
        return
    _STATE["reported"].add(report.nodeid)
    DURATIONS[report.nodeid] = DURATIONS.get(report.nodeid, 0.0) + report.duration
    if report.skipped and GATE_REASON in str(report.longrepr):
        _STATE["gated"] += 1
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    outcome = report.outcome
    if report.when != "call" and outcome == "passed":
        outcome = OUTCOMES.get(report.nodeid, "passed")
    if rank[outcome] >= rank.get(OUTCOMES.get(report.nodeid, "passed"), 0):
        OUTCOMES[report.nodeid] = outcome
    if report.failed and not any(r["test"] == report.nodeid for r in ROWS):
        ROWS.append(dict(group="(failed before recording)", tried=report.nodeid.split("::")[-1],
                         expected="-", happened=str(report.longrepr).strip().splitlines()[-1][:300],
                         verdict="FAILED", test=report.nodeid))


def _incomplete(session) -> str:
    """Why this session is not the whole suite, or '' when it is."""
    if _STATE["deselected"]:
        return f"{_STATE['deselected']} test(s) deselected"
    if _STATE["gated"]:
        return f"{_STATE['gated']} reliability_slow test(s) gated off (no -m reliability_slow or MEGATRON_GRPO_SLOW=1)"
    if not _STATE["items"]:
        return "no reliability test collected"
    if any("::" in str(a) for a in session.config.args):
        return "tests picked by node id"
    files = {os.path.relpath(p, REPO) for p in glob.glob(os.path.join(HERE, "test_*.py"))}
    missing = files - {n.split("::")[0] for n in _STATE["items"]}
    if missing:
        return f"not collected: {', '.join(sorted(missing))}"
    unreported = set(_STATE["items"]) - _STATE["reported"]
    if unreported:
        return f"{len(unreported)} test(s) never reported (stopped early)"
    return ""


_SLOW_IDS = set()


def pytest_itemcollected(item):
    if _ours(item) and item.get_closest_marker(SLOW_MARK):
        _SLOW_IDS.add(item.nodeid)


def _commit() -> str:
    run = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else "unknown"


def pytest_sessionfinish(session, exitstatus):
    if not ROWS:
        return
    why = _incomplete(session)
    path = report.save_results(report.results_dir(), {
        "rows": ROWS, "outcomes": OUTCOMES, "durations": DURATIONS, "slow_ids": sorted(_SLOW_IDS),
        "complete": not why, "incomplete": why, "cpu_count": os.cpu_count(), "commit": _commit(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    what = "complete session" if not why else f"partial session: {why}"
    print(f"\nreliability results ({what}, {len(ROWS)} row{'s' * (len(ROWS) != 1)}): "
          f"{os.path.dirname(path)}; docs/reliability.md from them: {report.COMMAND}"
          + (" --allow-partial" if why else ""))


# -- shared runs -----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def reference(stdlib_data, tmp_path_factory):
    """One uninterrupted GRPO run of REF_ITERS iterations, checkpoints every REF_SAVE_INTERVAL:
    the losses every resumed run must reproduce bit for bit, and the checkpoints the damage tests
    copy. (Saving does not change training: tests/multiproc/test_checkpoint.py.)"""
    tmp = tmp_path_factory.mktemp("reference")
    metrics = str(tmp / "ref.jsonl")
    t0 = time.monotonic()
    job = run_to_end(tmp / "job", 2, [*base_args(stdlib_data), "--save", str(tmp / "ckpt"),
                                      "--save-interval", str(REF_SAVE_INTERVAL), "--metrics-file", metrics],
                     watch=[metrics, tmp / "ckpt"], probe=False)  # no wall-clock budget: load slows it
    assert job.rc == 0, job.text[-5000:]
    records = read_metrics(metrics)
    assert [r["iteration"] for r in records] == list(range(1, REF_ITERS + 1))
    return dict(records=records, ckpt=tmp / "ckpt", args=base_args(stdlib_data),
                seconds=time.monotonic() - t0)
