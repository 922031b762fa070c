"""Device check of the GPU path: one CUDA device, about 6 minutes on an H200, six phases.

    bash tools/gpu_check.sh                     # the usual entry (OUT=... for the logs)
    bash tools/gpu_check.sh --cpu               # the CPU dry run (in the default test suite)
    bash tools/gpu_check.sh --fetch-wheels      # fill .whl/ (network; before a device loan)
    python tools/gpu_check.py [--cpu] [--phases a b ...] [--out DIR] [--budget-s 480]
    python tools/gpu_check.py --list

Phases (tools/gpu_checks/phase_<x>.py say what each asserts):
  a  wheels carried in .whl/ installed, versions printed
  b  tensor checks on the device vs the CPU (compressors, error feedback, importance, streams),
     GRPO's collectives over NCCL at world size 1 vs gloo/CPU with async handles, a
     release-while-pending stress test, FusedAdam step counts with the memory tier
  c  tiny bf16 model on 1 rank: GRPO's warm-up = the baseline bit for bit; memory tier on = off
  d  2 ranks on the one device (gloo with CUDA tensors): weight hash after every step, counted
     bytes = the planner's, memory tier on = off, the hierarchical (2-instance) path
  e  ~300M bf16 model, 2 ranks, 20 steps: step time and peak memory vs the baseline, a
     monitoring step
  f  the same model, 1 rank, 20 steps: --grpo-sampled-backward vs the baseline (FLOPs counted,
     forward+backward time, validation loss)

Each phase asserts numbers, prints one table and writes OUT/phase_<x>.log; OUT/summary.txt and
OUT/results.json close the run (8 files: the device machine returns at most 8). Every process
has a timeout inside the whole budget. The runs of b, c and d share the device at once; e and f
run alone. ``--cpu`` runs the same logic on the CPU with gloo and a smaller model: a to d for
real (b's CUDA-only parts skipped), e's and f's analyses on recorded-shape numbers.

Exit status: 0 no phase failed; 1 a phase failed; 2 nothing checked (no CUDA device without
--cpu, or bad arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpu_checks import phase_a, phase_b, phase_c, phase_d, phase_e, phase_f  # noqa: E402
from gpu_checks.common import (BUDGET_S, CPU_BUDGET_S, EXIT_FAIL, EXIT_NOTHING_CHECKED,  # noqa: E402
                               EXIT_OK, PHASES, TITLES, CheckSkipped, Expect, Result, table)
from gpu_checks.runs import Context, run_pool  # noqa: E402


def cuda_status() -> tuple:
    """(available, description) of this machine's CUDA, without creating a context."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none, a CPU-only build"
        return False, f"torch {torch.__version__} (CUDA build: {built}): torch.cuda.is_available() is False"
    return True, f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"


def run_phase(ctx: Context, key: str, body: Callable[[Expect], tuple], spent_s: float = 0.0) -> Result:
    """Run one phase's ``body(ex) -> (table, extra log lines)``; print its table; write its log.
    ``spent_s``: time its processes took before (workers, training runs), counted as its own."""
    print(f"\n=== phase {key}: {TITLES[key]}", flush=True)
    ex, t0 = Expect(), time.time()
    text, extra = "", []
    if ctx.remaining() < 10:
        ex.that(False, f"not started: the {ctx.budget_s:.0f} s budget is spent")
    else:
        try:
            text, extra = body(ex)
        except CheckSkipped as exc:
            ex.skip_part(str(exc))
        except Exception as exc:  # a crash of the phase's own code is its FAIL, with the traceback
            extra = [traceback.format_exc()]
            print(extra[0], flush=True)
            ex.that(False, f"phase {key} crashed: {type(exc).__name__}: {exc}"[:400])
    status = ex.status() if (ex.asserted or not ex.skips) else "SKIP"
    if text:
        print(f"\n--- phase {key} table\n{text}", flush=True)
    res = Result(key, status, time.time() - t0 + spent_s, ex.summary(), text, ex.lines, ex.numbers)
    print(f"--- phase {key}: {status} ({res.elapsed_s:.1f} s) {res.summary}", flush=True)
    with open(os.path.join(ctx.out, f"phase_{key}.log"), "w") as fh:
        fh.write(f"phase {key}: {TITLES[key]}\nstatus {status}, {res.elapsed_s:.1f} s\n\n")
        fh.write("\n".join(ex.lines) + "\n\n" + text + "\n\n" + "\n".join(extra) + "\n")
    return res


def run_all(ctx: Context, phases: List[str]) -> List[Result]:
    results: List[Result] = []
    if "a" in phases:
        results.append(run_phase(ctx, "a", lambda ex: phase_a.run(ex, ctx)))
    workers: Dict[str, Dict] = {}
    workers_s = 0.0
    if "b" in phases:
        print("\n=== phase b workers (alone on the device: the stream checks time kernels)", flush=True)
        t0 = time.time()
        workers = phase_b.run_workers(ctx)
        workers_s = time.time() - t0
    pooled = {"d": phase_d.runs, "c": phase_c.runs, "b": phase_b.runs}
    runs: Dict[str, list] = {k: [] for k in pooled}
    broken: Dict[str, str] = {}  # a phase whose runs could not even be specified fails alone
    for k, make in pooled.items():
        if k in phases:
            try:
                runs[k] = make(ctx)
            except Exception:
                broken[k] = traceback.format_exc()
    pool = [r for k in ("d", "c", "b") for r in runs[k]]
    if pool:
        print(f"\n=== training runs of phases {', '.join(k for k in 'bcd' if runs[k])}: {len(pool)} "
              f"runs, {ctx.slots} rank processes at a time", flush=True)
        run_pool(ctx, pool)

    def with_logs(analysis, key):
        def body(ex):
            if key in broken:
                raise RuntimeError(f"its training runs could not be specified:\n{broken[key]}")
            text = analysis(ex)
            tails = [r.log_tail for r in runs[key]]
            if key == "b":
                tails += [f"---- worker {k[:-5]} rc {v['rc']}\n" + "\n".join(_tail(v["log"], 40))
                          for k, v in workers.items() if k.endswith("/_log")]
            return text, tails
        return body

    def longest(key):  # the pooled runs overlap: a phase took as long as its longest run
        return max((r.elapsed_s for r in runs[key]), default=0.0)

    if "b" in phases:
        results.append(run_phase(ctx, "b", with_logs(lambda ex: phase_b.analyze(ex, ctx, workers, runs["b"]), "b"),
                                 workers_s + longest("b")))
    if "c" in phases:
        results.append(run_phase(ctx, "c", with_logs(lambda ex: phase_c.analyze(ex, ctx, runs["c"]), "c"),
                                 longest("c")))
    if "d" in phases:
        results.append(run_phase(ctx, "d", with_logs(lambda ex: phase_d.analyze(ex, ctx, runs["d"]), "d"),
                                 longest("d")))
    if "e" in phases:
        if ctx.cpu:
            results.append(run_phase(ctx, "e", lambda ex: (phase_e.dry_run(ex), [])))
        else:
            e_runs = phase_e.runs(ctx)
            print("\n=== phase e runs (one at a time: step times)", flush=True)
            run_pool(ctx, e_runs, slots=2)
            runs["e"] = e_runs
            results.append(run_phase(ctx, "e", with_logs(lambda ex: phase_e.analyze(ex, ctx, e_runs), "e"),
                                     sum(r.elapsed_s for r in e_runs)))
    if "f" in phases:
        if ctx.cpu:
            results.append(run_phase(ctx, "f", lambda ex: (phase_f.dry_run(ex), [])))
        else:
            f_runs = phase_f.runs(ctx)
            print("\n=== phase f runs (one at a time: step times)", flush=True)
            run_pool(ctx, f_runs, slots=1)
            runs["f"] = f_runs
            results.append(run_phase(ctx, "f", with_logs(lambda ex: phase_f.analyze(ex, ctx, f_runs), "f"),
                                     sum(r.elapsed_s for r in f_runs)))
    return results


def _tail(path: str, n: int) -> List[str]:
    from gpu_checks.common import tail_lines

    return tail_lines(path, n)


def summary_table(results: List[Result], total_s: float) -> str:
    rows = [[r.phase, TITLES[r.phase][:60], r.status, f"{r.elapsed_s:.1f}", r.summary[:160]] for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    return (table(["phase", "what", "status", "s", "result"], rows)
            + f"\n{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {total_s:.1f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the phases and exit")
    p.add_argument("--cpu", action="store_true", help="the CPU dry run (gloo, a smaller model)")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="phases to run")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_out",
                   help="phase logs, summary.txt, results.json (default $OUT or /tmp/gpu_out)")
    p.add_argument("--work", default=None, help="run logs, metrics, wheels site (default /tmp/gpu_check_work"
                   "[_cpu]; kept out of OUT: the device machine returns 8 files)")
    p.add_argument("--data-dir", default="/tmp/gpu_check_data", help="where the default corpus is built")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"whole-check budget (default {BUDGET_S:.0f}, --cpu {CPU_BUDGET_S:.0f})")
    p.add_argument("--slots", type=int, default=None,
                   help="rank processes of phases b-d at once (default: 8 on a device, 2 on the CPU)")
    p.add_argument("--started-at", type=float, default=None,
                   help="epoch seconds the budget counts from (gpu_check.sh passes its start)")
    p.add_argument("--worker", choices=list(phase_b.GROUPS), help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(f"{k}  {TITLES[k]}" for k in PHASES))
        return EXIT_OK
    if args.worker:
        if not args.result:
            p.error("--worker needs --result")
        return phase_b.worker_main(args.worker, args.device, args.result)

    os.chdir(ROOT)  # the runs' flags name launch/configs/... relative to the repository
    os.makedirs(args.out, exist_ok=True)
    ok, where = cuda_status()
    header = f"gpu_check{' --cpu' if args.cpu else ''}: {where}"
    print(header, flush=True)
    if not ok and not args.cpu:
        message = (f"gpu_check: no CUDA device: {where}. Nothing was checked; run this on a machine "
                   f"with a CUDA GPU, or `bash tools/gpu_check.sh --cpu` for the CPU dry run "
                   f"(exit status {EXIT_NOTHING_CHECKED}).")
        print(message, file=sys.stderr, flush=True)
        with open(os.path.join(args.out, "summary.txt"), "w") as fh:
            fh.write(message + "\n")
        return EXIT_NOTHING_CHECKED
    budget = args.budget_s or (CPU_BUDGET_S if args.cpu else BUDGET_S)
    slots = args.slots or (2 if args.cpu else min(8, max(2, (os.cpu_count() or 4) // 2)))
    work = args.work or ("/tmp/gpu_check_work_cpu" if args.cpu else "/tmp/gpu_check_work")
    ctx = Context(os.path.abspath(args.out), os.path.abspath(work), os.path.abspath(args.data_dir),
                  args.cpu, budget, args.started_at or time.time(), slots)
    site = os.path.join(ctx.work, "site")
    if not args.cpu and "a" not in args.phases and os.path.isdir(site):
        ctx.site = site  # a rerun of some phases on the same machine: phase a's wheels stay
    results = run_all(ctx, [k for k in PHASES if k in args.phases])
    total = time.time() - ctx.started
    text = summary_table(results, total)
    print("\n" + text, flush=True)
    with open(os.path.join(ctx.out, "summary.txt"), "w") as fh:
        fh.write(header + "\n\n" + text + "\n")
    with open(os.path.join(ctx.out, "results.json"), "w") as fh:
        json.dump({"where": where, "cpu": ctx.cpu, "total_s": total, "budget_s": budget,
                   "facts": ctx.facts, "phases": [vars(r) for r in results]}, fh, indent=1, default=str)
    return EXIT_FAIL if any(r.status == "FAIL" for r in results) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
