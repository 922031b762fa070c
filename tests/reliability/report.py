"""docs/reliability.md from the results a reliability session left, on request.

    MEGATRON_GRPO_SLOW=1 .venv/bin/python -m pytest tests/reliability   # the whole suite
    .venv/bin/python tests/reliability/report.py --out docs/reliability.md

A session (tests/reliability/conftest.py) writes what it tried and what happened to
results.json in the results folder: $MEGATRON_GRPO_RELIABILITY_RESULTS, or
<tmp>/megatron_grpo_reliability (tempfile.gettempdir()). The folder is never inside the checkout
and the tests never write docs/reliability.md: a test run leaves the tracked files alone, and
the document changes only when someone asks for it from a complete session. A session that did
not run the whole suite (one file, -k, a node id, -x stopping early, the slow part gated off)
says so in its results, and this command refuses them unless --allow-partial.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from typing import Dict, List, Optional

RESULTS_ENV = "MEGATRON_GRPO_RELIABILITY_RESULTS"
RESULTS_FILE = "results.json"
FULL_RUN = "MEGATRON_GRPO_SLOW=1 .venv/bin/python -m pytest tests/reliability"
COMMAND = ".venv/bin/python tests/reliability/report.py --out docs/reliability.md"

TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s'\"]+/")
# The issue's order; groups not listed follow in the order their rows came.
GROUP_ORDER = ["kill -9 of one rank", "Corrupt and truncated checkpoint files",
               "Unwritable and full checkpoint directories", "Invalid config fields",
               "NaN/Inf in a gradient of each tier", "A collective that never completes",
               "SIGTERM (SLURM preemption)", "Invalid config fields, field by field",
               # "Never lose a run", in its order
               "Verified checkpoints are never overwritten", "One job per checkpoint directory",
               "kill -9 of the launcher", "Resume with changed flags", "A diverged run",
               "Damaged training data", "The metrics file"]
# The numbered cases of "Never lose a run": a row names the one it is evidence for (``table.row(..., case="30.1")``).
# 8 and 9 are about the suite itself: their outcome is the kill tests' and this document's.
ISSUE_30 = [("30.1", "Verified checkpoints are never overwritten"),
            ("30.2", "One job per checkpoint directory"),
            ("30.3", "Ranks die with their launcher"),
            ("30.4", "Resume honours what the user changed, or says why not"),
            ("30.5", "A diverged run stops"),
            ("30.6", "Damaged data found at start, named"),
            ("30.7", "The metrics file is an append-only log; a full checkpoint disk says so"),
            ("30.8", "Flaky under load: faults fire on events, not wall-clock budgets"),
            ("30.9", "docs/reliability.md from a run that does not touch the checkout")]
FLAKY = "tests/reliability/test_kill.py::"


def results_dir() -> str:
    return os.path.abspath(os.environ.get(RESULTS_ENV) or
                           os.path.join(tempfile.gettempdir(), "megatron_grpo_reliability"))


def inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


def save_results(folder: str, results: Dict) -> str:
    """Write results.json into ``folder`` (atomically); returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RESULTS_FILE)
    with open(path + ".part", "w") as fh:
        json.dump(results, fh, indent=1)
    os.replace(path + ".part", path)
    return path


def _cell(text) -> str:
    """One table cell: one line, pipes escaped, pytest's per-run tmp paths cut to <tmp>/."""
    return TMP.sub("<tmp>/", " ".join(str(text).split())).replace("|", "\\|")


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def _issue_30(results: Dict, rows: List[Dict]) -> List[str]:
    """One line per case of "Never lose a run": where its rows are and how they came out."""
    outcomes, durations = results["outcomes"], results["durations"]
    lines = ["## Never lose a run: each case and its outcome", "",
             "| case | outcome in this session |", "|---|---|"]
    for case, title in ISSUE_30:
        mine = [r for r in rows if r.get("case") == case]
        if case == "30.8":
            kills = {n: o for n, o in outcomes.items() if n.startswith(FLAKY)}
            said = (f"the kill tests (tests/reliability/test_kill.py) wait for the probe's fault event and "
                    f"give up only on a job that writes nothing for minutes: {sum(o == 'passed' for o in kills.values())} "
                    f"of {len(kills)} passed, in " + ", ".join(f"{durations.get(n, 0):.0f} s" for n in sorted(kills))
                    if kills else "the kill tests did not run in this session")
        elif case == "30.9":
            said = (f"this document, written by `{COMMAND}` from the results of a "
                    f"{'complete' if results['complete'] else 'partial'} session ({len(rows)} rows, commit "
                    f"{str(results.get('commit', 'unknown'))[:12]}, finished {results.get('finished', '?')}); "
                    f"the session wrote them to its results folder, outside the checkout")
        elif not mine:
            said = "no row in this session"
        else:
            groups = list(dict.fromkeys(r["group"] for r in mine))
            failed = sum(1 for r in mine if outcomes.get(r["test"]) == "failed" or r["verdict"] == "FAILED")
            said = (f"{len(mine)} row(s) in " + ", ".join(f"[{g}](#{_anchor(g)})" for g in groups) +
                    f": {sum(r['verdict'] == 'as expected' for r in mine)} as expected, "
                    f"{sum(r['verdict'] == 'GAP' for r in mine)} GAP, {failed} test(s) failed")
        lines.append(f"| {case[3:]}. {_cell(title)} | {said} |")
    return lines + [""]


def render(results: Dict) -> str:
    """The document's text from a session's results."""
    rows: List[Dict] = results["rows"]
    outcomes, durations = results["outcomes"], results["durations"]
    slow_ids = set(results["slow_ids"])
    groups = [g for g in GROUP_ORDER if any(r["group"] == g for r in rows)]
    for r in rows:
        if r["group"] not in groups:
            groups.append(r["group"])
    lines = [
        "# Reliability: what was tried and what happened",
        "",
        "Generated from a run of the reliability suite (tests/reliability/); do not",
        f"edit by hand. Regenerate: `{FULL_RUN}`, then",
        f"`{COMMAND}` (the tests never write this file; the",
        "command refuses the results of a partial session). CPU mode: torchrun, gloo, 2 ranks, the",
        "small GPT of tests/harness.py with GRPO on (GRPO_SMALL) unless a row says otherwise.",
        "",
    ]
    if not results["complete"]:
        lines += [f"**From a partial session ({results['incomplete']}): rows of the tests that ran only.**", ""]
    lines += [
        "Verdict: *as expected*, or *GAP*: the suite ran it, asserts what does hold, and the result",
        "falls short of the expectation in a way this suite does not fix (see the row). Seconds: the",
        "test's wall time, including a shared fixture (the reference run) for its first user.",
        "",
        "SIGTERM (SLURM preemption, torchrun stopping its ranks) no longer kills a rank inside",
        "`run()`: the handler notes it, all ranks agree at the end of every iteration (one 4-byte",
        "all-reduce, not counted in `wire_bytes`), and on any rank's signal every rank saves a",
        "checkpoint of that iteration (with `--save`), rank 0 prints `SIGTERM on N of W rank(s):",
        "stopped after iteration K ...`, and the ranks exit 0. The sender's SIGKILL still bounds a",
        "rank that cannot finish its iteration: torchrun waits 30 s, SLURM KillWait (default 30 s);",
        "a save that needs longer does not fit in the grace.",
        "",
        "NaN/Inf through the probe option (`tests/multiproc/grpo_probe.py --probe-inf`, delayed stable",
        "mode too, accumulator and carry digests checked) is tested in the default suite, not here:",
        "`tests/multiproc/test_grpo.py::test_non_finite_gradient_skips_the_step_and_keeps_grpo_state`.",
        "",
        "| scenario | rows | as expected | GAP | test failed |",
        "|---|---|---|---|---|",
    ]
    for g in groups:
        rows_g = [r for r in rows if r["group"] == g]
        failed = sum(1 for r in rows_g if outcomes.get(r["test"]) == "failed" or r["verdict"] == "FAILED")
        lines.append(f"| [{g}](#{_anchor(g)}) | {len(rows_g)} | "
                     f"{sum(r['verdict'] == 'as expected' for r in rows_g)} | "
                     f"{sum(r['verdict'] == 'GAP' for r in rows_g)} | {failed} |")
    lines.append("")
    lines += _issue_30(results, rows)
    for g in groups:
        lines += [f"## {g}", "", "| what was tried | expected | what happened | verdict | test | s |",
                  "|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["group"] == g):
            test = r["test"].split("::", 1)[-1]
            outcome = outcomes.get(r["test"], "?")
            verdict = r["verdict"] if outcome != "failed" else f"{r['verdict']}, test FAILED"
            lines.append(f"| {_cell(r['tried'])} | {_cell(r['expected'])} | {_cell(r['happened'])} | "
                         f"{verdict} | `{_cell(test)}` | {durations.get(r['test'], 0):.0f} |")
        lines.append("")
    total = sum(durations.values())
    slow = sum(d for n, d in durations.items() if n in slow_ids)
    lines += [f"Suite time: {total:.0f} s ({total - slow:.0f} s default part, {slow:.0f} s "
              f"reliability_slow part), {results['cpu_count']} CPU core(s).", ""]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=None,
                   help=f"the results folder of the session (default: ${RESULTS_ENV}, else "
                        f"<tmp>/megatron_grpo_reliability)")
    p.add_argument("--out", required=True, help="the document to write, e.g. docs/reliability.md")
    p.add_argument("--allow-partial", action="store_true",
                   help="write the document from a session that did not run the whole suite")
    args = p.parse_args(argv)
    path = os.path.join(os.path.abspath(args.results) if args.results else results_dir(), RESULTS_FILE)
    try:
        with open(path) as fh:
            results = json.load(fh)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read the reliability results {path} ({exc}); run the suite first "
              f"({FULL_RUN}), with {RESULTS_ENV} set as it is now", file=sys.stderr)
        return 2
    if not results["complete"] and not args.allow_partial:
        print(f"error: {path} is from a partial session ({results['incomplete']}); run the whole "
              f"suite ({FULL_RUN}), or pass --allow-partial", file=sys.stderr)
        return 2
    text = render(results)
    with open(args.out + ".part", "w") as fh:
        fh.write(text)
    os.replace(args.out + ".part", args.out)
    print(f"wrote {args.out} ({len(results['rows'])} rows) from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
