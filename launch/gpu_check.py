"""GPU check with assertions (issue 8 item 5): one CUDA device, under 8 minutes, exit 1 on any FAIL.

    bash launch/gpu_check.sh                  # the usual entry (installs .whl/*.whl if present)
    python launch/gpu_check.py [--out DIR] [--only NAME ...] [--skip NAME ...] [--budget-s 480]
    python launch/gpu_check.py --list         # the checks, one per line: NAME  NUMBER  TITLE

Every check prints PASS or FAIL with its numbers, or SKIP with the reason when a prerequisite is
missing (transformer-engine not importable, no memory tier yet); a SKIP is never a PASS. The
final table is printed and written to OUT/summary.txt (OUT/results.json for machines); logs of
every command are under OUT (default /tmp/gpu_out, or $OUT).

Exit status: 0 when no check failed, 1 when one did, 2 when nothing could be checked (no CUDA
device: torch.cuda.is_available() is False; or bad arguments).

Checks that only need tensors run each in a subprocess of their own (``--worker NAME``), so a
crash or a hung kernel costs that check alone and is cut off by its timeout. The training runs
(torchrun, one process) and the compressor benchmark are subprocesses with timeouts too; each
command's timeout is its own cap or what is left of the budget, whichever is smaller, and a
check that cannot start within the budget is a FAIL, not a SKIP.

This file is the runner (CLI, budget, subprocesses, summary table, results.json); the checks are
in launch/gpu_checks/: tensor_checks.py (the ``--worker`` checks), run_checks.py (training runs,
bench_compress, transformer-engine spec, offload, budget), common.py (what they share).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))  # launch/: holds the gpu_checks package
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if HERE not in sys.path:  # already sys.path[0] when run as a script; not when loaded from a file
    sys.path.append(HERE)

from gpu_checks.common import (BUDGET_S, CHECK_BY_NAME, CHECKS, DP_GOAL, EXIT_FAIL,  # noqa: E402
                               EXIT_NOTHING_CHECKED, EXIT_OK, OFFLOAD_SKIP, STRICT_ENV, Check,
                               CheckSkipped, Command, Expect, Result)
from gpu_checks.run_checks import (HOST, PAIRS, RUNS, Run, TrainingRuns,  # noqa: E402
                                   analyze_grpo_timing, analyze_pair, parse_bench_bucket,
                                   parse_bench_goal)
from gpu_checks.tensor_checks import WORKERS, build_test_controller  # noqa: E402

__all__ = [  # the names tests/unit/test_gpu_check_script.py and callers use from this module
    "BUDGET_S", "CHECK_BY_NAME", "CHECKS", "DP_GOAL", "EXIT_FAIL", "EXIT_NOTHING_CHECKED", "EXIT_OK",
    "OFFLOAD_SKIP", "STRICT_ENV", "Check", "CheckSkipped", "Command", "Expect", "Result", "HOST",
    "PAIRS", "RUNS", "Run", "analyze_grpo_timing", "analyze_pair", "parse_bench_bucket",
    "parse_bench_goal", "WORKERS", "build_test_controller", "Context", "worker_main", "run_worker",
    "run_host", "summary_table", "cuda_status", "list_checks", "main",
]


def worker_main(name: str, result_path: str) -> int:
    """``--worker NAME``: run one tensor check in this process, write its result as JSON."""
    ex = Expect()
    status, reason = "FAIL", ""
    try:
        import torch

        if not torch.cuda.is_available():  # the orchestrator saw one: not a missing prerequisite
            raise RuntimeError("this worker process sees no CUDA device")
        WORKERS[name](ex, "cuda")
        status = ex.status()
    except CheckSkipped as exc:
        status, reason = "SKIP", str(exc)
    except Exception as exc:  # a crash is a FAIL with its traceback in the log
        traceback.print_exc()
        ex.failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    with open(result_path, "w") as fh:
        json.dump({"status": status, "reason": reason, "failures": ex.failures,
                   "lines": ex.lines, "numbers": ex.numbers, "summary": ex.summary()}, fh)
    return 0


# ====================================================================== runner
class Context(TrainingRuns):
    """The budget, the command runner and the state the checks share (run_checks.TrainingRuns)."""

    def __init__(self, args) -> None:
        self.out = os.path.abspath(args.out)
        self.data_dir = os.path.abspath(args.data_dir)
        self.started = args.started_at if args.started_at else time.time()
        self.deadline = self.started + args.budget_s
        self.budget_s = args.budget_s
        self.runs: Dict[str, Run] = {}
        self.data_ready: Optional[bool] = None
        self.data_error = ""
        self.te: Optional[tuple] = None
        self.results: List[Result] = []

    def remaining(self) -> float:
        return self.deadline - time.time()

    def command(self, name: str, argv: List[str], cap_s: float, env: Optional[Dict] = None) -> Command:
        """Run ``argv`` from the repository root with a timeout (its cap, or what is left of the
        budget), stdout and stderr to OUT/name.log; a timeout kills its whole process group."""
        log = os.path.join(self.out, f"{name}.log")
        limit = max(1.0, min(cap_s, self.remaining() - 3.0))
        full_env = dict(os.environ)
        full_env.pop("MEGATRON_GRPO_FORCE_CPU", None)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        full_env.update(env or {})
        t0 = time.time()
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(argv) + "\n")
            fh.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    env=full_env, start_new_session=True)
            try:
                rc: Optional[int] = proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=10)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        return Command(rc, timed_out, time.time() - t0, log, limit)

    def run_worker(self, check: Check) -> Result:
        """Run the tensor check ``check`` in a subprocess (``--worker``) and read its result."""
        path = os.path.join(self.out, f"{check.name}.result.json")
        if os.path.exists(path):
            os.remove(path)
        t0 = time.time()
        cmd = self.command(check.name, [sys.executable, os.path.abspath(__file__), "--worker",
                                       check.name, "--result", path], check.cap_s)
        elapsed = time.time() - t0
        if not os.path.exists(path):
            why = (f"timed out after {cmd.limit_s:.0f} s" if cmd.timed_out
                   else f"worker died (rc {cmd.rc}) without a result")
            return Result(check.name, "FAIL", elapsed, f"{why}; log {cmd.log}: {cmd.tail()}")
        with open(path) as fh:
            data = json.load(fh)
        for line in data["lines"]:
            print(line, flush=True)
        summary = data["reason"] if data["status"] == "SKIP" else data["summary"]
        return Result(check.name, data["status"], elapsed, summary, data["lines"], data["numbers"])


def run_worker(ctx: Context, check: Check) -> Result:
    return ctx.run_worker(check)


def run_host(ctx: Context, check: Check) -> Result:
    ex = Expect()
    t0 = time.time()
    try:
        HOST[check.name](ex, ctx)
        status = ex.status()
        summary = ex.summary()
    except CheckSkipped as exc:
        status, summary = "SKIP", str(exc)
    except Exception as exc:
        traceback.print_exc()
        status, summary = "FAIL", f"{type(exc).__name__}: {exc}"[:500]
    return Result(check.name, status, time.time() - t0, summary, ex.lines, ex.numbers)


def summary_table(results: List[Result], total_s: float) -> str:
    lines = [f"{'#':4} {'check':24} {'status':6} {'time s':>7}  result", "-" * 100]
    for r in results:
        c = CHECK_BY_NAME[r.name]
        lines.append(f"{c.number:4} {r.name:24} {r.status:6} {r.elapsed_s:7.1f}  {r.summary[:300]}")
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines.append("-" * 100)
    lines.append(f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in "
                 f"{total_s:.1f} s")
    return "\n".join(lines)


def cuda_status() -> tuple:
    """(available, description) of this machine's CUDA, without building anything."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not importable ({exc})"
    built = torch.version.cuda
    if not torch.cuda.is_available():
        return False, (f"torch {torch.__version__} (CUDA build: {built or 'none, a CPU-only build'}): "
                       f"torch.cuda.is_available() is False")
    return True, (f"torch {torch.__version__}, CUDA {built}, {torch.cuda.device_count()} device(s), "
                  f"device 0: {torch.cuda.get_device_name(0)}")


def list_checks() -> str:
    return "\n".join(f"{c.name:24} {c.number:4} {c.title}" for c in CHECKS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the checks and exit")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_out",
                   help="logs, metrics and the summary (default $OUT or /tmp/gpu_out)")
    p.add_argument("--data-dir", default="/tmp/gpu_check_data",
                   help="where the default corpus is built (kept out of --out: 24 MB)")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(CHECK_BY_NAME),
                   help="run these checks only (runtime_budget always runs)")
    p.add_argument("--skip", nargs="+", metavar="NAME", choices=list(CHECK_BY_NAME), default=[],
                   help="leave these checks out")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="whole-check budget in seconds")
    p.add_argument("--started-at", type=float, default=None,
                   help="epoch seconds the budget counts from (gpu_check.sh passes its start)")
    p.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.list:
        print(list_checks())
        return EXIT_OK
    if args.worker:
        if not args.result:
            p.error("--worker needs --result")
        return worker_main(args.worker, args.result)

    os.makedirs(args.out, exist_ok=True)
    ok, where = cuda_status()
    header = f"gpu_check: {where}"
    print(header, flush=True)
    if not ok:
        message = (f"gpu_check: no CUDA device: {where}. Nothing was checked; run this on a "
                   f"machine with one CUDA GPU (exit status {EXIT_NOTHING_CHECKED}).")
        print(message, file=sys.stderr, flush=True)
        with open(os.path.join(args.out, "summary.txt"), "w") as fh:
            fh.write(message + "\n")
        return EXIT_NOTHING_CHECKED
    try:
        import megatron.core as mc

        print(f"gpu_check: megatron-core {mc.__version__}", flush=True)
    except ImportError as exc:
        print(f"gpu_check: megatron-core not importable ({exc}); the checks that need it fail",
              flush=True)

    ctx = Context(args)
    selected = [c for c in CHECKS if (not args.only or c.name in args.only or
                                      c.name == "runtime_budget") and c.name not in args.skip]
    for check in selected:
        print(f"\n=== [{check.number}] {check.name}: {check.title}", flush=True)
        if check.name != "runtime_budget" and ctx.remaining() < 10:
            res = Result(check.name, "FAIL", 0.0, f"not started: the {ctx.budget_s:.0f} s budget "
                         f"is spent ({time.time() - ctx.started:.0f} s elapsed)")
        elif check.kind == "worker":
            res = run_worker(ctx, check)
        else:
            res = run_host(ctx, check)
        ctx.results.append(res)
        print(f"--- [{check.number}] {check.name}: {res.status} ({res.elapsed_s:.1f} s) "
              f"{res.summary[:300]}", flush=True)

    total = time.time() - ctx.started
    table = summary_table(ctx.results, total)
    print("\n" + table, flush=True)
    with open(os.path.join(args.out, "summary.txt"), "w") as fh:
        fh.write(header + "\n\n" + table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"where": where, "total_s": total,
                   "results": [vars(r) for r in ctx.results]}, fh, indent=1, default=str)
    return EXIT_FAIL if any(r.status == "FAIL" for r in ctx.results) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
