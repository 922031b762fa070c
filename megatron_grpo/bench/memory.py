"""Memory: where each run's memory lives (host RSS, device, GRPO's error-feedback residuals),
baseline beside GRPO, on the tiny model; the memory-tier contenders say why they did not run.
"""

from __future__ import annotations

import os

from megatron_grpo.bench import figures as F
from megatron_grpo.bench import plots
from megatron_grpo.bench.runner import CONFIGS, Contender
from megatron_grpo.bench.sidebyside import plot_path, run_all
from megatron_grpo.bench.suite import SuiteResult

DEFAULT_CONFIG = os.path.join(CONFIGS, "tiny.yaml")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def contenders():
    cuda = _cuda()
    return [
        Contender("baseline", [], "megatron-core, all state on the training device"),
        Contender("grpo", ["--grpo"], "GRPO defaults (adds error-feedback residuals of the "
                  "dynamic tier: one fp32 copy of its gradient buckets)"),
        Contender("megatron-cpu-offload", ["--optimizer-cpu-offload"],
                  "megatron-core optimizer_cpu_offload (HybridDeviceOptimizer)",
                  skip=("--optimizer-cpu-offload is not wired into the training entry yet "
                        "(issue 10 adds it beside the memory tier)") if cuda else
                  ("needs CUDA: megatron's HybridDeviceOptimizer moves optimizer state between "
                   "torch.cuda streams; on a CPU run that state is already in host memory, so "
                   "there is nothing to offload")),
        Contender("grpo-memory-tier", ["--grpo"], "GRPO memory tier (128 MB chunks to CPU/SSD)",
                  skip="not built yet (issue 10): no contender is faked"),
    ]


def run(args, command: str) -> SuiteResult:
    cands = contenders()
    runnable = [c for c in cands if not c.skip]
    spec, records, summaries, cmp, _, load = run_all("memory", args, DEFAULT_CONFIG, runnable)
    res = SuiteResult("memory", "Memory by location: baseline and GRPO", command,
                      ["contender", "peak host RSS MB", "ratio", "peak device MB",
                       "GRPO residuals MB", "val loss"])
    rows = {}
    for c in runnable:
        s, k = summaries[c.name], cmp[c.name]
        res.rows.append([c.name, f"{s['peak_rss_mb']:.0f}", F.fmt(k["peak_rss_ratio"], ".3f"),
                         F.fmt(s.get("peak_device_mb"), ".0f"), F.fmt(s.get("grpo_ef_mb"), ".2f"),
                         F.fmt(s["val_loss"], ".4f")])
        loc = {"host RSS (peak)": s["peak_rss_mb"]}
        if s.get("peak_device_mb") is not None:
            loc["device (peak)"] = s["peak_device_mb"]
        rows[c.name] = loc
    for c in cands:
        if c.skip:
            res.rows.append([c.name, "-", "-", "-", "-", "-"])
            res.notes.append(f"{c.name} not run: {c.skip}")
    res.notes.append("GRPO residuals are inside the host RSS on a CPU run (they live where the "
                     "gradients live); offload bandwidth: no offload contender ran, so none is "
                     "plotted")
    res.notes.append(load)
    res.data = {"summaries": summaries, "compare": cmp}
    res.plots["memory by location"] = plots.memory_by_location(
        rows, plot_path(spec, "memory.png"), "peak memory per rank")
    return res
