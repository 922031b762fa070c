"""Phase a: install the wheels the check carries, print the versions it runs with.

The device image has torch (CUDA build) and transformers but no megatron-core, no
transformer-engine and no apex. What the check needs beyond the image travels as wheels in
.whl/ (git-ignored; filled on a machine with network access by
``bash tools/gpu_check.sh --fetch-wheels``: megatron-core 0.16.1 for CPython 3.10-3.13 and
0.19.2, the newest supported release, for CPython 3.12-3.13 (it needs Python >= 3.12), plus
einops and psutil, which megatron-core uses without declaring them). The version installed is
0.16.1, or the one ``--megatron VERSION`` names (``GPU_CHECK_MEGATRON``). They are installed with
pip, offline (``--no-index --find-links .whl``), into a folder put first on PYTHONPATH for
every process the check starts; pip picks the wheel matching the image's Python.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from .common import ROOT, Expect, run_command, table

WHEEL_DIR = os.path.join(ROOT, ".whl")
# The megatron-core the check runs on: tools/gpu_check.sh --megatron VERSION sets it.
MEGATRON_CORE = os.environ.get("GPU_CHECK_MEGATRON") or "0.16.1"
# Installed from .whl/ when the image cannot import them (megatron-core: always, pinned).
OPTIONAL_WHEELS = ("einops", "psutil")

VERSIONS_SCRIPT = r"""
import json, sys, traceback
out = {"python": sys.version.split()[0]}
def probe(key, fn):
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = None
        out[key + "_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
import torch
out["torch"] = torch.__version__
out["cuda_build"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
out["devices"] = torch.cuda.device_count() if out["cuda_available"] else 0
if out["devices"]:
    out["gpu"] = torch.cuda.get_device_name(0)
    out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    probe("nccl", lambda: ".".join(map(str, torch.cuda.nccl.version())))
def mcore():
    import megatron.core as mc
    return mc.__version__ + " (" + mc.__file__.rsplit("/megatron/", 1)[0] + ")"
probe("megatron_core", mcore)
def te():
    import transformer_engine as te
    return getattr(te, "__version__", "?")
probe("transformer_engine", te)
def apex():
    import apex.optimizers  # noqa: F401  (the PyPI package named apex is unrelated)
    return "importable"
probe("apex", apex)
def transformers():
    import transformers
    return transformers.__version__
probe("transformers", transformers)
def grpo():
    import megatron_grpo.training.loop  # noqa: F401  (imports megatron-core)
    return "importable"
probe("megatron_grpo", grpo)
print("VERSIONS " + json.dumps(out))
"""


def install_wheels(ex: Expect, ctx, log_lines) -> None:
    wheels = sorted(glob.glob(os.path.join(WHEEL_DIR, "*.whl")))
    if os.environ.get("GPU_CHECK_NO_WHEELS"):
        ex.info("GPU_CHECK_NO_WHEELS is set: .whl/ not installed")
        return
    if not wheels:
        ex.info(f"no wheels in {WHEEL_DIR} (fill it with `bash tools/gpu_check.sh --fetch-wheels`); "
                f"using what the image has")
        return
    site = os.path.join(ctx.work, "site")
    os.makedirs(site, exist_ok=True)
    wanted = [f"megatron-core=={MEGATRON_CORE}"]
    for name in OPTIONAL_WHEELS:
        have = run_command([sys.executable, "-c", f"import {name}"], os.path.join(ctx.work, f"probe_{name}.log"),
                           ctx.limit(30), ctx.env())
        if have.rc != 0 and any(os.path.basename(w).lower().startswith(name) for w in wheels):
            wanted.append(name)
    cmd = run_command([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
                       WHEEL_DIR, "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                       "--target", site, *wanted], os.path.join(ctx.work, "pip.log"), ctx.limit(120), ctx.env())
    ok = ex.that(cmd.rc == 0, f"pip install (offline, from .whl/) {' '.join(wanted)} into {site}: rc {cmd.rc}"
                 + ("" if cmd.rc == 0 else f": {cmd.tail(4)}"))
    log_lines.append(f"wheels in .whl/: {', '.join(os.path.basename(w) for w in wheels)}")
    if ok:
        ctx.site = site
        if site not in sys.path:
            sys.path.insert(0, site)  # for the planner calls this process makes (phases d, e)


def run(ex: Expect, ctx) -> tuple:
    """Returns (table text, log lines)."""
    log_lines = []
    if ctx.cpu:
        ex.info("--cpu: the wheels are not installed (the environment running the dry run has "
                "megatron-core)")
    else:
        install_wheels(ex, ctx, log_lines)
    cmd = run_command([sys.executable, "-c", VERSIONS_SCRIPT], os.path.join(ctx.work, "versions.log"),
                      ctx.limit(120), ctx.env())
    found = {}
    with open(cmd.log, errors="replace") as fh:
        for line in fh:
            if line.startswith("VERSIONS "):
                found = json.loads(line[len("VERSIONS "):])
    log_lines.extend(l.rstrip() for l in open(cmd.log, errors="replace") if not l.startswith("VERSIONS "))
    ex.that(cmd.rc == 0 and bool(found), f"versions probe: rc {cmd.rc}" + ("" if found else f": {cmd.tail(4)}"))
    if not found:
        return "", log_lines
    mc = found.get("megatron_core") or ""
    ex.that(mc.startswith(MEGATRON_CORE + " "), f"megatron-core {MEGATRON_CORE}: {mc or found.get('megatron_core_error')}")
    ex.that(found.get("megatron_grpo") == "importable",
            f"megatron_grpo.training.loop imports: {found.get('megatron_grpo') or found.get('megatron_grpo_error')}")
    if not ctx.cpu:
        ex.that(found.get("cuda_available") and found.get("devices", 0) >= 1,
                f"CUDA: available {found.get('cuda_available')}, {found.get('devices')} device(s), "
                f"device 0 {found.get('gpu')}")
    ctx.facts.update(found)
    ctx.facts["te"] = found.get("transformer_engine") is not None
    ctx.facts["apex"] = found.get("apex") is not None
    rows = [("python", found.get("python")), ("torch", found.get("torch")),
            ("CUDA (build)", found.get("cuda_build")), ("NCCL", found.get("nccl")),
            ("GPU", f"{found.get('gpu')} (sm {found.get('capability')}, {found.get('gpu_memory_gib')} GiB)"
             if found.get("gpu") else "none"),
            ("megatron-core", mc or found.get("megatron_core_error")),
            ("transformer-engine", found.get("transformer_engine") or found.get("transformer_engine_error")),
            ("apex", found.get("apex") or found.get("apex_error")),
            ("transformers", found.get("transformers") or found.get("transformers_error")),
            ("wheels site", ctx.site or "-")]
    for key, value in rows:
        ex.number(key, value)
    return table(["component", "version"], rows), log_lines
