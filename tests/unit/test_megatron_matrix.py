"""tools/megatron_matrix.sh (the megatron-core version matrix, docs/versions.md) without installing
anything: its syntax, argument checks, the recipe each version gets (tools/megatron_matrix/plan.py)
and how a version's results are read back (tools/megatron_matrix/report.py). The matrix itself
builds side environments and runs for minutes, so it stays out of the default suite.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "megatron_matrix.sh")
PY = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _load(name):
    path = os.path.join(REPO, "tools", "megatron_matrix", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"megatron_matrix_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


plan = _load("plan")
report = _load("report")


def _run(args, tmp_path, **env):
    e = dict(os.environ, MATRIX_DIR=str(tmp_path / "matrix"), MATRIX_PYTHON=sys.executable,
             MATRIX_HOST_PYTHON=sys.executable)
    e.update(env)
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=e, timeout=60)


def test_shell_script_syntax():
    proc = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("bad", ["0.19", "v0.19.2", "0.19.2.1", "latest", "0.19.x"])
def test_a_malformed_version_is_refused_before_anything_is_built(bad, tmp_path):
    proc = _run(["0.16.1", bad], tmp_path)
    assert proc.returncode == 2
    assert f"'{bad}' is not a megatron-core version: give MAJOR.MINOR.PATCH" in proc.stderr
    assert not (tmp_path / "matrix").exists()


@pytest.mark.parametrize("args, message", [
    (["--bogus", "0.19.2"], "unknown option '--bogus'"),
    ([], "give one or more megatron-core versions"),
])
def test_bad_arguments_exit_2_with_what_to_do(args, message, tmp_path):
    proc = _run(args, tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_unknown_step_and_bad_iteration_count_are_refused(tmp_path):
    proc = _run(["0.19.2"], tmp_path, MATRIX_STEPS="unit lint")
    assert proc.returncode == 2 and "unknown step 'lint' (steps: unit glue grpo)" in proc.stderr
    proc = _run(["0.19.2"], tmp_path, MATRIX_GRPO_ITERS="0")
    assert proc.returncode == 2 and "MATRIX_GRPO_ITERS must be a positive number" in proc.stderr
    proc = _run(["0.19.2"], tmp_path, MATRIX_GLUE_SLOW="yes")
    assert proc.returncode == 2 and "MATRIX_GLUE_SLOW must be 0 or 1, got 'yes'" in proc.stderr


def test_matrix_dir_inside_the_checkout_is_refused_and_not_created(tmp_path):
    inside = os.path.join(REPO, "matrix-test-never-created")
    proc = _run(["0.19.2"], tmp_path, MATRIX_DIR=inside)
    assert proc.returncode == 2 and "is inside the checkout; put it outside" in proc.stderr
    assert not os.path.exists(inside)


def test_plan_prints_each_recipe_and_installs_nothing(tmp_path):
    proc = _run(["--plan", "0.16.1", "0.19.2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    heads = [line for line in proc.stdout.splitlines() if line.startswith("megatron-core ")]
    want_new = (f"normal install (Python {PY})" if sys.version_info >= (3, 12)
                else f"test install (Python {PY}, requires >=3.12)")
    assert [h.split(" | ")[:2] for h in heads] == [
        ["megatron-core 0.16.1", f"normal install (Python {PY})"], ["megatron-core 0.19.2", want_new]]
    assert f"venv-0.19.2-py{PY} from {sys.executable}" in heads[1]
    assert "  pip install torch==2.13.0" in proc.stdout
    assert f"  pip install --no-deps -e {REPO}" in proc.stdout
    assert not any(p.name.startswith("venv-") for p in (tmp_path / "matrix").iterdir())


def test_glue_test_files_named_by_the_script_exist():
    text = open(SCRIPT).read()
    files = []
    for name in ("GLUE_TESTS", "GLUE_SLOW_TESTS"):
        block = re.search(rf"^{name}=\(\n(.*?)^\)", text, re.S | re.M).group(1)
        files += [line.strip() for line in block.splitlines() if line.strip()]
    assert len(files) == 9 and "tests/multiproc/test_single_unit.py" in files
    assert "tests/multiproc/test_megatron_versions_gloo.py" in files  # the version doubles run for real
    for f in files:
        assert os.path.isfile(os.path.join(REPO, f)), f


# -- plan.py ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, parsed", [("0.16.1", (0, 16, 1)), ("0.19.2", (0, 19, 2)),
                                          ("0.18.0rc1", (0, 18, 0)), (" 1.0.0 ", (1, 0, 0))])
def test_parse_version(text, parsed):
    assert plan.parse_version(text) == parsed


PY311, PY312 = ("/usr/bin/python3", (3, 11)), ("/opt/py312/bin/python3.12", (3, 12))


@pytest.mark.parametrize("version, candidates, kind, python, label", [
    ("0.16.1", [PY311], "normal", PY311[0], "normal install (Python 3.11)"),
    ("0.16.1", [PY311, PY312], "normal", PY311[0], "normal install (Python 3.11)"),
    ("0.17.0", [PY311], "test", PY311[0], "test install (Python 3.11, requires >=3.12)"),
    ("0.19.2", [PY311], "test", PY311[0], "test install (Python 3.11, requires >=3.12)"),
    ("0.20.0", [PY311], "test", PY311[0], "test install (Python 3.11, requires >=3.12)"),
    ("0.19.2", [PY311, PY312], "normal", PY312[0], "normal install (Python 3.12)"),
    ("0.18.2", [PY312], "normal", PY312[0], "normal install (Python 3.12)"),
])
def test_recipe_for_a_version_and_the_interpreters_at_hand(version, candidates, kind, python, label):
    r = plan.choose_recipe(version, candidates)
    assert (r.kind, r.python, r.label) == (kind, python, label)
    assert r.venv_name == f"venv-{version}-py{r.python_version[0]}.{r.python_version[1]}"


def test_pip_steps_pin_torch_and_build_the_test_install_without_dependencies():
    assert plan.choose_recipe("0.16.1", [PY311]).pip_steps() == [["torch==2.13.0"], ["megatron-core==0.16.1"]]
    assert plan.choose_recipe("0.19.2", [PY311]).pip_steps() == [
        ["torch==2.13.0"], ["setuptools", "pybind11", "numpy<2.3", "packaging", "triton"],
        ["--no-build-isolation", "--no-deps", "--ignore-requires-python", "megatron-core==0.19.2"]]


def test_recipe_refuses_an_interpreter_older_than_3_10():
    with pytest.raises(ValueError, match=r"Python 3.9 \(/usr/bin/python3.9\) is older"):
        plan.choose_recipe("0.19.2", [("/usr/bin/python3.9", (3, 9))])


def test_recipe_cli_prints_shell_assignments():
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "megatron_matrix", "plan.py"),
                          "recipe", "0.19.2", "/usr/bin/python3=3.11"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "RECIPE_KIND=test", "RECIPE_LABEL='test install (Python 3.11, requires >=3.12)'",
        "RECIPE_PYTHON='/usr/bin/python3'", "RECIPE_VENV='venv-0.19.2-py3.11'",
        "RECIPE_STEPS=('torch==2.13.0' 'setuptools pybind11 numpy<2.3 packaging triton' "
        "'--no-build-isolation --no-deps --ignore-requires-python megatron-core==0.19.2')"]


def test_project_requirements_read_from_setup_py(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text('from setuptools import setup\nsetup(name="x", install_requires=['
                     '"megatron-core==0.16.1", "numpy", "einops"],\n'
                     '      extras_require={"test": ["pytest>=8", "transformers"], "gpu": ["te"]})\n')
    assert plan.project_requirements(str(setup)) == ["numpy", "einops", "pytest>=8", "transformers"]
    real = plan.project_requirements(os.path.join(REPO, "setup.py"))
    assert not any(r.startswith("megatron-core") for r in real)
    assert {"einops", "psutil", "pytest>=8", "transformers"} <= set(real)


# -- report.py --------------------------------------------------------------------------------

def test_pytest_counts_and_failures():
    log = ("....F\nFAILED tests/multiproc/test_offload_training.py::test_resume_with_offload_is_exact"
           " - AssertionError: losses differ\nERROR tests/unit/test_x.py::test_y - OSError\n"
           "2 failed, 830 passed, 9 skipped, 1 error in 201.53s (0:03:21)\n")
    assert report.pytest_counts(log) == {"passed": 830, "failed": 2, "skipped": 9, "errors": 1, "found": 1}
    assert report.pytest_failures(log) == [
        "FAILED tests/multiproc/test_offload_training.py::test_resume_with_offload_is_exact - AssertionError: losses differ",
        "ERROR tests/unit/test_x.py::test_y - OSError"]
    assert report.pytest_counts("===== 12 passed in 3.00s =====")["passed"] == 12
    assert report.pytest_counts("Killed\n")["found"] == 0


def _records(norms, val=3.2611):
    recs = [{"iteration": i + 1, "grad_norm": g, "skipped": False} for i, g in enumerate(norms)]
    recs[-1]["val_loss"] = val
    return recs


def test_grpo_check_passes_a_healthy_run():
    check = report.check_grpo_records(_records([2.5] * 30), 30)
    assert check.ok and check.val_loss == 3.2611
    assert check.summary() == "grpo run 30 it val 3.2611 grad_norm>0 ok"


def test_grpo_check_names_the_iterations_with_a_zero_gradient_norm():
    check = report.check_grpo_records(_records([0.0] * 5 + [1.0] * 24 + [0.0]), 30)
    assert not check.ok and check.zero_grad_iterations == [1, 2, 3, 4, 5, 30]
    assert check.summary() == "grpo run 30 it val 3.2611 grad_norm 0.0 at iteration(s) 1-5,30"


def test_grpo_check_needs_every_iteration_and_a_finite_validation_loss():
    check = report.check_grpo_records(_records([1.0] * 29, val=float("nan")), 30)
    assert not check.ok
    assert check.notes == ["iterations logged [1, 2, 3]..[27, 28, 29] (29), expected 1..30",
                           "no finite validation loss (got nan)"]


def test_grpo_check_reads_the_last_run_of_a_metrics_file(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"event": "run_start"}, *_records([0.0, 0.0]), {"event": "run_start"}, *_records([1.5, 1.2])]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    check = report.check_grpo_metrics(str(path), 2)
    assert check.ok and check.iterations == 2
    missing = report.check_grpo_metrics(str(tmp_path / "none.jsonl"), 2)
    assert not missing.ok and "no metrics file" in missing.notes[0]


def test_results_table_gets_its_header_once(tmp_path):
    md = str(tmp_path / "results.md")
    report.append_row(md, "0.19.2", "test install (Python 3.11, requires >=3.12)", "tests/unit",
                      "FAIL: a | b", date="2026-12-05 10:00")
    report.append_row(md, "0.16.1", "normal install (Python 3.11)", "tests/unit", "PASS", date="2026-12-05 10:20")
    assert open(md).read().splitlines() == [
        "| megatron-core | install | what ran | result | date |", "|---|---|---|---|---|",
        "| 0.19.2 | test install (Python 3.11, requires >=3.12) | tests/unit | FAIL: a / b | 2026-12-05 10:00 |",
        "| 0.16.1 | normal install (Python 3.11) | tests/unit | PASS | 2026-12-05 10:20 |"]
