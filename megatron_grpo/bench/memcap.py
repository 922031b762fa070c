"""Largest model under one fixed memory cap: baseline, GRPO, GRPO with its memory tier.

The whole job -- torchrun's agent and both ranks -- runs in one cgroup v1 memory group whose
limit is the cap (``--cap-gb``, default 4 GB), as a SLURM job under ``ConstrainRAMSpace`` does.
The model is the memory suite's (``mem100m.yaml``: hidden 768, 12 heads, fp32 on CPU) with only
``--num-layers`` changed; a size fits when its run trains all its iterations (GRPO's warm-up, the
tiering step and tiered steps after it) and the kernel killed nothing. For each contender the
search starts at the planner's prediction and walks one layer at a time to the boundary: the
largest size that trains with one layer more killed by the OOM killer. A failure that is not an
OOM kill stops the benchmark (it is never counted as "does not fit").

The planner (``megatron_grpo.planner.capacity``: model state and activations per rank) is
calibrated on the baseline alone, as a user would with one run: the baseline's largest run gives
the per-rank budget (its peak RSS) and the reserve (that peak less the planner's figure). GRPO's
largest sizes are then predicted and held against their measured boundaries. The same
invocation measures the disk with ``dd`` (O_DIRECT, in the offload directory) and sets the
memory tier's own copy rates in training beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional, Tuple

from megatron_grpo.bench import cgroup
from megatron_grpo.bench.runner import (CONFIGS, REPO, BenchError, Contender, Runner, read_records,
                                        training_key)
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "mem100m.yaml")
DEFAULT_CAP_GB = 4.0
ITERS = 8
"""mem100m.yaml: warm-up 4, tiering at 5, a stable update at 8: every kind of step is in."""
ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # freed host memory returns to the OS
START_RESERVE = 0.55e9
"""Per-rank memory outside the model guessed for the search's first size only (the figures
are re-made with the measured value)."""
START_OVERHEAD = 0.3e9
"""The agent's and page cache's share of the cap guessed for the first size only."""
MAX_PROBES = 16
DD_MB = 512


MEGATRON = ("baseline", "megatron-recompute")
"""The contenders that are megatron's own settings; the best of them is what GRPO is held to."""


def offload_dir(out: str) -> str:
    path = os.path.join(os.path.abspath(out), "memcap", "offload")
    os.makedirs(path, exist_ok=True)
    return path


def contenders(out: str) -> List[Contender]:
    # megatron's best contender that runs here: the DistributedOptimizer with full activation
    # recompute (megatron-core's optimizer_cpu_offload needs CUDA streams; Megatron-FSDP is not
    # wired into the launcher). GRPO's memory tier is held against it with the same recompute.
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    ssd = ["--grpo", "--grpo-offload", "ssd", "--grpo-offload-dir", offload_dir(out)]
    return [
        Contender("baseline", [], "megatron-core, every byte of state in host memory"),
        Contender("megatron-recompute", recompute,
                  "megatron-core's DistributedOptimizer with full activation recompute (uniform, "
                  "one layer per chunk): megatron's best setting that runs on CPU"),
        Contender("grpo", ["--grpo"], "GRPO defaults (int8 error-feedback residuals), no memory tier"),
        Contender("grpo-fp32-residuals", ["--grpo", "--grpo-residual-dtype", "fp32"],
                  "GRPO defaults with fp32 error-feedback residuals, no memory tier"),
        Contender("grpo-ssd", ssd,
                  "GRPO defaults with the memory tier: the dynamic and stable tiers' masters, "
                  "Adam moments and error-feedback residuals on SSD, streamed"),
        Contender("grpo-ssd-recompute", ssd + recompute,
                  "grpo-ssd with megatron-recompute's full activation recompute"),
    ]


@dataclasses.dataclass
class Probe:
    """One run at one size under the cap."""

    layers: int
    ok: bool
    """Trained every iteration, nothing killed."""
    oom_kills: int
    returncode: int
    job_peak_bytes: int
    """The cgroup's peak charge: agent, ranks and page cache."""
    rank_peak_bytes: Optional[int] = None
    """Rank 0's whole-run peak RSS (records), when it logged any."""
    before_model_bytes: Optional[int] = None
    seconds: float = 0.0
    offload_gbps: Dict[str, float] = dataclasses.field(default_factory=dict)
    """Median per-copy write and read rates of the memory tier over its tiered steps."""


def find_largest(fits: Callable[[int], bool], start: int, max_probes: int = MAX_PROBES) -> int:
    """The largest n >= 1 with fits(n), walking one step at a time from ``start`` to the
    boundary (fits(n) and not fits(n + 1)); 0 when fits(1) is false. Each size is tried once."""
    if start < 1:
        raise ValueError(f"start must be >= 1, got {start}")
    seen: Dict[int, bool] = {}
    n = start
    while len(seen) < max_probes:
        seen[n] = fits(n)
        if seen[n]:
            if seen.get(n + 1) is False:
                return n
            n += 1
        else:
            if seen.get(n - 1) is True:
                return n - 1
            if n == 1:
                return 0
            n -= 1
    raise BenchError(f"bench memcap: no boundary within {max_probes} sizes from {start} layers "
                     f"(tried {sorted(seen.items())}); the planner's start is far off, see the "
                     f"probes' logs")


def parse_dd(stderr: str) -> Tuple[int, float]:
    """(bytes, seconds) from GNU dd's summary line ('N bytes (...) copied, S s, R MB/s')."""
    m = re.search(r"^(\d+) bytes .*copied, ([0-9.]+) s", stderr, re.M)
    if not m:
        raise BenchError(f"bench memcap: cannot read dd's summary from: {stderr.strip()[-300:]}")
    return int(m.group(1)), float(m.group(2))


def disk_rates(directory: str, mb: int = DD_MB) -> Dict[str, float]:
    """dd's sequential O_DIRECT write (with fsync) and read rates in ``directory``, GB/s."""
    path = os.path.join(directory, "dd-probe.bin")
    try:
        out = {}
        for name, argv in (("write", ["dd", "if=/dev/zero", f"of={path}", "bs=4M",
                                      f"count={mb // 4}", "oflag=direct", "conv=fsync"]),
                           ("read", ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"])):
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode:
                raise BenchError(f"bench memcap: {' '.join(argv)} failed: {proc.stderr.strip()}")
            nbytes, seconds = parse_dd(proc.stderr)
            out[name] = nbytes / seconds / 1e9
        return out
    finally:
        if os.path.exists(path):
            os.remove(path)


def _disk(spec) -> Dict[str, float]:
    """dd's rates, measured once beside the runs they are compared with: kept in the suite's
    directory while its runs are reused (a re-render shows the figure taken with them)."""
    path = os.path.join(spec.out, "disk.json")
    if spec.reuse and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    os.makedirs(spec.out, exist_ok=True)
    rates = disk_rates(offload_dir(os.path.dirname(spec.out)))
    with open(path + ".tmp", "w") as fh:
        json.dump(rates, fh)
    os.replace(path + ".tmp", path)
    return rates


class Prober:
    """Runs one contender at a size inside the capped cgroup; results are kept as JSON beside
    the runs and reused while command, code and cap are unchanged."""

    def __init__(self, runner: Runner, cap_bytes: int, reuse: bool) -> None:
        self.runner, self.cap, self.reuse = runner, cap_bytes, reuse

    def __call__(self, contender: Contender, layers: int) -> Probe:
        name = f"{contender.name}-L{layers}"
        cmd = self.runner.command(name, contender, ["--num-layers", str(layers)])
        out = self.runner.spec.out
        result_file, log = os.path.join(out, f"{name}.probe.json"), os.path.join(out, f"{name}.log")
        key = {"training": training_key(cmd), "cap": self.cap}
        if self.reuse and os.path.exists(result_file):
            with open(result_file) as fh:
                saved = json.load(fh)
            if saved.get("key") == key:
                print(f"[bench memcap] {name}: reusing {result_file}", flush=True)
                return Probe(**saved["probe"])
        metrics = os.path.join(out, f"{name}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        argv, env = self.runner.argv(cmd), self.runner.run_env()
        print(f"[bench memcap] {name}: training under a {self.cap / 1e9:g} GB cap (log {log})",
              flush=True)
        t0 = time.perf_counter()
        with cgroup.MemoryCgroup(f"megatron-grpo-memcap-{os.getpid()}", self.cap) as group, \
                open(log, "w") as fh:
            proc = subprocess.run(group.command(argv), cwd=REPO, env=env, stdout=fh,
                                  stderr=subprocess.STDOUT, timeout=self.runner.spec.timeout_s)
            kills, peak = group.oom_kills(), group.max_usage_bytes()
        # A killed rank cannot delete its offload file (the store does on close): remove it, so
        # the suite leaves nothing behind.
        for arg in (a for i, a in enumerate(argv[1:]) if argv[i] == "--grpo-offload-dir"):
            for name_ in os.listdir(arg) if os.path.isdir(arg) else ():
                if name_.startswith("grpo-offload-rank"):
                    os.remove(os.path.join(arg, name_))
        records = read_records(metrics) if os.path.exists(metrics) else []
        complete = bool(records) and records[-1]["iteration"] == ITERS
        probe = Probe(layers, proc.returncode == 0 and complete and kills == 0, kills,
                      proc.returncode, peak, seconds=time.perf_counter() - t0)
        if records:
            probe.rank_peak_bytes = max(r["peak_rss_bytes"] for r in records)
            probe.before_model_bytes = records[0].get("memory_before_model_bytes")
            tiered = [r for r in records if r.get("grpo_tiered")]
            for d in ("write", "read"):
                rates = [r[f"offload_{d}_gbps"] for r in tiered if f"offload_{d}_gbps" in r]
                if rates:
                    probe.offload_gbps[d] = statistics.median(rates)
        if not probe.ok and kills == 0:
            raise BenchError(f"bench memcap: {name} failed (exit {proc.returncode}) without an OOM "
                             f"kill: not a memory limit. See {log}")
        print(f"[bench memcap] {name}: {'fits' if probe.ok else 'OOM-killed'} (group peak "
              f"{peak / 1e9:.2f} GB, {probe.seconds:.0f} s)", flush=True)
        with open(result_file + ".tmp", "w") as fh:
            json.dump({"key": key, "probe": dataclasses.asdict(probe)}, fh)
        os.replace(result_file + ".tmp", result_file)
        return probe


def _plan_largest(spec, contender: Contender, budget_per_rank: float, reserve: float):
    """The planner's largest layer count for this contender, the run's flags as given."""
    from megatron_grpo.planner.capacity import largest_model

    model, cluster, grpo, bucket, offload = _flags_spec(spec, contender)
    which = "baseline" if contender.name == "baseline" else "grpo"
    return largest_model(model, cluster, grpo, int(budget_per_rank), which,
                         reserve_bytes=int(reserve), bucket_size=bucket, offload=offload)


def run(args, command: str) -> SuiteResult:
    title = ("Largest model under a memory cap: megatron (baseline, full recompute), GRPO, GRPO "
             "with its memory tier")
    header = ["contender", "largest layers", "parameters M", "vs baseline",
              "vs megatron's best", "planner layers",
              "planner parameters M", "planner vs measured", "rank-0 peak RSS at largest MB",
              "sizes tried"]
    why = cgroup.unavailable()
    if why:
        return SuiteResult("memcap", title, command, header, skipped=why)
    cap = int(float(getattr(args, "cap_gb", None) or DEFAULT_CAP_GB) * 1e9)
    spec = args.spec(DEFAULT_CONFIG, "memcap")
    spec.common += ["--train-iters", str(ITERS), "--eval-iters", "1"]
    spec.env = dict(ENV)
    cands = contenders(args.out)
    runner = Runner("memcap", spec, 0)
    prober = Prober(runner, cap, spec.reuse)
    disk = _disk(spec)
    found: Dict[str, Tuple[int, Dict[int, Probe]]] = {}
    for c in cands:
        probes: Dict[int, Probe] = {}

        def fits(n: int) -> bool:
            probes[n] = prober(c, n)
            return probes[n].ok

        if c is cands[0]:
            start = _plan_largest(spec, c, (cap - START_OVERHEAD) / spec.nproc, START_RESERVE).layers
        else:  # from the planner calibrated on the baseline's boundary (below)
            start = _plan_largest(spec, c, *_calibrate(spec, cands[0], *found[cands[0].name])).layers
        largest = find_largest(fits, max(1, start))
        found[c.name] = (largest, probes)
    # The planner, calibrated on the baseline alone as a user would (one run of the baseline
    # under the cap): what its largest size held beyond the planner's model state and
    # activations is the reserve, its peak RSS the per-rank budget. GRPO's two sizes are then
    # predictions, held against their own measured boundaries.
    base_largest, base_probes = found["baseline"]
    calibration = base_probes[base_largest]
    budget, reserve = _calibrate(spec, cands[0], base_largest, base_probes)
    res = SuiteResult("memcap", title, command, header)
    base_params = _params(spec, cands[0], base_largest)
    # megatron's best here is the larger of its two rows (baseline, full recompute).
    best_megatron = max(_params(spec, c, found[c.name][0]) for c in cands
                        if c.name in MEGATRON)
    data = {"cap_bytes": cap, "budget_bytes": budget, "reserve_bytes": reserve, "disk": disk,
            "contenders": {}}
    for c in cands:
        largest, probes = found[c.name]
        planned = _plan_largest(spec, c, budget, reserve)
        params = _params(spec, c, largest)
        best = probes.get(largest)
        tried = ", ".join(f"{n}{'' if p.ok else ' OOM'}" for n, p in sorted(probes.items()))
        peak = best.rank_peak_bytes if best is not None else None
        res.rows.append([c.name, str(largest), f"{params / 1e6:.1f}",
                         f"{params / base_params:.2f}x" if base_params else "-",
                         f"{params / best_megatron:.2f}x" if best_megatron else "-",
                         str(planned.layers) + (" (calibration)" if c is cands[0] else ""),
                         f"{planned.params / 1e6:.1f}",
                         f"{100 * (planned.params / params - 1):+.1f} %" if params else "-",
                         f"{peak / 1e6:.0f}" if peak else "-", tried])
        if peak and c is not cands[0]:
            predicted = _model_peak(spec, c, largest, reserve)
            res.notes.append(f"{c.name} at {largest} layers: planner peak per rank "
                             f"{predicted / 1e6:.0f} MB, measured rank-0 peak RSS {peak / 1e6:.0f} MB "
                             f"({100 * (predicted / peak - 1):+.1f} %)")
        data["contenders"][c.name] = {"largest_layers": largest, "params": params,
                                      "vs_megatron_best": params / best_megatron
                                      if best_megatron else None,
                                      "planner": dataclasses.asdict(planned),
                                      "probes": {n: dataclasses.asdict(p) for n, p in probes.items()}}
    res.notes += [f"{c.name}: {c.about}" for c in cands]
    res.notes.append(f"cap {cap / 1e9:g} GB on the whole job (torchrun agent + {spec.nproc} gloo "
                     f"ranks) as a cgroup v1 memory.limit_in_bytes; config "
                     f"{os.path.basename(spec.config)} with --num-layers varied, {ITERS} "
                     f"iterations each; a size fits when it trains every iteration and nothing is "
                     f"OOM-killed")
    res.notes.append(f"planner (megatron_grpo/planner/capacity.py), calibrated on the baseline's "
                     f"largest run alone: per-rank budget = its rank-0 peak RSS "
                     f"({budget / 1e6:.0f} MB), reserve = that peak less the planner's model state "
                     f"and activations ({reserve / 1e6:.0f} MB: runtime, shared libraries, "
                     f"transient working memory; {calibration.before_model_bytes / 1e6:.0f} MB of "
                     f"it held before the model); GRPO's rows are predictions from it")
    ssd = found.get("grpo-ssd")
    if ssd and ssd[1].get(ssd[0]) and ssd[1][ssd[0]].offload_gbps:
        rates = ssd[1][ssd[0]].offload_gbps
        res.notes.append("SSD: " + "; ".join(
            f"{d} {rates[d]:.2f} GB/s per copy in training vs dd {disk[d]:.2f} GB/s "
            f"({100 * rates[d] / disk[d]:.0f} %)" for d in ("write", "read") if d in rates)
            + f" (dd: {DD_MB} MiB, bs=4M, O_DIRECT, in the offload directory, before the runs; "
              f"training: median over grpo-ssd's tiered steps at its largest size, bytes over "
              f"each copy's busy time incl. its checksum; the store runs 2 copies at once, so "
              f"its aggregate rate can be up to twice the per-copy one)")
    res.data = data
    return res


def _flags_spec(spec, contender: Contender, layers: Optional[int] = None):
    """The planner's (model, cluster, grpo, bucket, offload) for this contender's runs."""
    from megatron_grpo.training.memory_budget import spec_from_flags

    extra = ["--num-layers", str(layers)] if layers else []
    return spec_from_flags(
        ["--config", spec.config, *spec.common, *contender.flags, *extra], nodes=1,
        gpus_per_node=spec.nproc, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258,
        attention="unfused")  # the byte tokenizer's 258 ids; CPU mode runs the local spec


def _calibrate(spec, baseline: Contender, largest: int, probes: Dict[int, Probe]) -> Tuple[int, int]:
    """(per-rank budget, reserve) from the baseline's largest run: its rank-0 peak RSS, and that
    peak less the planner's model state and activations at that size."""
    best = probes.get(largest)
    if best is None or not best.rank_peak_bytes:
        raise BenchError("bench memcap: the baseline trained at no size under the cap; raise --cap-gb")
    return best.rank_peak_bytes, best.rank_peak_bytes - _model_peak(spec, baseline, largest, 0)


def _model_peak(spec, contender: Contender, layers: int, reserve: int) -> int:
    """The planner's peak per rank at ``layers`` for this contender, plus ``reserve``."""
    from megatron_grpo.planner.capacity import rank_peak_bytes

    model, cluster, grpo, bucket, offload = _flags_spec(spec, contender, layers)
    return rank_peak_bytes(model, cluster, grpo, "baseline" if contender.name in MEGATRON
                           else "grpo", reserve, bucket, offload)


def _params(spec, contender: Contender, layers: int) -> int:
    """Parameters of the model at ``layers`` (the planner's count, equal to megatron's)."""
    if layers <= 0:
        return 0
    from megatron_grpo.planner.capacity import model_params

    model, cluster, *_ = _flags_spec(spec, contender, layers)
    return model_params(model, cluster)
