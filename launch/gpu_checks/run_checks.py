"""The checks of launch/gpu_check.py that run commands: the shared training runs (torchrun, one
process; GRPO with strict comm, bf16 baselines, tiny and ~330M) and their analysis, the
transformer-engine spec check, bench_compress --device cuda with its dp goal, the pinned-offload
and runtime-budget checks; each a function ``(ex: Expect, ctx)`` listed in ``HOST``.

They run in the runner's process and start their commands through ``ctx.command`` (the runner's
timeout and budget handling). ``TrainingRuns`` holds the training-run part of the runner's
``Context``; the analysis (``analyze_grpo_timing``, ``analyze_pair``, the bench parsers) is
plain functions of recorded metrics, testable without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .common import CHECK_BY_NAME, DP_GOAL, OFFLOAD_SKIP, ROOT, STRICT_ENV, Command, Expect, Result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    name: str
    args: List[str]
    grpo: bool
    cap_s: float
    cmd: Optional[Command] = None
    records: List[Dict] = field(default_factory=list)
    spec: Optional[str] = None
    platform: Optional[str] = None

    @property
    def train_iters(self) -> int:
        return int(self.args[self.args.index("--train-iters") + 1])

    @property
    def importance_interval(self) -> int:
        if "--grpo-importance-interval" in self.args:
            return int(self.args[self.args.index("--grpo-importance-interval") + 1])
        return 1  # GRPOConfig.importance_interval

    @property
    def ok(self) -> bool:
        return self.cmd is not None and self.cmd.rc == 0 and len(self.records) == self.train_iters


TINY = ["--config", "launch/configs/tiny.yaml", "--bf16", "--train-iters", "100",
        "--eval-interval", "100", "--eval-iters", "4", "--log-interval", "50"]
# The old script's 24-layer hidden-1024 GPT (~330M parameters with the byte vocabulary).
BIG = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
       "--seq-length", "1024", "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16",
       "--train-iters", "40", "--eval-interval", "40", "--eval-iters", "2", "--log-interval", "20",
       "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "10"]
BIG_GRPO = ["--grpo", "--grpo-bucket-mb", "16", "--grpo-warmup-iters", "10",
            "--grpo-retier-interval", "10", "--grpo-stable-interval", "5"]
RUNS = {
    # importance every 2nd step in the tiny run: the other steps must report 0 (timer reset)
    "tiny_grpo": (TINY + ["--grpo", "--grpo-importance-interval", "2"], True, 150),
    "big_grpo": (BIG + BIG_GRPO, True, 200),
    "tiny_base": (TINY, False, 150),
    "big_base": (BIG, False, 200),
}
PAIRS = (("tiny", "tiny_base", "tiny_grpo"), ("~330M", "big_base", "big_grpo"))


class TrainingRuns:
    """The training runs of RUNS, once per script, shared by the checks that analyse them: the
    part of launch/gpu_check.py's ``Context`` that belongs to these checks. The class that mixes
    it in sets the attributes below and provides ``command``, ``remaining`` and ``run_worker``."""

    out: str
    data_dir: str
    budget_s: float
    started: float
    runs: Dict[str, Run]
    data_ready: Optional[bool]
    data_error: str
    te: Optional[tuple]
    results: List[Result]

    def command(self, name: str, argv: List[str], cap_s: float, env: Optional[Dict] = None) -> Command:
        raise NotImplementedError

    def remaining(self) -> float:
        raise NotImplementedError

    def run_worker(self, check) -> Result:
        raise NotImplementedError

    def ensure_data(self) -> bool:
        if self.data_ready is not None:
            return self.data_ready
        prefix = os.path.join(self.data_dir, "stdlib")
        if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
            self.data_ready = True
            return True
        cmd = self.command("preprocess_data", [sys.executable, "launch/preprocess_data.py",
                                               "--default-corpus", "--output-prefix", prefix], 90)
        self.data_ready = cmd.rc == 0
        if not self.data_ready:
            self.data_error = (f"building the default corpus failed (rc {cmd.rc}"
                               f"{', timed out' if cmd.timed_out else ''}): {cmd.tail(2)}")
        return self.data_ready

    def run(self, name: str) -> Run:
        """The training run ``name`` of RUNS (torchrun, one process), once per script."""
        if name in self.runs:
            return self.runs[name]
        args, grpo, cap = RUNS[name]
        run = Run(name, args, grpo, cap)
        self.runs[name] = run
        if not self.ensure_data():
            return run
        if self.remaining() < 30:
            return run  # cmd stays None: "not started, budget spent"
        metrics = os.path.join(self.out, f"{name}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                "launch/pretrain_gpt.py", "--data-path", os.path.join(self.data_dir, "stdlib"),
                "--metrics-file", metrics, "--run-name", name] + args
        # Strict comm: every tensor GRPO hands to a collective must be on the device (NCCL).
        env = {STRICT_ENV: "1"} if grpo else {}
        run.cmd = self.command(name, argv, cap, env)
        if os.path.exists(metrics):
            with open(metrics) as fh:
                run.records = [json.loads(line) for line in fh if line.strip()]
        with open(run.cmd.log, errors="replace") as fh:
            m = re.search(r"platform=(\S+) spec=(\S+)", fh.read())
        if m:
            run.platform, run.spec = m.group(1), m.group(2)
        print(f"  run {name}: rc {run.cmd.rc}{' (timed out)' if run.cmd.timed_out else ''}, "
              f"{len(run.records)}/{run.train_iters} records, {run.cmd.elapsed_s:.1f} s, "
              f"platform {run.platform}, spec {run.spec}", flush=True)
        return run

    def expect_run(self, ex: Expect, run: Run) -> bool:
        """Assert the run finished; False (with a FAIL) when it did not."""
        if run.cmd is None:
            why = self.data_error or f"not started: {self.budget_s:.0f} s budget spent"
            return ex.that(False, f"{run.name}: {why}")
        ok = run.ok
        ex.that(ok, f"{run.name}: rc {run.cmd.rc}"
                f"{f' (timed out after {run.cmd.limit_s:.0f} s)' if run.cmd.timed_out else ''}, "
                f"{len(run.records)}/{run.train_iters} iterations logged in {run.cmd.elapsed_s:.0f} s"
                + ("" if ok else f"; log {run.cmd.log}: {run.cmd.tail()}"))
        return ok


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else math.nan


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def analyze_grpo_timing(ex: Expect, run: Run) -> None:
    """Metrics of a finished GRPO run on CUDA: device timing, importance, RU."""
    recs = run.records
    interval = run.importance_interval
    ex.that(run.platform is not None and run.platform.startswith("nccl/cuda"),
            f"{run.name}: platform {run.platform} (nccl/cuda expected)")
    timing = sorted({str(r.get("grpo_timing")) for r in recs})
    ex.that(timing == ["cuda_events"], f"{run.name}: grpo_timing {timing} (cuda_events on every step)")
    imp_steps = [r for r in recs if r["iteration"] % interval == 0]
    other = [r for r in recs if r["iteration"] % interval != 0]
    bad = [r["iteration"] for r in imp_steps if not (_finite(r.get("grpo_importance_time_s"))
                                                     and r["grpo_importance_time_s"] > 0)]
    ex.that(imp_steps and not bad, f"{run.name}: grpo_importance_time_s > 0 on all "
            f"{len(imp_steps)} importance steps (interval {interval})"
            + (f"; not on iterations {bad[:8]}" if bad else ""))
    if other:
        nonzero = [r["iteration"] for r in other if r.get("grpo_importance_time_s") != 0]
        ex.that(not nonzero, f"{run.name}: grpo_importance_time_s == 0 on the {len(other)} other "
                f"steps (device timer reset per step)" + (f"; not on {nonzero[:8]}" if nonzero else ""))
    ru = [r.get("grpo_ru") for r in recs]
    bad_ru = [(r["iteration"], r.get("grpo_ru")) for r in recs
              if not (_finite(r.get("grpo_ru")) and 0 < r["grpo_ru"] <= 1)]
    ex.that(not bad_ru, f"{run.name}: 0 < grpo_ru <= 1 on every step (median {_median(ru):.4f}, "
            f"min {min((v for v in ru if _finite(v)), default=math.nan):.4f})"
            + (f"; bad {bad_ru[:5]}" if bad_ru else ""))
    bad_wait = [r["iteration"] for r in recs if not (_finite(r.get("grpo_wait_time_s"))
                                                    and r["grpo_wait_time_s"] >= 0)]
    ex.that(not bad_wait, f"{run.name}: grpo_wait_time_s finite and >= 0 "
            f"(median {1e3 * _median([r.get('grpo_wait_time_s') for r in recs]):.3f} ms)")
    tail = recs[5:] or recs
    share = _median([r["grpo_importance_time_s"] / r["step_time_s"] for r in tail
                     if r["iteration"] % interval == 0 and r.get("step_time_s")])
    imp_ms = 1e3 * _median([r["grpo_importance_time_s"] for r in tail if r["iteration"] % interval == 0])
    ex.headline(f"{run.name}: importance {imp_ms:.3f} ms/step = {100 * share:.2f}% of the step, "
                f"RU {_median(ru):.4f}")
    ex.number(f"{run.name}_importance_share", share)


def analyze_pair(ex: Expect, label: str, base: Run, grpo: Run) -> None:
    """Baseline vs GRPO: both finished, finite and decreasing losses, tiers d and s; figures."""
    for run in (base, grpo):
        losses = [r.get("loss") for r in run.records]
        ex.that(all(_finite(v) for v in losses), f"{run.name}: all {len(losses)} losses finite")
        skipped = [r["iteration"] for r in run.records if r.get("skipped")]
        ex.that(not skipped, f"{run.name}: no skipped (non-finite) steps" +
                (f"; skipped {skipped[:8]}" if skipped else ""))
        first, last = _median(losses[:5]), _median(losses[-5:])
        ex.that(_finite(first) and _finite(last) and last < first,
                f"{run.name}: loss decreases, median of first 5 {first:.4f} -> last 5 {last:.4f}")
        vals = [r["val_loss"] for r in run.records if "val_loss" in r]
        ex.that(bool(vals) and all(_finite(v) for v in vals), f"{run.name}: val_loss {vals[-1:]} finite")
    tier_map = grpo.records[-1].get("grpo_tier_map", "") if grpo.records else ""
    ex.that("d" in tier_map and "s" in tier_map, f"{grpo.name}: final tier map {tier_map!r} has "
            f"dynamic (d) and stable (s) units")
    peaks = {}
    for run in (base, grpo):
        vals = [r.get("peak_device_bytes") for r in run.records]
        ok = bool(vals) and all(isinstance(v, int) and v > 0 for v in vals)
        ex.that(ok, f"{run.name}: peak_device_bytes reported on every step")
        peaks[run.name] = max((v for v in vals if isinstance(v, int)), default=0)
    steps = {run.name: _median([r["step_time_s"] for r in (run.records[5:] or run.records)])
             for run in (base, grpo)}
    pb, pg = peaks[base.name], peaks[grpo.name]
    sb, sg = steps[base.name], steps[grpo.name]
    for run in (base, grpo):
        ex.info(f"{run.name}: loss {run.records[0]['loss']:.3f} -> {run.records[-1]['loss']:.3f}, "
                f"val {run.records[-1].get('val_loss')}, spec {run.spec}")
    line = (f"{label}: peak device memory base {pb / 2**30:.3f} GiB, GRPO {pg / 2**30:.3f} GiB "
            f"(x{pg / pb if pb else math.nan:.3f}); median step base {1e3 * sb:.1f} ms, GRPO "
            f"{1e3 * sg:.1f} ms (x{sg / sb if sb else math.nan:.3f})")
    ex.headline(line)
    ex.number(f"{label}_peak_ratio", pg / pb if pb else None)
    ex.number(f"{label}_step_ratio", sg / sb if sb else None)


def host_grpo_run_timing(ex: Expect, ctx: TrainingRuns) -> None:
    for name in ("tiny_grpo", "big_grpo"):
        run = ctx.run(name)
        if ctx.expect_run(ex, run):
            analyze_grpo_timing(ex, run)


def host_bf16_baseline_vs_grpo(ex: Expect, ctx: TrainingRuns) -> None:
    for label, base_name, grpo_name in PAIRS:
        base, grpo = ctx.run(base_name), ctx.run(grpo_name)
        ok_b, ok_g = ctx.expect_run(ex, base), ctx.expect_run(ex, grpo)
        if ok_b and ok_g:
            analyze_pair(ex, label, base, grpo)


def _probe_te(ctx: TrainingRuns) -> tuple:
    """(importable, detail): transformer_engine imported in a child (it initialises CUDA)."""
    if ctx.te is None and importlib.util.find_spec("transformer_engine") is None:
        ctx.te = (False, "no module named transformer_engine")
    if ctx.te is None:
        cmd = ctx.command("te_probe", [sys.executable, "-c", "import transformer_engine as te; "
                                       "print('transformer_engine', getattr(te, '__version__', '?'))"], 60)
        ctx.te = (cmd.rc == 0, cmd.tail(1))
    return ctx.te


def host_te_spec(ex: Expect, ctx: TrainingRuns) -> None:
    importable, detail = _probe_te(ctx)
    names = [n for _, b, g in PAIRS for n in (b, g)]
    if not importable:
        specs = {n: ctx.runs[n].spec for n in names if n in ctx.runs}
        ex.skip(f"transformer_engine not importable ({detail[-160:]}); the runs used megatron's "
                f"local spec: {specs}")
    ex.info(detail)
    for n in names:
        run = ctx.run(n)
        ex.that(run.spec == "transformer_engine", f"{n}: spec {run.spec} (transformer_engine "
                f"expected: importable here)")
        if run.spec == "transformer_engine":
            ctx.expect_run(ex, run)


def parse_bench_goal(text: str) -> List[tuple]:
    """Rows of bench_compress --dp's goal table: (bucket, compressor, old ratio, batched ratio)."""
    rows, in_table = [], False
    for line in text.splitlines():
        if "goal batched <=" in line:
            in_table = True
            continue
        if not in_table:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1] in ("int4", "int8", "topk"):
            rows.append((int(cells[0].replace(",", "")), cells[1], float(cells[2]), float(cells[3])))
        elif rows and not line.strip():
            in_table = False
    return rows


def parse_bench_bucket(text: str) -> Dict[str, Dict[str, float]]:
    """bench_compress default mode rows: name -> ratio, rel err, compress ms, decompress ms."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[0] in ("int4", "int8", "topk"):
            try:
                vals = [float(p) for p in parts[1:]]
            except ValueError:
                continue
            out[parts[0]] = {"ratio": vals[0], "rel_err": vals[2], "compress_ms": vals[3],
                             "decompress_ms": vals[4]}
    return out


def host_bench_compress(ex: Expect, ctx: TrainingRuns) -> None:
    bench = [sys.executable, "launch/bench_compress.py", "--device", "cuda"]
    cmd = ctx.command("bench_compress_bucket", bench + ["--repeats", "5"], 60)
    text = open(cmd.log, errors="replace").read()
    rows = parse_bench_bucket(text)
    ex.that(cmd.rc == 0 and set(rows) == {"int4", "int8", "topk"},
            f"one 128 MiB bucket: rc {cmd.rc}{' (timed out)' if cmd.timed_out else ''}, "
            f"rows {sorted(rows)}" + ("" if cmd.rc == 0 else f": {cmd.tail()}"))
    for name, r in sorted(rows.items()):
        ex.that(_finite(r["rel_err"]) and r["rel_err"] < 1.0,
                f"{name}: ratio {r['ratio']:.4f}, rel err {r['rel_err']:.4f} (< 1), compress "
                f"{r['compress_ms']:.2f} ms, decompress {r['decompress_ms']:.2f} ms")
    goal = []
    for numel, repeats, cap in (("40000", "10", 60), ("33554432", "3", 120)):
        cmd = ctx.command(f"bench_compress_dp_{numel}", bench + [
            "--dp", "8", "64", "512", "--bucket-numel", numel, "--repeats", repeats], cap)
        found = parse_bench_goal(open(cmd.log, errors="replace").read())
        ex.that(cmd.rc == 0 and len(found) == 3, f"--dp 8 64 512 --bucket-numel {numel}: rc "
                f"{cmd.rc}{' (timed out)' if cmd.timed_out else ''}, {len(found)}/3 goal rows, "
                f"{cmd.elapsed_s:.0f} s" + ("" if cmd.rc == 0 else f": {cmd.tail()}"))
        goal.extend(found)
    for bucket, name, r_old, r_new in goal:
        ex.that(r_new <= DP_GOAL, f"bucket {bucket:,} {name}: batched t(dp=512)/t(dp=8) "
                f"{r_new:.2f} (goal <= {DP_GOAL}; per-shard loop {r_old:.2f})")
        ex.number(f"dp_ratio_{bucket}_{name}", r_new)
    if goal:
        ex.headline("batched t(dp=512)/t(dp=8): " + ", ".join(
            f"{b:,} {n} {r:.2f}" for b, n, _, r in goal))


def host_pinned_offload(ex: Expect, ctx: TrainingRuns) -> None:
    if not os.path.isdir(os.path.join(ROOT, "megatron_grpo", "offload")):
        ex.skip(OFFLOAD_SKIP)
    res = ctx.run_worker(CHECK_BY_NAME["pinned_offload"])
    ex.lines.extend(res.lines)
    if res.status == "SKIP":
        ex.skip(res.summary)
    ex.that(res.status == "PASS", f"offload worker: {res.status} {res.summary}")


def host_runtime_budget(ex: Expect, ctx: TrainingRuns) -> None:
    total = time.time() - ctx.started
    ex.number("total_s", total)
    for r in ctx.results:
        ex.info(f"{r.name}: {r.elapsed_s:.1f} s")
    ex.headline(f"{total:.1f} s in all")
    ex.that(total < ctx.budget_s, f"whole check {total:.1f} s (< {ctx.budget_s:.0f} s, "
            f"including setup since the shell script started)")


HOST: Dict[str, Callable] = {
    "bench_compress": host_bench_compress,
    "grpo_run_timing": host_grpo_run_timing,
    "bf16_baseline_vs_grpo": host_bf16_baseline_vs_grpo,
    "te_spec": host_te_spec,
    "pinned_offload": host_pinned_offload,
    "runtime_budget": host_runtime_budget,
}
