"""Modules that user scripts import keep their former names for one release after a move
(megatron_grpo.MOVED). A script's old import still works, gives the very module at the new place,
and warns with the new path, on the script's own line, so Python's default filter shows it.
CHANGELOG.md lists every move."""

import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_grpo import MOVED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_afresh(statement: str) -> tuple:
    """(the names ``statement`` bound, the DeprecationWarnings it raised), run as a line of a
    script named user_script.py. The former names are dropped from sys.modules first: a cached
    module is handed out again without running (or warning) again. New modules stay cached, so
    classes keep their identity for the rest of the suite."""
    for old in MOVED:
        sys.modules.pop(old, None)
        parent, _, child = old.rpartition(".")
        if child in vars(sys.modules[parent]):
            delattr(sys.modules[parent], child)
    scope = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(statement, "user_script.py", "exec"), scope)
    return scope, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_a_former_name_gives_the_new_module_and_warns(old, new):
    scope, caught = _import_afresh(f"import {old} as module")
    assert scope["module"] is sys.modules[new]
    assert sys.modules[old] is sys.modules[new]
    moved = [w for w in caught if str(w.message).startswith(f"{old} has moved")]
    assert [(str(w.message), w.filename, w.lineno) for w in moved] == [
        (f"{old} has moved to {new}: import {new} instead (the old name goes in the next release)",
         "user_script.py", 1)]


def test_the_readmes_old_imports_give_the_same_objects():
    scope, caught = _import_afresh("from megatron_grpo.config import GRPOConfig\n"
                                   "from megatron_grpo.controller import GRPOController\n"
                                   "from megatron_grpo.metrics_log import read_metrics\n")
    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.training.metrics_log import read_metrics

    assert (scope["GRPOConfig"], scope["GRPOController"], scope["read_metrics"]) == \
        (GRPOConfig, GRPOController, read_metrics)
    said = sorted((w.lineno, str(w.message).split(" ")[0]) for w in caught
                  if "has moved" in str(w.message))
    assert said == [(1, "megatron_grpo.config"), (2, "megatron_grpo.controller"), (3, "megatron_grpo.metrics_log")]


def test_a_script_shows_the_warning_under_pythons_default_filters(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from megatron_grpo.config import GRPOConfig\nprint(GRPOConfig.__module__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # conftest silences it
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "megatron_grpo.grpo.config\n"
    assert (f"{script}:1: DeprecationWarning: megatron_grpo.config has moved to megatron_grpo.grpo.config: "
            f"import megatron_grpo.grpo.config instead") in done.stderr


def test_each_former_name_is_a_file_at_its_old_place_and_its_new_module_exists():
    for old, new in MOVED.items():
        assert os.path.isfile(os.path.join(REPO, *old.split(".")) + ".py"), old
        assert os.path.isfile(os.path.join(REPO, *new.split(".")) + ".py"), new


def test_the_changelog_lists_every_kept_name_as_kept():
    text = open(os.path.join(REPO, "CHANGELOG.md")).read()
    rows = re.findall(r"^\| `([\w.]+)`[^|]* \| `([\w.]+)` \| ([^|]*)\|$", text, re.M)
    kept = {old: new for old, new, note in rows if note.strip() == "kept"}
    assert kept == MOVED
