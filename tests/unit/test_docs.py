"""Docs that run: the README's and docs/*.md's marked code blocks are executed here.

Marker convention (an HTML comment alone on the line right before a fenced block; it does not
show when the Markdown is rendered):

    <!-- runnable -->                  run the block in the default test run (keep it to seconds)
    <!-- runnable: slow -->            run it only with ``pytest -m slow`` (minutes: the quickstart)
    <!-- runnable: needs-corpus -->    build the default corpus (data/stdlib) first; combine
                                       options with commas: ``<!-- runnable: slow, needs-corpus -->``
    <!-- excerpt: PATH -->             a python block whose statements must all occur in PATH
                                       (relative to the repository); ``...`` stands for anything,
                                       also for elided call arguments: ``f(a=1, ...)``

Runnable languages: ``bash``/``sh``/``shell`` (the block is one bash script, ``set -euo pipefail``)
and ``python`` (the block is one script). Blocks run in order (README.md, then docs/*.md by
name) in one scratch directory per test session that mirrors the checkout (a symlink per
top-level entry), so what they write (data/, runs/, corpus/) stays out of the checkout and a
block may use what an earlier block wrote; ``python`` and ``torchrun`` are the test
interpreter's. A shell command listed in ``EXCLUDED`` (with its reason) is cut from its block and
reported as a skipped test; a block listed in ``COVERED`` is run by the named test instead
(as written, plus flags for a shorter run), which checks its output. Unmarked blocks are not run. ``test_markers_are_well_formed`` fails on
a misspelt marker or option, an unknown language, a marker not followed by a block, or an
exclusion that no longer matches anything.
"""

from __future__ import annotations

import ast
import difflib
import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHELL_LANGS = ("bash", "sh", "shell")
PYTHON_LANGS = ("python",)
RUNNABLE_OPTIONS = ("slow", "needs-corpus")
MARKER_KINDS = ("runnable", "excerpt")
FAST_TIMEOUT_S = 240
SLOW_TIMEOUT_S = 1800

# (file, command) -> why it is not run. Matched as a substring of a logical command line.
EXCLUDED: Dict[Tuple[str, str], str] = {
    ("README.md", "bash launch/setup_env.sh && .venv/bin/python -m pytest -q tests"):
        "README command 2 runs the whole test suite, which contains this test (recursion); "
        "CI (.ci/run) runs exactly that command",
}

# (file, text in the block) -> the test that runs that block itself (with extra flags) and checks
# its numbers; the generic runner does not run it a second time.
COVERED: Dict[Tuple[str, str], str] = {
    ("README.md", "examples/train_with_grpo.py"): "test_example_trains_with_grpo_tiers",
}

_MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^\s`]*)")


@dataclass
class Block:
    path: str            # relative to REPO
    line: int            # 1-based line of the opening fence
    lang: str
    text: str
    kind: str            # "runnable" or "excerpt"
    options: List[str] = field(default_factory=list)
    target: Optional[str] = None     # excerpt: the file it quotes
    excluded: List[Tuple[str, str]] = field(default_factory=list)   # (command, reason)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def slow(self) -> bool:
        return "slow" in self.options


def doc_files() -> List[str]:
    docs = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
    return ["README.md", *docs]


def _blocks_of_text(path: str, text: str) -> Tuple[List[Block], List[str]]:
    """Marked blocks of one Markdown text, and the problems found (for the marker test)."""
    lines = text.splitlines()
    blocks, problems = [], []
    i = 0
    while i < len(lines):
        m = _MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        body = m.group(1)
        head, _, rest = body.partition(":")
        word = head.strip().lower()
        where = f"{path}:{i + 1}"
        if word not in MARKER_KINDS:
            close = difflib.get_close_matches(word.split()[0] if word.split() else word,
                                              MARKER_KINDS, n=1, cutoff=0.6)
            if close:
                problems.append(f"{where}: unknown marker {body!r}; did you mean '{close[0]}'?")
            i += 1
            continue                          # an unrelated HTML comment
        options = [o.strip() for o in rest.split(",") if o.strip()] if word == "runnable" else []
        for o in options:
            if o not in RUNNABLE_OPTIONS:
                close = difflib.get_close_matches(o, RUNNABLE_OPTIONS, n=1, cutoff=0.5)
                problems.append(f"{where}: unknown runnable option {o!r}"
                                + (f"; did you mean '{close[0]}'?" if close else "")
                                + f" (accepted: {', '.join(RUNNABLE_OPTIONS)})")
        target = rest.strip() if word == "excerpt" else None
        if word == "excerpt" and (not target or not os.path.isfile(os.path.join(REPO, target))):
            problems.append(f"{where}: excerpt of {target!r}: no such file in the repository")
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None:
            problems.append(f"{where}: marker {body!r} is not on the line right before a fenced block")
            i += 1
            continue
        indent, ticks, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        end = i + 2
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        if end == len(lines):
            problems.append(f"{where}: fenced block opened on line {i + 2} is never closed")
        code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 2:end])
        allowed = SHELL_LANGS + PYTHON_LANGS if word == "runnable" else PYTHON_LANGS
        if lang not in allowed:
            problems.append(f"{where}: {word} block has language {lang or '(none)'!r}; accepted: "
                            f"{', '.join(allowed)}")
        blocks.append(Block(path, i + 2, lang, code + "\n", word, options, target))
        i = end + 1
    return blocks, problems


def _logical_lines(script: str) -> List[Tuple[int, int]]:
    """(first, last) physical line indices of each command line, joining backslash continuations."""
    out, lines, start = [], script.splitlines(), None
    for k, ln in enumerate(lines):
        if start is None:
            start = k
        if not ln.rstrip().endswith("\\"):
            out.append((start, k))
            start = None
    if start is not None:
        out.append((start, len(lines) - 1))
    return out


def _apply_exclusions(block: Block, used: set) -> None:
    if block.lang not in SHELL_LANGS:
        return
    lines = block.text.splitlines()
    keep = [True] * len(lines)
    for first, last in _logical_lines(block.text):
        command = " ".join(lines[first:last + 1])
        for (path, pattern), reason in EXCLUDED.items():
            if path == block.path and pattern in command:
                used.add((path, pattern))
                block.excluded.append((pattern, reason))
                for k in range(first, last + 1):
                    keep[k] = False
    block.text = "\n".join(ln for ln, k in zip(lines, keep) if k) + "\n"


def collect() -> Tuple[List[Block], List[str]]:
    blocks, problems, used = [], [], set()
    for path in doc_files():
        with open(os.path.join(REPO, path), encoding="utf-8") as fh:
            found, issues = _blocks_of_text(path, fh.read())
        problems += issues
        for b in found:
            _apply_exclusions(b, used)
        blocks += found
    for key, test in COVERED.items():
        if not any(b.kind == "runnable" and b.path == key[0] and key[1] in b.text for b in blocks):
            problems.append(f"COVERED entry {key} ({test}) matches no runnable block of {key[0]}")
    for key in EXCLUDED:
        if key not in used:
            problems.append(f"EXCLUDED entry {key} matches no command of a runnable block in "
                            f"{key[0]}: remove or update it")
    return blocks, problems


BLOCKS, PROBLEMS = collect()
RUNNABLE = [b for b in BLOCKS if b.kind == "runnable"]
EXCERPTS = [b for b in BLOCKS if b.kind == "excerpt"]


# ------------------------------------------------------------------------------ the marker check
def test_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    # The convention is in use where the issue asked for it.
    ids = {b.path for b in RUNNABLE}
    assert {"README.md", "docs/planner.md", "docs/data.md", "docs/cpu_mode.md"} <= ids
    readme_first = min((b for b in RUNNABLE if b.path == "README.md"), key=lambda b: b.line)
    assert readme_first.slow and "launch/quickstart.sh" in readme_first.text
    assert "pytest" not in readme_first.text          # command 2 was cut (EXCLUDED)


@pytest.mark.parametrize("text, message", [
    ("<!-- runable -->\n```bash\necho hi\n```\n", "unknown marker 'runable'; did you mean 'runnable'?"),
    ("<!-- runnable: slwo -->\n```bash\necho hi\n```\n", "unknown runnable option 'slwo'; did you mean 'slow'?"),
    ("<!-- runnable -->\n```yaml\na: 1\n```\n", "runnable block has language 'yaml'"),
    ("<!-- runnable -->\n```\necho hi\n```\n", "runnable block has language '(none)'"),
    ("<!-- runnable -->\n```pyhton\nprint(1)\n```\n", "runnable block has language 'pyhton'"),
    ("<!-- runnable -->\n\n```bash\necho hi\n```\n", "is not on the line right before a fenced block"),
    ("<!-- exerpt: README.md -->\n```python\nx = 1\n```\n", "did you mean 'excerpt'?"),
    ("<!-- excerpt: no/such/file.py -->\n```python\nx = 1\n```\n", "no such file in the repository"),
])
def test_marker_check_catches_typos(text, message):
    _, problems = _blocks_of_text("x.md", "Some text.\n\n" + text)
    assert any(message in p for p in problems), problems


def test_marker_parser_reads_options_and_ignores_other_comments():
    text = ("<!-- a plain comment -->\n```bash\nnot run\n```\n"
            "<!-- runnable: slow, needs-corpus -->\n```sh\necho a \\\n  b\necho c\n```\n")
    blocks, problems = _blocks_of_text("x.md", text)
    assert problems == [] and len(blocks) == 1
    b = blocks[0]
    assert (b.line, b.lang, b.options, b.text) == (6, "sh", ["slow", "needs-corpus"], "echo a \\\n  b\necho c\n")
    assert _logical_lines(b.text) == [(0, 1), (2, 2)]


# ------------------------------------------------------------------------------ running the blocks
@pytest.fixture(scope="session")
def docs_workspace(tmp_path_factory):
    """A scratch directory that looks like the checkout: one symlink per top-level entry."""
    ws = tmp_path_factory.mktemp("docs_workspace")
    for name in os.listdir(REPO):
        if name in (".git", "data", "runs", "corpus", ".pytest_cache"):
            continue
        os.symlink(os.path.join(REPO, name), ws / name)
    return ws


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _run(cmd: List[str], cwd, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=str(cwd), env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _ensure_corpus(ws) -> None:
    proc = _run([sys.executable, "launch/preprocess_data.py", "--default-corpus", "--output-prefix",
                 "data/stdlib"], ws, FAST_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _params():
    out = []
    for b in RUNNABLE:
        marks = [pytest.mark.slow] if b.slow else []
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


@pytest.mark.parametrize("block", _params())
def test_runnable_block(block: Block, docs_workspace):
    covered = [t for (path, text), t in COVERED.items() if path == block.path and text in block.text]
    if covered:
        pytest.skip(f"run and checked by {covered[0]}")
    if "needs-corpus" in block.options:
        _ensure_corpus(docs_workspace)
    timeout = SLOW_TIMEOUT_S if block.slow else FAST_TIMEOUT_S
    if block.lang in SHELL_LANGS:
        cmd = ["bash", "-c", "set -euo pipefail\n" + block.text]
    else:
        script = docs_workspace / f"_block_{block.path.replace('/', '_')}_{block.line}.py"
        script.write_text(block.text)
        cmd = [sys.executable, str(script)]
    proc = _run(cmd, docs_workspace, timeout)
    assert proc.returncode == 0, (f"{block.id} ({block.lang}) failed with rc {proc.returncode}:\n"
                                  f"{block.text}\n--- stdout\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr\n{proc.stderr[-5000:]}")


# ------------------------------------------------------------------------------ excerpts
def _statement_patterns(code: str) -> List[str]:
    """Each top-level statement of the excerpt, normalised by ast, as a regex (``...`` = any)."""
    # `f(a=1, ...)` is not valid Python: an elided argument becomes `**_ANY_` (valid anywhere in
    # a call), which the pattern turns back into "anything".
    code = re.sub(r"(?<=[(,\s])\.\.\.(?=\s*[,)])", "**_ANY_", code)
    out = []
    for node in ast.parse(code).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node.value.value is Ellipsis:
            continue
        text = re.escape(ast.unparse(node))
        out.append(text.replace(re.escape("**_ANY_"), ".*").replace(re.escape("..."), ".*"))
    return out


def _statements_of(path: str) -> List[str]:
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.stmt)]


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in EXCERPTS])
def test_excerpt_is_in_its_file(block):
    statements = _statements_of(block.target)
    missing = [p for p in _statement_patterns(block.text)
               if not any(re.fullmatch(p, s, flags=re.S) for s in statements)]
    assert not missing, (f"{block.id}: statements not in {block.target} (update the excerpt or "
                         f"the file):\n" + "\n".join(m.replace("\\", "") for m in missing))


def test_excerpt_check_rejects_a_changed_statement():
    statements = ["ctrl = GRPOController(grpo, [model], platform.device, dp_group)",
                  "grpo = GRPOConfig(enabled=True, bucket_mb=args.bucket_mb)"]
    ok = _statement_patterns("grpo = GRPOConfig(enabled=True, ...)\n"
                             "ctrl = GRPOController(grpo, [model], platform.device, dp_group)\n")
    bad = _statement_patterns("ctrl = GRPOController(grpo, [model], device, dp_group)\n")
    assert all(any(re.fullmatch(p, s, flags=re.S) for s in statements) for p in ok)
    assert not any(re.fullmatch(p, s, flags=re.S) for p in bad for s in statements)


# ------------------------------------------------------------------------------ the example
def test_example_trains_with_grpo_tiers(tmp_path):
    """The README's command for examples/train_with_grpo.py (2 gloo ranks, torchrun), run as
    written plus a shorter run and a summary file: tiers applied, loss falls, bytes drop."""
    (path, text), = [k for k, t in COVERED.items() if t == "test_example_trains_with_grpo_tiers"]
    block, = [b for b in RUNNABLE if b.path == path and text in b.text]
    command, = [ln for ln in block.text.splitlines() if text in ln]
    out = tmp_path / "summary.json"
    script = f"{command} --iters 12 --warmup 4 --stable-interval 2 --summary-json {shlex.quote(str(out))}"
    assert "torchrun" in script and "--nproc_per_node 2" in script
    proc = _run(["bash", "-c", "set -euo pipefail\n" + script], REPO, 300)
    assert proc.returncode == 0, script + "\n" + proc.stdout[-3000:] + proc.stderr[-6000:]
    s = json.loads(out.read_text())
    records = s["records"]
    assert s["world_size"] == 2 and len(records) == 12
    # Tiers applied after the 4 exact warm-up steps: dynamic and stable units exist.
    assert [r["tiered"] for r in records] == [False] * 4 + [True] * 8
    assert "d" in s["tier_map"] and "s" in s["tier_map"] and len(s["tier_map"]) == s["units"] >= 4
    assert s["shares"]["dynamic"] > 0.3 and s["shares"]["stable"] > 0.05
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and all(r["update_successful"] for r in records)
    assert losses[-1] < 0.9 * losses[0], losses
    # Bytes: warm-up is the exact sync; tiered steps send less (int4 dynamic tier, stable tier
    # only on its update steps), and every tier's traffic is attributed.
    assert s["tiered_bytes_per_step"] < 0.6 * s["warmup_bytes_per_step"], s
    tiered = [r for r in records if r["tiered"]]
    assert all(r["bytes_by_tier"]["dynamic"] > 0 for r in tiered)
    assert all((r["bytes_by_tier"]["stable"] > 0) == r["stable_update"] for r in tiered)
    assert "done: loss" in proc.stdout and "tier map" in proc.stdout


# ------------------------------------------------------------------------------ CPU-mode warnings
def test_cpu_mode_silences_only_the_fallback_warnings():
    """Fresh interpreter: CPU mode, then megatron's GPT model, optimizer and DDP imports. The
    TE/Apex fallback warnings are replaced by one line; an unrelated warning still shows."""
    code = """
import warnings
from megatron_grpo.platform import enable_cpu_mode
assert enable_cpu_mode()
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.distributed import DistributedDataParallel
import megatron.core.optimizer
enable_cpu_mode()                                   # idempotent: no second line
warnings.warn("an unrelated warning")
warnings.warn("Apex is not installed. Falling back to Torch Norm")   # not from megatron.core
"""
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)                  # default warning filters, as a user has
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = proc.stderr
    assert err.count("megatron-grpo CPU mode: ") == 1, err
    assert "local torch fallbacks are in use" in err
    assert "Transformer Engine and Apex are not installed" not in err, err
    assert not [ln for ln in err.splitlines() if "megatron/core" in ln and "not installed" in ln], err
    assert "UserWarning: an unrelated warning" in err
    # The filters are for megatron.core modules only: the same text from elsewhere still shows.
    assert "<string>:11: UserWarning: Apex is not installed. Falling back to Torch Norm" in err
