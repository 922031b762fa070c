"""Where compression pays: a per-link, per-format decision, measured on the run's own group.

GRPO's compressed sync sends fewer bytes but costs codec work (encode, decode, error feedback,
the parameter deltas). On a fast link (NVLink, localhost) that work can take longer than the
bytes it saves; on a slow one (Ethernet between nodes) the bytes dominate. So before the first
step every rank times, on a bucket-sized random tensor and the real group:

* the exact path of one bucket: megatron's reduce-scatter of the gradient and all-gather of
  the parameters (what the distributed optimizer does every step);
* the compressed path, per format a tier would use (int8 core, int4 dynamic, int2 stable):
  GRPO's own compressed reduce-scatter with error feedback and its parameter-delta gather, the
  same code the step runs;
* the codec alone (encode, then decode-and-sum, no communication), for the report.

The slowest rank's times decide (one all-reduce of the timings over every rank of the job, so
every rank, TP and PP included, reaches the same decision). A format is used on a group where
its compressed path takes at most ``PAYS`` of the exact one; otherwise the tiers that would use
it sync exactly, through megatron's own collectives. ``--grpo-compress`` says which rule runs:

* ``auto`` (default): the measurement above decides, confirmed by a short A/B of step time
  after the warm-up (``StepTimeAB``); the exact path wins where the A/B shows no gain;
* ``all``: every tier compresses everywhere (the behaviour before this decision existed);
* ``inter-node``: compress only a group whose ranks span nodes (the inter-instance all-reduce
  of the partial distributed optimizer, or a flat data-parallel group across nodes);
* ``none``: nothing is compressed; GRPO keeps importance, tiers, the memory tier and the
  sampled backward.

Importance, tiers, the memory tier and the sampled backward do not depend on the decision.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

MODES = ("auto", "all", "inter-node", "none")
PAYS = 0.9
"""A format is used where its compressed path takes at most this share of the exact path's
time: within 10 % the saving is noise, and the codec also competes with the backward's kernels
in an overlapped step, which the probe does not see."""
PROBE_MAX_ELEMENTS = 1 << 24
"""Largest bucket the probe times (64 MiB of fp32): larger buckets scale linearly."""


@dataclass
class ProbeResult:
    """The slowest rank's times for one bucket of ``numel`` elements on one group."""

    numel: int
    exact_s: float
    """megatron's reduce-scatter of the gradient and all-gather of the parameters."""
    exact_bytes: int
    """Bytes one rank sends on the exact path (what the link rate is computed from)."""
    compressed_s: Dict[str, float] = field(default_factory=dict)
    """Per format: GRPO's compressed reduce-scatter and parameter-delta gather."""
    codec_s: Dict[str, float] = field(default_factory=dict)
    """Per format: encode then decode-and-sum of the bucket, no communication."""

    def link_gbps(self) -> float:
        return self.exact_bytes / self.exact_s / 1e9 if self.exact_s > 0 else float("inf")

    def codec_gbps(self, fmt: str) -> float:
        t = self.codec_s.get(fmt, 0.0)
        return self.numel * 4 / t / 1e9 if t > 0 else float("inf")


class LinkDecision:
    """Which formats one group compresses with (the rest of its tiers sync exactly)."""

    def __init__(self, mode: str, name: str, spans_nodes: bool) -> None:
        if mode not in MODES:
            raise ValueError(f"--grpo-compress must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.name = name
        self.spans_nodes = spans_nodes
        self.probe: Optional[ProbeResult] = None
        self.compress: Dict[str, bool] = {}
        self.confirmed = mode != "auto"
        """False until the A/B has run (auto only); the A/B may still turn compression off."""

    def where(self) -> str:
        return "inter-node" if self.spans_nodes else "intra-node"

    def decide(self, formats: List[str], probe: Optional[ProbeResult]) -> None:
        self.probe = probe
        for fmt in formats:
            if self.mode == "all":
                self.compress[fmt] = True
            elif self.mode == "none":
                self.compress[fmt] = False
            elif self.mode == "inter-node":
                self.compress[fmt] = self.spans_nodes
            else:
                self.compress[fmt] = probe is not None and fmt in probe.compressed_s and \
                    probe.compressed_s[fmt] <= PAYS * probe.exact_s

    def compresses(self, fmt: str) -> bool:
        return self.compress.get(fmt, self.mode == "all")

    def any_compressed(self) -> bool:
        return any(self.compress.values())

    def fall_back(self) -> None:
        """The A/B showed no gain: every format syncs exactly on this group from now on."""
        for fmt in self.compress:
            self.compress[fmt] = False
        self.confirmed = True

    def line(self) -> str:
        """One line for the start-up log, e.g. ``dp group (intra-node): exact: link 11.2 GB/s,
        int4 codec 1.1 GB/s (compressed 2.31x the exact time)``."""
        used = [f for f, on in self.compress.items() if on]
        verdict = ", ".join(used) if used else "exact"
        head = f"{self.name} ({self.where()}): {verdict} [--grpo-compress {self.mode}]"
        p = self.probe
        if p is None:
            return head
        parts = [f"link {p.link_gbps():.3g} GB/s"]
        for fmt in self.compress:
            if fmt in p.compressed_s:
                parts.append(f"{fmt} codec {p.codec_gbps(fmt):.3g} GB/s "
                             f"(compressed {p.compressed_s[fmt] / p.exact_s:.2f}x the exact time)")
        return head + ": " + ", ".join(parts)

    def metrics(self) -> Dict[str, float]:
        out = {f"grpo_compress_{fmt}": float(on) for fmt, on in self.compress.items()}
        if self.probe is not None:
            out["grpo_link_gbps"] = self.probe.link_gbps()
            for fmt, t in self.probe.compressed_s.items():
                out[f"grpo_probe_{fmt}_vs_exact"] = t / self.probe.exact_s
        return out

    def state_dict(self) -> Dict:
        return {"mode": self.mode, "compress": dict(self.compress), "confirmed": self.confirmed}


def group_spans_nodes(group, ranks_per_node: Optional[int]) -> bool:
    """Whether the group's ranks sit on more than one node (consecutive global ranks per node,
    as torchrun and the SLURM launch place them). Unknown ranks per node: one node."""
    if ranks_per_node is None or not dist.is_initialized():
        return False
    ranks = dist.get_process_group_ranks(group)
    return len({r // ranks_per_node for r in ranks}) > 1


def _timed_rounds(fns: List[Callable[[], None]], device: torch.device, repeats: int) -> List[float]:
    """Median wall time of each of ``fns``, run in turn ``repeats`` times after one warm-up
    round (the first call pays allocation and, on CUDA, kernel compilation). Interleaved and the
    median, not the least: a machine shared with other work stalls a call now and then, and a
    stall must not decide which path is faster."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for fn in fns:
        fn()
    sync()
    samples: List[List[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            sync()
            samples[i].append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def probe(group, numel: int, compressors: Dict[str, object], device, grad_dtype=torch.float32,
          param_dtype=torch.float32, residual_dtype: str = "int8", repeats: int = 5,
          agree_group=None) -> ProbeResult:
    """Time one bucket's exact and compressed paths on ``group`` (see the module docstring).
    Every rank of ``agree_group`` (default: the whole job) must call it with the same arguments;
    the result is the slowest rank's, identical everywhere."""
    from megatron_grpo.comm.dynamic import CompressedReduceScatter, gather_param_delta, prepare_param_delta
    from megatron_grpo.comm.error_feedback import ErrorFeedback

    device = torch.device(device)
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = max(dp, min(numel, PROBE_MAX_ELEMENTS) // dp * dp)
    shard = numel // dp
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    grad = torch.randn(numel, generator=gen).to(device=device, dtype=grad_dtype)
    params = torch.randn(numel, generator=gen).to(device=device, dtype=param_dtype)
    work, out_shard = torch.empty_like(grad), torch.empty(shard, dtype=grad_dtype, device=device)

    def exact():
        work.copy_(grad)
        dist.reduce_scatter_tensor(out_shard, work, group=group)
        dist.all_gather_into_tensor(params, params[rank * shard:(rank + 1) * shard].clone(), group=group)

    fns = [exact]
    formats = sorted(compressors)
    for fmt in formats:
        comp = compressors[fmt]
        ef = ErrorFeedback(residual_dtype, getattr(comp, "chunk", 256))
        flat = torch.empty(numel, dtype=grad_dtype, device=device)
        master = params[rank * shard:(rank + 1) * shard].to(torch.float32) + 1e-3
        model = params.clone()

        def compressed(comp=comp, ef=ef, flat=flat, master=master, model=model):
            flat.copy_(grad)
            CompressedReduceScatter("probe", flat, flat[rank * shard:(rank + 1) * shard], ef, comp,
                                    group, async_op=False)
            ef.commit()
            gather_param_delta(model, prepare_param_delta(model, master, comp, dp, rank), comp, group)

        def codec(comp=comp):
            payload = comp.compress_rows(grad.to(torch.float32).view(dp, shard))
            comp.decompress_rows_sum(payload, shard)

        fns += [compressed, codec]
    times = _timed_rounds(fns, device, repeats)
    # The slowest rank decides, the same numbers on every rank.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=agree_group)
    t = t.tolist()
    exact_bytes = (dp - 1) * shard * (torch.finfo(grad_dtype).bits // 8 + torch.finfo(param_dtype).bits // 8)
    result = ProbeResult(numel, t[0], exact_bytes)
    for i, fmt in enumerate(formats):
        result.compressed_s[fmt], result.codec_s[fmt] = t[1 + 2 * i], t[2 + 2 * i]
    return result


class StepTimeAB:
    """The A/B of step time that confirms an ``auto`` decision to compress: after the warm-up,
    ``steps`` steps with the decision, then ``steps`` steps exact; compression stays only where
    its median step time is below the exact one's (the slowest rank's medians decide). In an
    overlapped step only the exposed part of the sync counts, and the codec competes with the
    backward's kernels: the probe's times cannot tell that, the step time does."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.start: Optional[int] = None
        self.times: Dict[str, List[float]] = {"compressed": [], "exact": []}
        self.done = False

    def phase(self, k: int) -> Optional[str]:
        """What iteration ``k`` runs: "compressed", "exact", or None (the A/B is not running)."""
        if self.done or self.start is None or k < self.start:
            return None
        i = k - self.start
        if i < self.steps:
            return "compressed"
        if i < 2 * self.steps:
            return "exact"
        return None

    def record(self, k: int, step_time: float) -> None:
        phase = self.phase(k)
        if phase is not None:
            self.times[phase].append(step_time)

    def verdict(self, device, agree_group=None) -> Optional[bool]:
        """Once both halves are in: True if compressing was faster (one all-reduce), else False."""
        if self.done or len(self.times["exact"]) < self.steps:
            return None
        medians = torch.tensor([statistics.median(self.times["compressed"]),
                                statistics.median(self.times["exact"])], dtype=torch.float64,
                               device=device)
        if dist.is_initialized():
            dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=agree_group)
        self.done = True
        self.medians = medians.tolist()
        return self.medians[0] < self.medians[1]
