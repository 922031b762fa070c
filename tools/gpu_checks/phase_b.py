"""Phase b: tensor, stream and collective checks on the device against the CPU, and the FusedAdam
step-count check.

Three worker processes run the checks (``python tools/gpu_check.py --worker GROUP``), one group
each, before any training run shares the device (the stream checks time sleep kernels):

* ``tensors``: tools/gpu_checks/tensor_checks.py (compressors, error feedback, importance, CPU
  mode as a no-op where CUDA exists);
* ``streams``: stream_checks.py (CUDA-event timer, side-stream overlap, release-while-pending);
* ``collectives``: comm_checks.py (NCCL at world size 1: compressed reduce-scatter, parameter
  gather, inter-instance all-reduce, outer sync; async handles; bit-identical to gloo/CPU).

The FusedAdam check trains the phase's small model with the memory tier off and on, with the
Adam megatron builds on a machine with transformer-engine (or apex): the real one when it
imports, else ``torch.optim.AdamW(fused=True)`` and FusedAdamDouble (tools/gpu_checks/fused_adam.py).
With the windowed optimizer step every param group's step counter must equal the number of
applied iterations, and both runs must give the same losses.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Dict, List

from . import comm_checks, specs, stream_checks, tensor_checks
from .common import CheckSkipped, Expect, ROOT, run_command, table
from .runs import TrainRun

GROUPS = {"tensors": tensor_checks.CHECKS, "streams": stream_checks.CHECKS,
          "collectives": comm_checks.CHECKS}
WORKER_CAP_S = {"tensors": 120, "streams": 120, "collectives": 120}


def worker_main(group: str, device: str, result_path: str) -> int:
    """``gpu_check.py --worker GROUP``: run one group's checks in this process; results as JSON."""
    out: Dict[str, Dict] = {}
    for name, fn in GROUPS[group].items():
        ex = Expect()
        print(f"--- {group}/{name} on {device}", flush=True)
        t0 = time.time()
        status, reason = "FAIL", ""
        try:
            fn(ex, device)
            status = ex.status()
        except CheckSkipped as exc:
            status, reason = "SKIP", str(exc)
        except Exception as exc:  # a crash is a FAIL with its traceback in the log
            traceback.print_exc()
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            ex.failures.append(f"{type(exc).__name__}: {first}")
        out[name] = {"status": status, "reason": reason, "failures": ex.failures, "lines": ex.lines,
                     "numbers": ex.numbers, "elapsed_s": time.time() - t0,
                     "summary": reason if status == "SKIP" else ex.summary()}
        with open(result_path, "w") as fh:  # rewritten after each check: a crash keeps the rest
            json.dump(out, fh, default=str)
    return 0


def run_workers(ctx) -> Dict[str, Dict]:
    """Each group in its own process, one after the other; a group that crashed or timed out
    reports FAIL for the checks it did not finish."""
    device = "cpu" if ctx.cpu else "cuda"
    results: Dict[str, Dict] = {}
    for group, checks in GROUPS.items():
        path = os.path.join(ctx.work, f"worker_{group}.json")
        if os.path.exists(path):
            os.remove(path)
        cmd = run_command([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--worker", group,
                           "--device", device, "--result", path],
                          os.path.join(ctx.work, f"worker_{group}.log"), ctx.limit(WORKER_CAP_S[group]),
                          ctx.env())
        got = {}
        if os.path.exists(path):
            with open(path) as fh:
                got = json.load(fh)
        for name in checks:
            if name in got:
                results[f"{group}/{name}"] = got[name]
            else:
                why = (f"timed out after {cmd.limit_s:.0f} s" if cmd.timed_out
                       else f"worker died (rc {cmd.rc}) before it")
                results[f"{group}/{name}"] = {"status": "FAIL", "summary": f"{why}: {cmd.tail(3)}",
                                              "lines": [], "failures": [why], "numbers": {}}
        results[f"{group}/_log"] = {"log": cmd.log, "rc": cmd.rc}
    return results


def optimizer_kinds(ctx) -> List[str]:
    """The FusedAdam megatron would build here: TE's or apex's when importable, else torch's
    fused AdamW and the double (the double alone on the CPU)."""
    if ctx.cpu:
        return ["double"]
    if ctx.facts.get("te"):  # phase a's probe imported it (in a child: TE initialises CUDA)
        return ["te"]
    if ctx.facts.get("apex"):
        return ["apex"]
    return ["torch_fused", "double"]


def runs(ctx) -> List[TrainRun]:
    n = 8 if ctx.cpu else 12
    base = [*specs.model(ctx.cpu, n), *specs.grpo(ctx.cpu)]
    out = []
    for kind in optimizer_kinds(ctx):
        env = specs.DETERMINISTIC_ENV
        out.append(TrainRun(f"b_{kind}", "b", base, optimizer=kind, env=dict(env), cap_s=200))
        out.append(TrainRun(f"b_{kind}_offload", "b", [*base, *specs.OFFLOAD], optimizer=kind,
                            env=dict(env), cap_s=200))
    return out


def analyze_fused_adam(ex: Expect, kind: str, plain: TrainRun, offload: TrainRun) -> List:
    """Assertions on one optimizer's pair of runs; returns its table row."""
    from . import fused_adam

    row = [f"FusedAdam: {kind}", "", ""]
    ok = [ex.that(r.ok, r.describe()) for r in (plain, offload)]
    if not all(ok):
        row[1] = "FAIL"
        return row
    applied = sum(1 for r in plain.records if not r.get("skipped"))
    for run in (plain, offload):
        found = []
        for rank, dump in enumerate(run.opt_dumps):
            for opt in dump["optimizers"]:
                found.append((rank, opt))
        ex.that(bool(found), f"{run.name}: the recorded optimizers' counters were written "
                f"({len(run.opt_dumps)} rank(s), {len(found)} optimizer(s))")
        if kind in fused_adam.GROUP_STEP_KINDS:
            groups = [s for _, o in found for s in o["groups"]]
            ex.that(bool(groups) and all(s == applied for s in groups),
                    f"{run.name}: every param group's step counter = {applied} applied iterations: "
                    f"{sorted(set(groups))}")
        else:
            params = [s for _, o in found for s in o["params"]]
            ex.that(bool(params) and max(params) == applied and all(s <= applied for s in params),
                    f"{run.name}: per-parameter steps at most {applied}, the largest {applied}: "
                    f"{sorted(set(params))[:6]}")
    ex.equal(offload.losses, plain.losses, f"{kind}: losses with the memory tier (--grpo-offload cpu) "
             f"= without it")
    moved = [r.get("offload_bytes_dynamic_cpu", 0) + r.get("offload_bytes_stable_cpu", 0)
             for r in offload.records]
    ex.that(max(moved, default=0) > 0, f"{offload.name}: state did leave the device "
            f"(offload_bytes_dynamic/stable_cpu up to {max(moved, default=0):,} B)")
    row[1] = "PASS"  # analyze() turns it into FAIL when an assertion above failed
    row[2] = f"{applied} steps, loss {plain.losses[0]:.4f} -> {plain.losses[-1]:.4f}"
    return row


def analyze(ex: Expect, ctx, worker_results: Dict[str, Dict], train_runs: List[TrainRun]) -> str:
    rows = []
    for key, res in worker_results.items():
        if key.endswith("/_log"):
            continue
        for line in res.get("lines", []):
            ex.say(line)
        if res["status"] == "SKIP":
            ex.skip_part(f"{key}: {res['summary']}")
        else:
            ex.that(res["status"] == "PASS", f"{key}: {res['status']} {res['summary']}")
        rows.append([key, res["status"], res["summary"][:110]])
    by_name = {r.name: r for r in train_runs}
    for kind in optimizer_kinds(ctx):
        before = len(ex.failures)
        row = analyze_fused_adam(ex, kind, by_name[f"b_{kind}"], by_name[f"b_{kind}_offload"])
        if len(ex.failures) > before:
            row[1] = "FAIL"
        rows.append(row)
    return table(["check", "status", "result"], rows)
