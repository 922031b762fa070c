"""The decisions of tools/megatron_matrix.sh that need no install: is a version string one,
which interpreter and install recipe a megatron-core version gets, and which of the project's
requirements go into a side environment. Standard library only: the script runs this with the
machine's python3 before any environment exists, and tests/unit/test_megatron_matrix.py imports
it by path.

    python3 tools/megatron_matrix/plan.py check 0.19.2            # exit 2 with a message if not a version
    python3 tools/megatron_matrix/plan.py recipe 0.19.2 /usr/bin/python3=3.11 /usr/bin/python3.12=3.12
    python3 tools/megatron_matrix/plan.py requirements setup.py   # one requirement a line
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from typing import List, Sequence, Tuple

# megatron-core 0.17.0 raised requires-python from >=3.10 to >=3.12 (its pyproject.toml); 0.17.0
# to 0.19.2 still parse and run on 3.11, which is what the test install relies on.
PY312_FROM = (0, 17, 0)
# The project's own CPU pin (setup.py's docstring, launch/setup_env.sh): a bare 'torch' would pull
# a multi-GB CUDA build.
TORCH_PIN = "torch==2.13.0"
# What megatron's imports need when pip installs it with --no-deps, and what building its sdist
# with --no-build-isolation needs where a release has no wheel for the interpreter (PyPI has
# cp311 wheels of 0.17.1-0.19.2); numpy below 2.3, as the tested releases were built against.
TEST_INSTALL_PREREQS = ["setuptools", "pybind11", "numpy<2.3", "packaging", "triton"]

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(rc\d+)?$")


class VersionError(ValueError):
    """Not a megatron-core release number (the script prints it and exits 2)."""


def parse_version(text: str) -> Tuple[int, int, int]:
    """'0.19.2' -> (0, 19, 2); release candidates ('0.18.0rc1') keep their release's numbers."""
    m = _VERSION.match(text.strip())
    if not m:
        raise VersionError(f"'{text}' is not a megatron-core version: give MAJOR.MINOR.PATCH as on "
                           f"PyPI, e.g. 0.19.2 or 0.18.0rc1 (see `pip index versions "
                           f"--ignore-requires-python megatron-core`)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def min_python(version: str) -> Tuple[int, int]:
    """The Python that megatron-core ``version`` declares as its minimum."""
    return (3, 12) if parse_version(version) >= PY312_FROM else (3, 10)


@dataclass(frozen=True)
class Recipe:
    """How one megatron-core version is installed into its side environment."""

    version: str
    python: str
    """The interpreter the environment is created from."""
    python_version: Tuple[int, int]
    kind: str
    """'normal': pip install megatron-core==V with its dependencies. 'test': pip install
    --no-build-isolation --no-deps --ignore-requires-python, on a Python older than it declares."""

    @property
    def label(self) -> str:
        if self.kind == "normal":
            return f"normal install (Python {_dotted(self.python_version)})"
        need = _dotted(min_python(self.version))
        return f"test install (Python {_dotted(self.python_version)}, requires >={need})"

    @property
    def venv_name(self) -> str:
        return f"venv-{self.version}-py{_dotted(self.python_version)}"

    def pip_steps(self) -> List[List[str]]:
        """The pip install argument lists, in order, up to megatron-core itself."""
        steps = [[TORCH_PIN]]
        if self.kind == "normal":
            steps.append([f"megatron-core=={self.version}"])
        else:
            steps.append(list(TEST_INSTALL_PREREQS))
            steps.append(["--no-build-isolation", "--no-deps", "--ignore-requires-python",
                          f"megatron-core=={self.version}"])
        return steps


def _dotted(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def parse_candidate(text: str) -> Tuple[str, Tuple[int, int]]:
    """'path=3.12' -> ('path', (3, 12))."""
    path, sep, ver = text.rpartition("=")
    parts = ver.split(".")
    if not sep or not path or len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"interpreter candidate '{text}': expected PATH=MAJOR.MINOR, e.g. /usr/bin/python3=3.11")
    return path, (int(parts[0]), int(parts[1]))


def choose_recipe(version: str, candidates: Sequence[Tuple[str, Tuple[int, int]]]) -> Recipe:
    """The first candidate interpreter that meets the version's minimum Python gets a normal
    install; with none, the first candidate gets a test install (a version that declares
    >=3.12, run on an older Python because its code still works there)."""
    if not candidates:
        raise ValueError("no Python interpreter to build the environment from")
    need = min_python(version)
    for path, pyver in candidates:
        if tuple(pyver) >= need:
            return Recipe(version, path, tuple(pyver), "normal")
    path, pyver = candidates[0]
    if tuple(pyver) < (3, 10):
        raise ValueError(f"Python {_dotted(pyver)} ({path}) is older than any megatron-core the "
                         f"project supports runs on; use Python >= 3.10 (MATRIX_PYTHON=...)")
    return Recipe(version, path, tuple(pyver), "test")


def project_requirements(setup_py: str) -> List[str]:
    """setup.py's install_requires plus its 'test' extra, without the megatron-core pin (the
    matrix installs its own version), read from the file's setup(...) call without running it."""
    with open(setup_py) as fh:
        tree = ast.parse(fh.read(), setup_py)
    call = next((n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) == "setup"), None)
    if call is None:
        raise ValueError(f"{setup_py}: no setup(...) call")
    kw = {k.arg: k.value for k in call.keywords}
    reqs = list(ast.literal_eval(kw["install_requires"])) if "install_requires" in kw else []
    if "extras_require" in kw:
        reqs += list(ast.literal_eval(kw["extras_require"]).get("test", []))
    out: List[str] = []
    for r in reqs:
        name = re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-")
        if name != "megatron-core" and r not in out:
            out.append(r)
    return out


def _shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def main(argv: Sequence[str]) -> int:
    usage = ("usage: plan.py check VERSION | recipe VERSION PATH=X.Y [PATH=X.Y ...] | "
             "requirements SETUP_PY")
    if len(argv) < 2:
        print(usage, file=sys.stderr)
        return 2
    cmd, rest = argv[0], list(argv[1:])
    try:
        if cmd == "check":
            for v in rest:
                parse_version(v)
            return 0
        if cmd == "recipe":
            recipe = choose_recipe(rest[0], [parse_candidate(c) for c in rest[1:]])
            # Shell assignments for `eval`: one value each, quoted.
            print(f"RECIPE_KIND={recipe.kind}")
            print(f"RECIPE_LABEL={_shell_quote(recipe.label)}")
            print(f"RECIPE_PYTHON={_shell_quote(recipe.python)}")
            print(f"RECIPE_VENV={_shell_quote(recipe.venv_name)}")
            print("RECIPE_STEPS=(" + " ".join(_shell_quote(" ".join(s)) for s in recipe.pip_steps()) + ")")
            return 0
        if cmd == "requirements":
            print("\n".join(project_requirements(rest[0])))
            return 0
    except (ValueError, OSError) as exc:
        print(f"error (megatron_matrix): {exc}", file=sys.stderr)
        return 2
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
