"""CI's entry runs exactly README command 2, and a suite that collects nothing fails it."""

import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme_test_command() -> str:
    with open(os.path.join(REPO, "README.md")) as fh:
        for line in fh:
            if re.search(r"#\s*2\.", line):
                return line.split("#")[0].strip()
    raise AssertionError("README has no command 2")


def test_ci_entry_ends_with_the_readme_test_command():
    with open(os.path.join(REPO, ".ci", "run")) as fh:
        lines = [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[-1] == _readme_test_command()


def test_a_suite_that_collects_nothing_exits_1_unless_narrowed(tmp_path):
    (tmp_path / "tests").mkdir()
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), tmp_path / "tests" / "conftest.py")
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=120).returncode
    assert run() == 1
    assert run("-k", "nothing_matches") == 5
