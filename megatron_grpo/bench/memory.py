"""Memory: where each run's memory lives, baseline beside GRPO and GRPO with its memory tier
(the stable tier's optimizer state on SSD between updates), on a ~87 M-parameter model where
state, not the runtime, fills a rank's resident set.

The figure is the peak resident set of the steady window (after warm-up and tiering, when the
memory tier has moved what it moves), per step: the whole-run peak also holds the warm-up's, when
every unit is core and all state is resident. All runs get glibc's mmap threshold fixed at 1 MiB
(``MALLOC_MMAP_THRESHOLD_``): large host allocations are then mapped and unmapped, so memory a
run frees shows as freed; the default dynamic threshold keeps freed blocks in the heap.

Every run saves a checkpoint after iteration ``SAVE_AT`` (and after its last, as any run with
--save does). The loop reads a step's peak before its save, so the save's peak is in the next
iteration's record: that record is the "step after a save" column and stays out of the steady
window. The checkpoints are scratch, deleted when the suite has run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_all
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "mem100m.yaml")
ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
SAVE_AT = 12  # a steady iteration of mem100m.yaml (tiered from 5, stable updates at 8, 12, 16)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def offload_dir(out: str) -> str:
    """The SSD contender's --grpo-offload-dir: beside the suite's runs (made when needed)."""
    path = os.path.join(os.path.abspath(out), "memory", "offload")
    os.makedirs(path, exist_ok=True)
    return path


def checkpoint_root(out: str) -> str:
    """Where the contenders' scratch checkpoints go (one folder each; deleted after the suite)."""
    return os.path.join(os.path.abspath(out), "memory", "ckpt")


def _saving(out: str, name: str, flags):
    return [*flags, "--save", os.path.join(checkpoint_root(out), name),
            "--save-interval", str(SAVE_AT), "--overwrite-checkpoints"]


def contenders(out: str):
    return [dataclasses.replace(c, flags=_saving(out, c.name, c.flags)) for c in _contenders(out)]


def _contenders(out: str):
    cuda = _cuda()
    return [
        Contender("baseline", [], "megatron-core, all state on the training device"),
        Contender("grpo", ["--grpo"], "GRPO defaults (int8 core, int4 dynamic, int8 error-feedback "
                  "residuals), gradient memory per tier unit released after its sync"),
        Contender("grpo-fp32-residuals", ["--grpo", "--grpo-residual-dtype", "fp32"],
                  "GRPO defaults with fp32 error-feedback residuals (four times int8's bytes)"),
        Contender("grpo-whole-buffer", ["--grpo", "--grpo-residual-dtype", "fp32", "--no-grpo-release-grads"],
                  "GRPO with fp32 residuals on megatron's one gradient buffer (the former default)"),
        Contender("grpo-ssd", ["--grpo", "--grpo-offload", "ssd", "--grpo-offload-dir", offload_dir(out)],
                  "GRPO defaults with the memory tier: dynamic state and residuals on SSD, "
                  "streamed through the optimizer step"),
        Contender("megatron-cpu-offload", ["--optimizer-cpu-offload"],
                  "megatron-core optimizer_cpu_offload (HybridDeviceOptimizer)",
                  skip=("--optimizer-cpu-offload is not wired into the training entry yet "
                        "(planned beside the memory tier)") if cuda else
                  ("needs CUDA: megatron's HybridDeviceOptimizer moves optimizer state between "
                   "torch.cuda streams; on a CPU run that state is already in host memory, so "
                   "there is nothing to offload")),
    ]


def run(args, command: str) -> SuiteResult:
    cands = contenders(args.out)
    runnable = [c for c in cands if not c.skip]
    try:
        spec, records, _, _, steady_from, load = run_all("memory", args, DEFAULT_CONFIG, runnable, ENV)
    finally:
        shutil.rmtree(checkpoint_root(args.out), ignore_errors=True)
    # The tiering step itself moves the state out (it starts with all of it resident): the
    # window starts after it, when the memory tier has moved what it moves.
    settled_from = steady_from + 1
    summaries = {n: F.summarize(_without_save(r), settled_from) for n, r in records.items()}
    cmp = {n: F.compare(summaries[n], summaries["baseline"]) for n in summaries}
    res = SuiteResult("memory", "Memory by location: baseline, GRPO and its memory tier", command,
                      ["contender", "steady peak RSS MB", "ratio", "whole-run peak RSS MB",
                       f"peak RSS MB, step after the save at {SAVE_AT}",
                       "steady peak device MB", "gradient peak MB (of whole buffer)",
                       "state away MB", "moved MB/step",
                       "copy time hidden", "steady step time ratio", "val loss"])
    rows = {}
    for c in [c for c in runnable if c.name in records]:  # --contenders runs a subset
        s, k = summaries[c.name], cmp[c.name]
        off = s.get("offload") or {}
        saved = save_step_peak_mb(records[c.name])
        res.rows.append([c.name, F.fmt(s.get("steady_peak_rss_mb"), ".0f"),
                         F.fmt(k["steady_peak_rss_ratio"], ".3f"), f"{s['peak_rss_mb']:.0f}",
                         F.fmt(saved, ".0f") + (f" ({saved / s['steady_peak_rss_mb']:.2f}×)"
                                                if saved and s.get("steady_peak_rss_mb") else ""),
                         F.fmt(s.get("steady_peak_device_mb"), ".0f"),
                         (f"{s['steady_grad_peak_mb']:.0f} ({s['grad_whole_buffer_mb']:.0f})"
                          if s.get("steady_grad_peak_mb") is not None else "whole buffer"),
                         F.fmt(off.get("away_mb"), ".0f"),
                         F.fmt(off.get("moved_mb_per_step"), ".1f"),
                         F.fmt(100 * off["hidden_share"] if off.get("hidden_share") is not None
                               else None, ".1f", " %"),
                         F.fmt(k.get("steady_step_time_ratio"), ".2f"),
                         F.fmt(s["val_loss"], ".4f")])
        loc = {"host RSS (steady peak)": s.get("steady_peak_rss_mb") or s["peak_rss_mb"]}
        if s.get("steady_peak_device_mb") is not None:
            loc["device (steady peak)"] = s["steady_peak_device_mb"]
        if off.get("away_mb"):
            loc["SSD (state away)"] = off["away_mb"]
        rows[c.name] = loc
    for c in cands:
        if c.skip:
            res.rows.append([c.name, *["-"] * (len(res.header) - 1)])
            res.notes.append(f"{c.name} not run: {c.skip}")
    res.notes += _planner_check(spec, records, summaries)
    res.notes.append(f"steady window: iterations after {settled_from} (GRPO's warm-up and its "
                     f"first tiered step, which moves the state out, are left out); "
                     f"all runs with MALLOC_MMAP_THRESHOLD_={ENV['MALLOC_MMAP_THRESHOLD_']} "
                     f"(freed host memory returns to the OS)")
    res.notes.append("copy time hidden: share of the offload copies' busy time the step did not "
                     "wait for (1 - stall / busy)")
    res.notes.append(f"step after the save: iteration {SAVE_AT + 1}'s peak, which holds the "
                     f"checkpoint save after iteration {SAVE_AT} (the loop reads a step's peak "
                     f"before its save), in brackets against the contender's steady peak; that "
                     f"record is left out of the steady window; the whole-run peak holds it")
    res.notes.append(load)
    res.data = {"summaries": summaries, "compare": cmp}
    res.plots["memory by location"] = plots.memory_by_location(
        rows, plot_path(spec, "memory.png"), "peak memory per rank, steady window")
    by_kind = {n: {k.replace("_", " / ", 1): v for k, v in s["steady_device_mb_by_kind"].items() if v}
               for n, s in summaries.items() if s.get("steady_device_mb_by_kind")}
    if by_kind:
        # GRPO's own state on the device, by kind and tier (the baseline reports none).
        res.plots["device state by kind and tier"] = plots.memory_by_location(
            by_kind, plot_path(spec, "memory_by_kind.png"),
            "GRPO state on the device by kind / tier (steady window)")
        for n, kinds in by_kind.items():
            res.notes.append(f"{n}: device MB by kind / tier: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(kinds.items())))
    return res


def _without_save(records):
    """The records less the one that holds the save's peak (the steady figures are a step's)."""
    return [r for r in records if r["iteration"] != SAVE_AT + 1]


def save_step_peak_mb(records):
    """The peak resident set of the step after the save at SAVE_AT, the save included (MB);
    None when the run had no such step (--train-iters below SAVE_AT + 1)."""
    rec = next((r for r in records if r["iteration"] == SAVE_AT + 1), None)
    return rec["step_peak_rss_bytes"] / 2**20 if rec and "step_peak_rss_bytes" in rec else None


def _planner_check(spec, records, summaries) -> list:
    """launch/plan.py's offload figures for this model and the run's own tier map, against what
    the SSD run placed (its per-step offload_bytes_* records) and what its RSS saved."""
    import dataclasses

    from megatron_grpo.planner.plan import plan, stream_window_bytes
    from megatron_grpo.training.memory_budget import spec_from_flags

    ssd = [r for r in records.get("grpo-ssd", []) if "grpo_tier_map" in r and r.get("grpo_tiered")]
    if not ssd:
        return []
    # The byte tokenizer's 258 ids; CPU mode runs megatron's local spec (unfused attention).
    model, cluster, grpo, bucket, offload = spec_from_flags(
        ["--config", spec.config, "--grpo", "--grpo-offload", "ssd", "--grpo-offload-dir", "x"],
        nodes=1, gpus_per_node=spec.nproc, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258,
        attention="unfused")
    last = ssd[-1]
    p = plan(model, cluster, grpo, bucket_size=bucket, tiers=last["grpo_tier_map"], offload=offload)
    m = p.grpo_memory
    # After any step, every streamed unit's optimizer state is away (stable units too: they
    # stream at their updates and stay away between them); residuals are compared apart.
    no_res = plan(model, cluster, grpo, bucket_size=bucket, tiers=last["grpo_tier_map"],
                  offload=dataclasses.replace(offload, residuals=False)).grpo_memory
    predicted_away = no_res.offloaded + stream_window_bytes(p.units, cluster.dp)
    measured_away = last.get("offload_bytes_dynamic_ssd", 0) + last.get("offload_bytes_stable_ssd", 0)
    drop = None
    if summaries.get("grpo", {}).get("steady_peak_rss_mb") and \
            summaries["grpo-ssd"].get("steady_peak_rss_mb"):
        drop = summaries["grpo"]["steady_peak_rss_mb"] - summaries["grpo-ssd"]["steady_peak_rss_mb"]
    mb = 2 ** 20
    lines = [f"planner (launch/plan.py, this run's tier map): optimizer state away after a step "
             f"{predicted_away / mb:.1f} MB predicted, {measured_away / mb:.1f} MB measured "
             f"({100 * (measured_away / predicted_away - 1):+.1f} %)"]
    if drop is not None:
        lines.append(f"planner: {m.offloaded / mb:.1f} MB away at the step's peak predicted; the "
                     f"steady peak RSS fell by {drop:.1f} MB from grpo to grpo-ssd "
                     f"({100 * (drop * mb / m.offloaded - 1):+.1f} %)")
    return lines
