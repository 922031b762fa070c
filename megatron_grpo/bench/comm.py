"""Communication: the megatron baseline beside GRPO with each dynamic-tier compressor and beside
"everything int4" (one compressed tier, no ranking), on the tiny model, one run each.

Bytes are the counted per-rank volume of every torch.distributed call of a step; "after
warm-up" = the iterations after GRPO's exact warm-up, the same iterations for every run.

These runs are fp32 (CPU). Beside the counted bytes stand "GPU-shaped" ones: what each
contender sends per step with bf16 parameters (what users run on GPUs), from the planner on the
same model shape and each GRPO run's own tier maps. There megatron's best setting is not the
baseline's fp32 reduce-scatter (grad_reduce_in_fp32) + bf16 all-gather but its
``reduce_scatter_with_fp32_accumulation`` (bf16 gradients on the wire, fp32 local sum), the
``megatron-bf16-rs`` row: it needs bf16 gradient buffers, so it cannot run on this fp32 CPU
setup, and its bytes are analytic (``comm/analytic.py``); GRPO's GPU-shaped ratio is taken
against it.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_all
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")
ALL_DYNAMIC = ["--grpo-core-share", "0", "--grpo-dynamic-share", "1", "--grpo-stable-share", "0",
               "--grpo-max-dynamic-share", "1"]
# GRPO's settings before the quality front moved the defaults: three tiers 15/65/20 and an exact
# core. The suites whose documented figures were measured with them name them (with the stable
# mode of the time), so their commands retrain the same runs.
THREE_TIERS = ["--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.65", "--grpo-stable-share", "0.2",
               "--grpo-max-dynamic-share", "0.7", "--grpo-core-compressor", "none"]
FORMER_FROZEN = [*THREE_TIERS, "--grpo-stable-mode", "frozen"]

CONTENDERS = [
    Contender("baseline", [], "megatron-core DDP + distributed optimizer, overlapped, exact fp32"),
    Contender("grpo-int4", ["--grpo", *FORMER_FROZEN],
              "GRPO, former defaults: 15/65/20 tiers, exact core, int4 dynamic tier, frozen stable"),
    Contender("grpo-int8", ["--grpo", *FORMER_FROZEN, "--grpo-compressor", "int8"], "GRPO, int8 dynamic tier"),
    Contender("grpo-topk", ["--grpo", *FORMER_FROZEN, "--grpo-compressor", "topk"],
              "GRPO, top-k 5 % dynamic tier (error feedback)"),
    Contender("grpo-powersgd", ["--grpo", *FORMER_FROZEN, "--grpo-compressor", "powersgd"],
              "GRPO, PowerSGD rank-4 dynamic tier (error feedback)"),
    Contender("all-int4", ["--grpo", *ALL_DYNAMIC],
              "no tiers: every unit int4 with error feedback (pinned units stay exact)"),
]


BF16_RS = Contender("megatron-bf16-rs", [],
                    "megatron-core reduce_scatter_with_fp32_accumulation: each bucket's bf16 "
                    "gradients through one all-to-all, summed locally in fp32 (needs bf16 gradient "
                    "buffers: bf16 parameters, grad_reduce_in_fp32=False); analytic, not run on CPU")
"""Megatron's cheaper reduce, a peer known only by its bytes here (no val loss, no step time)."""


def _tier_maps(recs: List[Dict], steady_from: int) -> List[str]:
    """The run's tier map at every iteration of the steady window (the bytes' window)."""
    return [r["grpo_tier_map"] for r in recs if r["iteration"] > steady_from
            and r.get("grpo_tiered") and "grpo_tier_map" in r]


def gpu_shaped_bytes(spec, records: Dict[str, List[Dict]],
                     steady_from: int) -> Dict[str, Dict[str, Optional[float]]]:
    """Per contender (and BF16_RS): bytes per rank per step with bf16 parameters ("bf16") and,
    as a check on the planner, with the runs' fp32 ("fp32"), on this suite's model shape. The
    baseline: fp32 reduce-scatter + bf16 all-gather; GRPO: the planner's bytes for the run's
    tier map of each iteration after ``steady_from``, averaged as the counted bytes are (None
    where the planner does not model the run: PowerSGD); BF16_RS: analytic."""
    from megatron_grpo.comm.analytic import fp32_accumulation_step_bytes
    from megatron_grpo.planner.plan import plan
    from megatron_grpo.training.memory_budget import spec_from_flags

    def flags_spec(c: Contender, bf16: bool):
        # The byte tokenizer's 258 ids, as every bench run; unfused attention as CPU mode.
        return spec_from_flags(
            ["--config", spec.config, *spec.common, *c.flags, *(["--bf16"] if bf16 else [])],
            nodes=1, gpus_per_node=spec.nproc, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258,
            attention="unfused")

    def step_bytes(c: Contender, bf16: bool, maps: List[Optional[str]]) -> Optional[float]:
        model, cluster, grpo, bucket, _ = flags_spec(c, bf16)
        if "--grpo" not in c.flags:
            return float(plan(model, cluster, grpo, bucket_size=bucket).baseline_bytes)
        if grpo.compressor == "powersgd":  # its bytes depend on each matrix's shape: not planned
            return None
        # Tiers move at every re-tier: one plan per map, weighted by the iterations it held
        # (a run with no tiered iteration there is planned at the quota shares: map None).
        by_map = {t: plan(model, cluster, grpo, bucket_size=bucket, tiers=t).grpo_bytes
                  for t in set(maps)}
        return sum(by_map[t] for t in maps) / len(maps)

    out: Dict[str, Dict[str, Optional[float]]] = {}
    for c in CONTENDERS:
        if c.name in records:
            maps = _tier_maps(records[c.name], steady_from) or [None]
            out[c.name] = {d: step_bytes(c, d == "bf16", maps) for d in ("fp32", "bf16")}
    model, cluster, grpo, bucket, _ = flags_spec(CONTENDERS[0], True)
    buckets = plan(model, cluster, grpo, bucket_size=bucket).baseline_buckets
    out[BF16_RS.name] = {"fp32": None, "bf16": float(sum(fp32_accumulation_step_bytes(
        buckets, cluster.dp, model.param_bytes)))}
    return out


def run(args, command: str) -> SuiteResult:
    spec, records, summaries, cmp, warmup, load = run_all("comm", args, DEFAULT_CONFIG, CONTENDERS)
    res = SuiteResult("comm", "Communication: baseline, GRPO compressors, everything-int4, "
                      "megatron's bf16 reduce-scatter", command,
                      ["contender", "val loss", "vs baseline", "bytes/step after warm-up",
                       "ratio", "GPU-shaped (bf16) bytes/step", "vs megatron's best (bf16)",
                       "core / dynamic / stable KB", "whole-run ratio",
                       "step time ratio", "dynamic rel. error"])
    gpu = gpu_shaped_bytes(spec, records, warmup)
    best = min(gpu[n]["bf16"] for n in ("baseline", BF16_RS.name))

    def gpu_cells(name: str) -> List[str]:
        b = gpu.get(name, {}).get("bf16")
        return ["-", "-"] if b is None else [f"{b / 1e6:.3f} MB", f"{b / best:.3f}"]

    for c in CONTENDERS:
        s, k = summaries[c.name], cmp[c.name]
        tiers = s.get("steady_wire_bytes_by_tier")
        split = " / ".join(f"{tiers[t] / 1e3:.0f}" for t in F.TIERS) if tiers else "-"
        h = s.get("health")
        res.rows.append([c.name, F.fmt(s["val_loss"], ".4f"),
                         F.fmt(k["val_loss_diff_pct"], "+.2f", " %"),
                         f"{s['steady_wire_bytes_per_step'] / 1e6:.3f} MB",
                         F.fmt(k["steady_wire_ratio"], ".3f"), *gpu_cells(c.name), split,
                         F.fmt(k["wire_ratio"], ".3f"),
                         F.fmt(k["step_time_ratio"], ".3f"),
                         f"{h['rel_error'][0]:.2f}-{h['rel_error'][1]:.2f}" if h else "-"])
    res.rows.append([f"{BF16_RS.name} (analytic, not run on CPU)", "-", "-", "-", "-",
                     *gpu_cells(BF16_RS.name), "-", "-", "-", "-"])
    res.notes += [f"{c.name}: {c.about}" for c in (*CONTENDERS, BF16_RS)]
    checks = ", ".join(f"{n} {gpu[n]['fp32'] / 1e6:.3f} MB (counted "
                       f"{summaries[n]['steady_wire_bytes_per_step'] / 1e6:.3f})"
                       for n in summaries if gpu.get(n, {}).get("fp32") is not None)
    res.notes.append(
        "GPU-shaped: bytes per rank per step of the same model with bf16 parameters, from the "
        "planner (megatron_grpo/planner/plan.py) with each GRPO run's tier map of every iteration "
        "after warm-up, averaged as the counted bytes are: the baseline "
        "sends fp32 gradients (grad_reduce_in_fp32) and bf16 parameters; megatron-bf16-rs bf16 "
        "gradients and bf16 parameters (comm/analytic.py fp32_accumulation_step_bytes), "
        "megatron's best setting here, which the ratio is against; '-' where the planner does "
        f"not model the run (PowerSGD). The planner in fp32 for the same tier maps: {checks}")
    res.notes.append(f"config {os.path.basename(spec.config)}; after warm-up = iterations > "
                     f"{warmup} (every GRPO run tiered), the same iterations for every run")
    res.notes.append(load)
    res.data = {"summaries": summaries, "compare": cmp, "gpu_shaped_bytes": gpu}
    res.plots["validation loss"] = plots.loss_curves(records, plot_path(spec, "loss.png"), "comm")
    res.plots["bytes per step"] = plots.wire_per_step(
        {k: records[k] for k in ("baseline", "grpo-int4", "all-int4")},
        plot_path(spec, "wire.png"), "counted bytes per rank per step")
    res.plots["bytes vs validation loss"] = plots.bytes_vs_quality(
        {n: (cmp[n]["steady_wire_ratio"], cmp[n]["val_loss_diff_pct"]) for n in summaries},
        plot_path(spec, "front.png"), "bytes after warm-up vs validation loss")
    res.plots["GRPO tier map"] = plots.tier_map(records["grpo-int4"], plot_path(spec, "tier_map.png"),
                                                "GRPO (int4) tier of each unit")
    return res
