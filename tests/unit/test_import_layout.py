"""The package's imports follow its layout (docs/design.md, "Where things live"): data flows one
way, importance -> tiers -> per-tier policy -> megatron glue / training -> tools, and nothing
imports back up that flow, at module level or inside a function. Each part of the package may
import only the parts ALLOWED lists (a whitelist: a new arrow is a decision, made here).
training/ and megatron/ are linked only by the hooks (megatron_grpo/hooks.py); the launcher
picks them (megatron_grpo.megatron.run_hooks). The package never reaches into tests/ or launch/.
A module's former name kept after a move (megatron_grpo.MOVED) is no part of the layout: it
imports its new module and nothing else."""

import ast
import os

from megatron_grpo import MOVED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = ("platform", "data", "hooks")
ALLOWED = {  # part of the package -> the other parts it may import
    "platform": (), "data": (), "hooks": (),
    # comm/ sits below grpo/: the configuration reads comm's lists (residual dtypes), never the
    # other way round.
    "comm": (),
    "grpo": ("comm",),  # config, importance, tiers, health, replica, outer_schedule, timing
    "offload": ("grpo", "comm"),
    "compute": ("grpo",),  # the sampled backward's estimator, keep ratios and FLOP count
    "grpo.controller": ("grpo", "comm", "offload"),
    "planner": ("grpo", "comm", "offload", "compute"),
    "megatron": BASE + ("grpo", "comm", "offload", "compute", "grpo.controller", "planner"),
    "training.safety": BASE,  # what keeps a run safe: below the run, it imports none of it
    "training": BASE + ("grpo", "comm", "offload", "planner", "training.safety"),
    "convert": BASE + ("grpo", "comm", "planner", "training", "training.safety"),
    # The Megatron-LM runner is a launcher, as launch/pretrain_gpt.py is for the project's own
    # loop: it picks the glue (GRPO's hooks, the construction points) and the training entry's
    # flag and metrics helpers for Megatron-LM's loop.
    "megatron_lm": BASE + ("grpo", "comm", "offload", "megatron", "training"),
    "bench": BASE + ("grpo", "comm", "offload", "compute", "planner", "training", "training.safety"),
}
OUTSIDE = ("tests", "harness", "launch", "tools")  # modules and paths the package never uses


def _imports(path: str, module: str):
    """(imported module, line) of every import in the file, relative ones resolved."""
    tree = ast.parse(open(path).read())
    package = module.split(".")[:-1] if not path.endswith("__init__.py") else module.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                yield ".".join(base + ([node.module] if node.module else [])), node.lineno
            else:
                yield node.module or "", node.lineno
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "spec_from_file_location":
            # A file loaded by path is an import too.
            for arg in ast.walk(node):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in OUTSIDE:
                    yield arg.value, node.lineno


def part_of(module: str) -> str:
    """'megatron_grpo.grpo.controller.core' -> 'grpo.controller'; 'megatron_grpo.comm.wire' -> 'comm'."""
    parts = module.split(".")
    if len(parts) < 2:
        return ""
    if parts[1] == "grpo" and len(parts) > 2 and parts[2] == "controller":
        return "grpo.controller"
    if parts[1] == "training" and len(parts) > 2 and parts[2] == "safety":
        return "training.safety"
    return parts[1]


def violations(root: str, package: str = "megatron_grpo", moved=MOVED):
    out = []
    for dirpath, _, files in os.walk(os.path.join(root, package)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            if module in moved:  # a former name: its new module, and the package's helper
                out += [f"{module}:{line} imports {target} (the former name of {moved[module]} "
                        f"imports only that)" for target, line in _imports(path, module)
                        if target not in (moved[module], package)]
                continue
            part = part_of(module)
            for target, line in _imports(path, module):
                top = target.split(".")
                if top[0] in OUTSIDE:
                    out.append(f"{module}:{line} uses {target}")
                elif top[0] == package and len(top) > 1 and part in ALLOWED:
                    other = part_of(target)
                    if other != part and other not in ALLOWED[part]:
                        out.append(f"{module}:{line} imports {target} ({part} must not import {other})")
    return sorted(out)


def test_every_part_of_the_package_has_a_rule():
    pkg = os.path.join(REPO, "megatron_grpo")
    names = {n[:-3] if n.endswith(".py") else n for n in os.listdir(pkg)
             if not n.startswith(("__", ".")) and (n.endswith(".py") or os.path.isdir(os.path.join(pkg, n)))}
    former = {m.split(".")[1] for m in MOVED if m.count(".") == 1}  # top-level old names
    assert (names - former) | {"grpo.controller", "training.safety"} == set(ALLOWED)


def test_no_import_runs_back_up_the_flow():
    assert violations(REPO) == []


def test_the_check_finds_each_kind_of_arrow(tmp_path):
    pkg = tmp_path / "megatron_grpo"
    for sub in ("training", "training/safety", "megatron", "comm"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "training" / "loop.py").write_text("def f():\n    from megatron_grpo.megatron import grpo_hooks\n")
    (pkg / "megatron" / "glue.py").write_text("from ..training import loop\n")
    (pkg / "training" / "safety" / "guard.py").write_text("from megatron_grpo.training import loop\n")
    (pkg / "comm" / "x.py").write_text(
        "import importlib.util, os\nimport harness\n"
        "spec = importlib.util.spec_from_file_location('p', os.path.join('r', 'launch', 'plan.py'))\n")
    (pkg / "x.py").write_text("import megatron_grpo.comm.x\nfrom megatron_grpo import _moved\n"
                              "from megatron_grpo.training import loop\n")
    found = violations(str(tmp_path), moved={"megatron_grpo.x": "megatron_grpo.comm.x"})
    assert found == [
        "megatron_grpo.comm.x:2 uses harness",
        "megatron_grpo.comm.x:3 uses launch",
        "megatron_grpo.megatron.glue:1 imports megatron_grpo.training (megatron must not import training)",
        "megatron_grpo.training.loop:2 imports megatron_grpo.megatron (training must not import megatron)",
        "megatron_grpo.training.safety.guard:1 imports megatron_grpo.training (training.safety must "
        "not import training)",
        "megatron_grpo.x:3 imports megatron_grpo.training (the former name of megatron_grpo.comm.x "
        "imports only that)",
    ]
