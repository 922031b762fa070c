"""Codec check: what GRPO's codec and its per-step work cost on one GPU, in under 5 minutes.

    bash tools/gpu_check.sh --codec          # on the device (.whl/ carried: megatron-core)
    bash tools/gpu_check.sh --codec --cpu    # the CPU dry run (tests/unit/test_gpu_check_codec.py)
    python tools/gpu_checks/codec.py [--cpu] [--parts versions codec steps] [--out DIR]

Three parts, each under a timeout inside the whole budget (its processes are killed past it):

* ``versions``: phase a of the device check (tools/gpu_checks/phase_a.py): megatron-core
  installed offline from .whl/, the versions and the GPU printed;
* ``codec``: tools/gpu_checks/codec_bench.py in a child process, on a default-sized bucket
  (32 Mi fp32 elements = --grpo-bucket-mb 128, dp 8 rows, chunk 256, int8 residuals), int8 and
  int4, the eager codec and the fused Triton kernels: device time, GB/s, share of a device
  copy's rate, host µs to issue a bucket, launches per bucket, and fused = eager byte for byte
  on the device (a mismatch fails the part);
* ``steps``: a ~150 M bf16 GPT (12 layers, hidden 1024, seq 1024; the ~300 M model of phases e
  and f halved to fit the budget), one rank, 20 iterations each: megatron's baseline, GRPO with
  ``--grpo-compress none`` and with ``--grpo-compress all`` (tiered from iteration 5), one run
  at a time (step times). With one rank nothing goes over a wire (asserted: 0 bytes counted),
  so the differences are GRPO's own per-step work: importance, tiers and, with ``all``, the
  codec on one-row buckets. The link decision's probe does not run: it times a data-parallel
  group of at least 2 ranks (dp 1 here), which the output says.

Output: OUT/codec.json (every figure), OUT/codec.txt (the tables printed at the end) and
OUT/codec.log (every assertion and the tails of the child processes' logs). ``--cpu`` runs the
same parts on the CPU with tiny sizes (bucket 8 Ki elements, the small model, 6 iterations);
there the fused path is the eager codec (fused_codec picks Triton for CUDA tensors only), and
the output says so.

Estimated for an H100 from the sizes (not measured yet): versions ~30 s (the corpus is built
beside it), codec ~50 s (Triton compiles 10 kernel variants; the timed buckets take ~2 s), steps
3 x ~35 s (mostly start-up): about 3 minutes. The budget is 270 s, the shell's hard limit 300 s.
Exit status: 0 no part failed; 1 a part failed; 2 nothing checked (no CUDA device without --cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, os.path.dirname(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpu_checks import phase_a, specs  # noqa: E402
from gpu_checks.common import (EXIT_FAIL, EXIT_NOTHING_CHECKED, EXIT_OK, CheckSkipped, Expect,  # noqa: E402
                               Result, finite, median, run_command, table, tail_lines)
from gpu_checks.phase_c import check_run  # noqa: E402
from gpu_checks.runs import Context, TrainRun, run_pool  # noqa: E402

BUDGET_S, CPU_BUDGET_S = 270.0, 200.0
PARTS = ("versions", "codec", "steps")
CODEC_CAP_S, RUN_CAP_S = 120.0, 80.0
SIZES = {"device": {"numel": 32 * 2**20, "dp": 8, "repeats": 10},
         "cpu": {"numel": 8 * 1024, "dp": 8, "repeats": 2}}
FORMATS = ("int8", "int4")
MODEL = ["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "5", "--log-interval", "5"]
ITERS, WARMUP = {"device": 20, "cpu": 6}, {"device": 4, "cpu": 2}
PROBE_NOTE = ("not run: the link decision's probe times a data-parallel group of at least 2 ranks "
              "(comm/link_decision.py, run by --grpo-compress auto only where the group has "
              "members > 1); one GPU is dp 1, nothing to time")
ONE_RANK_NOTE = ("one rank: nothing is communicated (dp 1 sends nothing), so these step times "
                 "are GRPO's own per-step work (importance, tiers; with 'all' also the codec on "
                 "one-row buckets), not a saving of bytes")


def _where(cpu: bool) -> str:
    return "cpu" if cpu else "device"


# ------------------------------------------------------------------------------- part: codec
def run_codec(ctx: Context, sizes: Dict) -> Dict:
    """codec_bench.py in its own process; its JSON (or what went wrong) back."""
    path = os.path.join(ctx.work, "codec_bench.json")
    if os.path.exists(path):
        os.remove(path)
    cmd = run_command([sys.executable, os.path.join(HERE, "codec_bench.py"), "--device",
                       "cpu" if ctx.cpu else "cuda", "--numel", str(sizes["numel"]), "--dp",
                       str(sizes["dp"]), "--repeats", str(sizes["repeats"]), "--result", path],
                      os.path.join(ctx.work, "codec_bench.log"), ctx.limit(CODEC_CAP_S), ctx.env())
    res: Dict = {}
    if os.path.exists(path):
        with open(path) as fh:
            res = json.load(fh)
    res["_run"] = {"rc": cmd.rc, "timed_out": cmd.timed_out, "elapsed_s": cmd.elapsed_s,
                   "limit_s": cmd.limit_s, "log_tail": tail_lines(cmd.log, 40)}
    return res


SWITCH_NOTE = "MEGATRON_GRPO_FUSED_CODEC must not be 0"
CODEC_HEADERS = ["format", "path", "encode ms", "decode+sum ms", "bucket GB/s", "of copy",
                 "host us/bucket", "launches triton/aten/cuda", "fused = eager"]


def analyze_codec(ex: Expect, res: Dict, cpu: bool) -> str:
    run = res.get("_run", {})
    ex.that(run.get("rc") == 0 and "formats" in res,
            f"codec_bench: rc {run.get('rc')}, {run.get('elapsed_s', 0):.1f} s of {run.get('limit_s', 0):.0f} s"
            + (" (timed out)" if run.get("timed_out") else ""))
    if "formats" not in res:
        return ""
    copy = res["copy"]
    ex.info(f"bucket: {res['numel']} fp32 elements ({res['bucket_bytes'] / 2**20:.3g} MiB), dp {res['dp']}, "
            f"chunk {res['chunk']}; device copy {copy['ms']:.3f} ms = {copy['traffic_gbps']:.0f} GB/s "
            f"(read + write)")
    if cpu:
        ex.info("CPU: the fused path is the eager codec here (fused_codec runs Triton only for CUDA "
                "tensors); its figures are the eager codec's, and fused = eager compares it with itself")
    else:
        ex.that(res["fused_on_this_device"], f"fused kernels selected for CUDA tensors (triton importable: "
                f"{res['triton_importable']}, {SWITCH_NOTE})")
    rows = []
    for fmt in FORMATS:
        if fmt in res["errors"]:
            ex.that(False, f"{fmt}: the measurement crashed: {res['errors'][fmt]}")
        equal = res["equal"].get(fmt)
        differ = [k for k, v in (equal or {}).items() if not v]
        if equal is not None or fmt not in res["errors"]:
            ex.that(bool(equal) and not differ, f"{fmt}: fused = eager on {res['device']}, byte for byte "
                    f"({len(equal or {})} comparisons: payloads, int8 residuals, decoded sums, parameter "
                    f"delta)" + (f"; differ: {', '.join(differ)}" if differ else ""))
        got = res["formats"].get(fmt, {})
        if not got:
            continue
        for path in ("eager", "fused"):
            r = got.get(path)
            if not ex.that(r is not None and all(finite(r[k]) and r[k] > 0 for k in
                                                 ("encode_ms", "decode_sum_ms", "bucket_gbps", "host_us")),
                           f"{fmt} {path}: figures measured"):
                continue
            if path == "fused":
                if cpu:
                    ex.that(r["path"].startswith("eager") and r["triton_launches"] == 0,
                            f"{fmt} fused on the CPU: {r['path']}")
                else:
                    ex.that(r["triton_launches"] == 2, f"{fmt} fused: {r['triton_launches']} Triton launches "
                            f"per bucket (encode with feedback, decode-and-sum) = 2; aten ops {r['aten_ops']}")
            kernels = "-" if r["cuda_kernels"] is None else r["cuda_kernels"]
            aten = "-" if r["aten_ops"] is None else r["aten_ops"]
            label = "fused = eager (CPU)" if cpu and path == "fused" else path
            rows.append([fmt, label, r["encode_ms"], r["decode_sum_ms"], r["bucket_gbps"], r["of_copy"],
                         r["host_us"], f"{r['triton_launches']}/{aten}/{kernels}",
                         "-" if equal is None else "yes" if equal and not differ else "NO"])
        if "fused_speedup" in got and not cpu:
            ex.info(f"{fmt}: eager bucket time / fused bucket time = {got['fused_speedup']:.2f} "
                    f"(reported, not asserted: this check measures)")
            ex.number(f"{fmt}_fused_speedup", got["fused_speedup"])
    rows.append(["copy", "torch copy_", copy["ms"], "-", copy["gbps"], 1.0, "-", "-", "-"])
    return table(CODEC_HEADERS, rows)


# ------------------------------------------------------------------------------- part: steps
def step_runs(ctx: Context) -> List[TrainRun]:
    w = _where(ctx.cpu)
    n = ITERS[w]
    model = [*(specs.SMALL if ctx.cpu else MODEL), "--bf16", "--train-iters", str(n),
             "--eval-interval", str(n), "--eval-iters", "0"]
    # Tiered from iteration WARMUP + 1: a re-tier waits for a stable-tier boundary, so interval 1.
    grpo = ["--grpo", "--grpo-warmup-iters", str(WARMUP[w]), "--grpo-stable-interval", "1",
            *(["--grpo-bucket-mb", "0.04"] if ctx.cpu else [])]
    # The baseline gets GRPO's unit size as its bucket size: the same bucket layout, so the step
    # times differ by GRPO's work, not by how megatron cut the buckets.
    bucket = specs.bucket_elements([*model, *grpo], world_size=1)
    return [TrainRun("codec_base", "codec", [*model, "--ddp-bucket-size", str(bucket)], cap_s=RUN_CAP_S),
            TrainRun("codec_grpo_none", "codec", [*model, *grpo, "--grpo-compress", "none"], cap_s=RUN_CAP_S),
            TrainRun("codec_grpo_all", "codec", [*model, *grpo, "--grpo-compress", "all"], cap_s=RUN_CAP_S)]


def _compression_line(run: TrainRun, work: str) -> str:
    for line in tail_lines(os.path.join(work, f"{run.name}.rank0.log"), 10**6):
        if "[grpo] compression:" in line:
            return line.split("[grpo] compression:", 1)[1].strip()
    return ""


STEP_HEADERS = ["run", "median step ms", "vs baseline", "importance ms", "peak device MiB",
                "compressed formats", "wire bytes"]


def analyze_steps(ex: Expect, runs: List[TrainRun], cpu: bool, work: str, out: Dict) -> str:
    w = _where(cpu)
    steady_from = WARMUP[w] + 3  # the first tiered steps allocate the compressed path's buffers
    ex.info(ONE_RANK_NOTE)
    if cpu:
        ex.info("CPU: the three runs share the cores at once; their step times are no figure")
    ex.info(f"link decision probe: {PROBE_NOTE}")
    rows, base_ms = [], None
    for run in runs:
        ok = check_run(ex, run)
        if ok and not cpu:
            ex.that(run.platform is not None and "cuda" in run.platform, f"{run.name}: platform {run.platform}")
        steady = [r for r in run.records if r["iteration"] >= steady_from]
        step_ms = 1e3 * median([r["step_time_s"] for r in steady]) if steady else float("nan")
        base_ms = step_ms if run.name == "codec_base" else base_ms
        wire = sum(r.get("wire_bytes", 0) for r in run.records)
        peak = max((r.get("step_peak_device_bytes", 0) for r in run.records), default=0)
        fig = {"ok": run.ok, "describe": run.describe(), "platform": run.platform,
               "median_step_ms": step_ms, "steady_iterations": [r["iteration"] for r in steady],
               "wire_bytes": wire, "peak_device_mib": peak / 2**20 if peak else None}
        if ok:
            ex.that(wire == 0, f"{run.name}: {wire} bytes on the wire (one rank sends nothing)")
        if "--grpo" in run.args and ok:
            mode = run.args[run.args.index("--grpo-compress") + 1]
            line = _compression_line(run, work)
            on = sorted(f for f in FORMATS if any(r.get(f"grpo_compress_{f}") == 1.0 for r in steady))
            ex.that(bool(steady) and all(r.get("grpo_tiered") for r in steady),
                    f"{run.name}: tiered on every steady step (iterations {steady_from}-{ITERS[w]})")
            ex.that(on == (sorted(FORMATS) if mode == "all" else []),
                    f"{run.name}: compressed formats {on or 'none'} with --grpo-compress {mode}")
            ex.that(bool(line) and "GB/s" not in line, f"{run.name}: no probe ran ({line!r})")
            fig.update(compress=mode, compressed_formats=on, compression_line=line,
                       importance_ms=1e3 * median([r.get("grpo_importance_time_s") for r in steady]))
        fig["vs_baseline"] = step_ms / base_ms if base_ms and finite(step_ms) else None
        out[run.name] = fig
        rows.append([run.name, step_ms, fig["vs_baseline"], fig.get("importance_ms"), fig["peak_device_mib"],
                     ",".join(fig.get("compressed_formats", [])) or "-", wire])
    for name in ("codec_grpo_none", "codec_grpo_all"):
        if out.get(name, {}).get("vs_baseline") is not None:
            ex.info(f"{name}: step {out[name]['vs_baseline']:.3f}x the baseline's")
            ex.number(f"{name}_vs_baseline", out[name]["vs_baseline"])
    return table(STEP_HEADERS, rows)


# ------------------------------------------------------------------------------- the runner
def run_part(ctx: Context, key: str, body: Callable[[Expect], tuple], log: List[str]) -> Result:
    """``body(ex) -> (table, extra log lines)`` under an Expect; a crash is the part's FAIL."""
    print(f"\n=== {key}", flush=True)
    ex, t0, text, extra = Expect(), time.time(), "", []
    if ctx.remaining() < 10:
        ex.that(False, f"not started: the {ctx.budget_s:.0f} s budget is spent")
    else:
        try:
            text, extra = body(ex)
        except CheckSkipped as exc:
            ex.skip_part(str(exc))
        except Exception as exc:
            extra = [traceback.format_exc()]
            print(extra[0], flush=True)
            ex.that(False, f"{key} crashed: {type(exc).__name__}: {exc}"[:400])
    status = ex.status() if (ex.asserted or not ex.skips) else "SKIP"
    res = Result(key, status, time.time() - t0, ex.summary(), text, ex.lines, ex.numbers)
    print(f"--- {key}: {status} ({res.elapsed_s:.1f} s) {res.summary}", flush=True)
    log += [f"=== {key}: {status}, {res.elapsed_s:.1f} s", *ex.lines, text, *extra, ""]
    return res


def build_corpus(ctx: Context, versions_done: threading.Event) -> None:
    """The training runs' corpus (one CPU core, ~10 s), built beside the versions probe to save
    device time, and finished before the codec part, whose timings a busy host would disturb.
    Its writer imports megatron-core, which on the device comes from the wheels phase a
    installs: it waits for them (ctx.site), or for the versions part to end without them."""
    while not ctx.cpu and ctx.site is None and not versions_done.is_set():
        time.sleep(0.2)
    ctx.ensure_data()


def write_outputs(ctx: Context, doc: Dict, header: str, results: List[Result], log: List[str]) -> tuple:
    """OUT/codec.json, codec.txt and codec.log as they stand (written after every part, so a
    kill at the hard limit leaves the parts done); returns (the text, whether a part failed)."""
    total = time.time() - ctx.started
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    summary = (table(["part", "status", "s", "result"],
                     [[r.phase, r.status, f"{r.elapsed_s:.1f}", r.summary[:200]] for r in results])
               + f"\n{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {total:.1f} s")
    tables = "\n\n".join(f"--- {r.phase}\n{r.table}" for r in results if r.table)
    text = f"{header}\n\n{tables}\n\n{summary}\n"
    doc.update(total_s=total, status="FAIL" if counts["FAIL"] else "PASS",
               parts=[{k: v for k, v in vars(r).items() if k != "table"} for r in results])
    with open(os.path.join(ctx.out, "codec.json"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
    with open(os.path.join(ctx.out, "codec.txt"), "w") as fh:
        fh.write(text)
    with open(os.path.join(ctx.out, "codec.log"), "w") as fh:
        fh.write("\n".join(str(line) for line in log) + "\n")
    return text, counts["FAIL"] > 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--cpu", action="store_true", help="the CPU dry run (tiny sizes, gloo, eager codec)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_out")
    p.add_argument("--work", default=None, help="child logs, metrics (default /tmp/gpu_check_codec[_cpu])")
    p.add_argument("--data-dir", default="/tmp/gpu_check_data", help="where the default corpus is built")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--started-at", type=float, default=None, help="epoch seconds the budget counts from")
    for key in ("numel", "dp", "repeats"):
        p.add_argument(f"--{key}", type=int, default=None, help=f"codec bucket {key} (default: per device)")
    args = p.parse_args(argv)
    from gpu_check import cuda_status  # tools/gpu_check.py: CUDA's state without a context

    os.chdir(ROOT)  # the runs' flags name files relative to the repository
    os.makedirs(args.out, exist_ok=True)
    ok, where = cuda_status()
    header = f"codec check{' --cpu' if args.cpu else ''}: {where}"
    print(header, flush=True)
    if not ok and not args.cpu:
        message = (f"codec check: no CUDA device: {where}. Nothing was checked; run it on a machine with "
                   f"a CUDA GPU, or `bash tools/gpu_check.sh --codec --cpu` for the CPU dry run "
                   f"(exit status {EXIT_NOTHING_CHECKED}).")
        print(message, file=sys.stderr, flush=True)
        with open(os.path.join(args.out, "codec.txt"), "w") as fh:
            fh.write(message + "\n")
        return EXIT_NOTHING_CHECKED
    budget = args.budget_s or (CPU_BUDGET_S if args.cpu else BUDGET_S)
    work = args.work or ("/tmp/gpu_check_codec_cpu" if args.cpu else "/tmp/gpu_check_codec")
    ctx = Context(os.path.abspath(args.out), os.path.abspath(work), os.path.abspath(args.data_dir),
                  args.cpu, budget, args.started_at or time.time(), slots=3 if args.cpu else 1)
    site = os.path.join(ctx.work, "site")
    if not args.cpu and "versions" not in args.parts and os.path.isdir(site):
        ctx.site = site  # a rerun of some parts on the same machine: the wheels stay installed
    sizes = {k: getattr(args, k) or v for k, v in SIZES[_where(args.cpu)].items()}
    doc: Dict = {"check": "codec", "where": where, "cpu": args.cpu, "budget_s": budget,
                 "fused_path": ("eager codec: on the CPU fused_codec runs the eager codec (Triton "
                                "kernels are for CUDA tensors only)") if args.cpu else "Triton kernels",
                 "sizes": sizes, "codec": {}, "steps": {"note": ONE_RANK_NOTE, "runs": {}},
                 "probe": {"ran": False, "why": PROBE_NOTE}, "parts_asked": list(args.parts),
                 "complete": False, "parts": []}
    log: List[str] = [header, ""]
    results: List[Result] = []
    corpus, versions_done = None, threading.Event()
    if "steps" in args.parts:
        corpus = threading.Thread(target=build_corpus, args=(ctx, versions_done), daemon=True)
        corpus.start()
    if "versions" in args.parts:
        results.append(run_part(ctx, "versions", lambda ex: phase_a.run(ex, ctx), log))
        doc["versions"] = dict(ctx.facts)
        write_outputs(ctx, doc, header, results, log)
    versions_done.set()
    if corpus is not None:
        corpus.join(max(1.0, ctx.remaining() - 5))
    if "codec" in args.parts:
        def codec_body(ex):
            doc["codec"] = run_codec(ctx, sizes)
            return analyze_codec(ex, doc["codec"], ctx.cpu), doc["codec"]["_run"]["log_tail"]
        results.append(run_part(ctx, "codec", codec_body, log))
        write_outputs(ctx, doc, header, results, log)
    if "steps" in args.parts:
        def steps_body(ex):
            runs = step_runs(ctx)
            doc["steps"].update(iters=ITERS[_where(ctx.cpu)], warmup=WARMUP[_where(ctx.cpu)],
                                flags={r.name: r.args for r in runs})
            run_pool(ctx, runs)
            return (analyze_steps(ex, runs, ctx.cpu, ctx.work, doc["steps"]["runs"]),
                    [r.log_tail for r in runs])
        results.append(run_part(ctx, "steps", steps_body, log))
    doc["complete"] = True  # the files written after each part before this say False
    text, failed = write_outputs(ctx, doc, header, results, log)
    print("\n" + text, flush=True)
    return EXIT_FAIL if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
