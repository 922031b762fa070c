"""docs/reliability.md is generated on request, never as a side effect of tests: a complete reliability session leaves the checkout as it was and its results outside it;
tests/reliability/report.py turns them into the document.

The suite's own hooks (tests/reliability/conftest.py) run for real, in a subprocess, on a copy
of the checkout whose reliability folder holds one fast test that records a row: a complete
session of that copy is what made the old hooks rewrite docs/reliability.md."""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELIABILITY = os.path.join(REPO, "tests", "reliability")

FAST_TEST = '''
def test_row(table):
    table.row("kill -9 of one rank", "a row from a fast test", "it is recorded", "recorded", ok=True)
'''


def _digest(root):
    out = {}
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", ".pytest_cache")]
        for f in files:
            with open(os.path.join(base, f), "rb") as fh:
                out[os.path.relpath(os.path.join(base, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def checkout(tmp_path):
    """A copy of the checkout's reliability machinery (no test of its own but one fast row)."""
    repo = tmp_path / "repo"
    (repo / "tests" / "reliability").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "docs" / "reliability.md").write_text("the committed document\n")
    shutil.copy(os.path.join(REPO, "pytest.ini"), repo)
    shutil.copy(os.path.join(REPO, "tests", "harness.py"), repo / "tests")
    for name in os.listdir(RELIABILITY):
        if name.endswith(".py") and not name.startswith("test_"):
            shutil.copy(os.path.join(RELIABILITY, name), repo / "tests" / "reliability")
    (repo / "tests" / "reliability" / "test_fast_row.py").write_text(FAST_TEST)
    return repo


def _pytest(repo, results, *args):
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_GRPO_SLOW="1",
               MEGATRON_GRPO_RELIABILITY_RESULTS=str(results))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def _report(repo, *args):
    return subprocess.run([sys.executable, str(repo / "tests" / "reliability" / "report.py"), *args],
                          cwd=repo, capture_output=True, text=True, timeout=120)


def test_a_complete_session_leaves_the_checkout_alone(checkout, tmp_path):
    results = tmp_path / "results"
    before = _digest(checkout)
    run = _pytest(checkout, results, "tests/reliability")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    changed = sorted(p for p in set(before) | set(_digest(checkout)) if before.get(p) != _digest(checkout).get(p))
    assert changed == [], f"the session wrote into the checkout: {changed}"
    assert f"reliability results (complete session, 1 row): {results}" in run.stdout, run.stdout[-2000:]
    out = tmp_path / "reliability.md"
    made = _report(checkout, "--results", str(results), "--out", str(out))
    assert made.returncode == 0, made.stdout + made.stderr
    text = out.read_text()
    assert "| [kill -9 of one rank](#kill--9-of-one-rank) | 1 | 1 | 0 | 0 |" in text
    assert "| a row from a fast test | it is recorded | recorded | as expected | `test_row` |" in text
    assert (checkout / "docs" / "reliability.md").read_text() == "the committed document\n"


def test_the_report_refuses_a_partial_session_unless_asked(checkout, tmp_path):
    results = tmp_path / "results"
    run = _pytest(checkout, results, "tests/reliability/test_fast_row.py::test_row")  # picked by node id
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "reliability.md"
    refused = _report(checkout, "--results", str(results), "--out", str(out))
    assert refused.returncode == 2 and not out.exists()
    assert (f"error: {results}/results.json is from a partial session (tests picked by node id); "
            f"run the whole suite (MEGATRON_GRPO_SLOW=1 .venv/bin/python -m pytest tests/reliability), "
            f"or pass --allow-partial") in refused.stderr, refused.stderr
    made = _report(checkout, "--results", str(results), "--out", str(out), "--allow-partial")
    assert made.returncode == 0 and "partial session (tests picked by node id)" in out.read_text()


def test_a_results_folder_inside_the_checkout_is_refused(checkout):
    before = _digest(checkout)
    run = _pytest(checkout, checkout / "results", "tests/reliability")
    assert run.returncode == 4, run.stdout[-3000:] + run.stderr[-3000:]  # pytest's usage error
    assert (f"MEGATRON_GRPO_RELIABILITY_RESULTS={checkout}/results is inside the checkout {checkout}: "
            f"the suite never writes there; point it at a folder outside") in run.stderr, run.stderr[-2000:]
    assert _digest(checkout) == before
