"""The largest model a node holds, searched over every setting megatron offers, GRPO's alike.

``launch/plan.py --largest-model --search`` asks the sizing question a Megatron user asks: with
these GPUs, this much host RAM and NVMe, what is the largest model of this shape (hidden size,
heads, sequence, batch kept; ``num_layers`` grown) that trains, and how long is its step? It is
answered for megatron's best setting and for GRPO's, searched the same way:

* the layout: TP (1-8 within a node, dividing the heads), PP, sequence parallelism (TP > 1),
  activation recompute (none, selective, full with one layer per chunk); the data-parallel size
  is what is left, and the global batch is kept (so it must divide into micro-batches);
* megatron's memory option: the DistributedOptimizer, Megatron-FSDP, or the DistributedOptimizer
  with ``optimizer_cpu_offload`` at the smallest fraction that fits (host RAM bounds it); each
  with fp32 or bf16 gradient buffers;
* GRPO's: its memory tier off, on host RAM (``--grpo-offload cpu``) or on NVMe (``ssd``), the
  core tier's state streamed too or not (``--grpo-offload-core``), gradients accumulated on the
  device or in host memory (``--grpo-grad-accumulation host``), with the fp32 gradient buffer
  it runs on.

Memory per GPU comes from the planner's pieces, held to measured CPU runs
(``megatron_grpo/planner/plan.py`` for the DistributedOptimizer and GRPO, ``peers.py`` for
megatron's two options); host RAM and NVMe per node from the same state counts. The step time is
a model (every rate a field of ``Node``, none measured here): compute at an MFU, plus what each
setting adds on top of it, each priced unhidden except where named:

* the DistributedOptimizer: nothing on one NVLink node (its reduce-scatter hides under the
  backward and its parameter gather under the next forward with --overlap-param-gather, which
  megatron's best setting turns on);
* GRPO: the parameter gather after the optimizer step (GRPO refuses --overlap-param-gather);
  its tier's masters and moments over PCIe (cpu) or NVMe (ssd) every step for the dynamic tier
  and every --grpo-stable-interval steps for the stable one, in and out;
* Megatron-FSDP: its per-micro-batch gathers and reduce-scatters on NVLink, overlapped with the
  compute (the step is the larger of the two);
* ``optimizer_cpu_offload``: the offloaded shard's fp32 gradients down and bf16 parameters up
  over PCIe, and Adam on the host CPU;
* GRPO's host accumulation: every micro-batch's fp32 gradients down over PCIe and the sum back
  once, and every micro-batch but the last added on the host.

A plan that fits but runs slowly says so: every winner carries its step time and the parts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from megatron_grpo.planner.compute import exact_step_flops
from megatron_grpo.planner.peers import fsdp_memory, fsdp_step_bytes
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec, plan, stage_param_numels
from megatron_grpo.planner.activations import stage_activation_bytes
from megatron_grpo.comm.analytic import ddp_bucket_numels
from megatron_grpo.grpo.config import default_bucket_elements

RECOMPUTE = (None, "selective", "full")
"""Activation recompute searched: off, megatron's selective, full (uniform, one layer a chunk)."""
MEGATRON_OPTIONS = ("distributed-optimizer", "fsdp", "cpu-offload")
"""megatron's memory options searched (cpu-offload: the DistributedOptimizer with
optimizer_cpu_offload at the smallest fraction that fits)."""
GRPO_OPTIONS = tuple(f"grpo{target}{core}{accum}" for target in ("", "-offload-cpu", "-offload-ssd")
                     for core in (("", "-core") if target else ("",))
                     for accum in ("", "-host-accum"))
"""GRPO's memory settings searched: no memory tier, the tier on host RAM (-offload-cpu) or NVMe
(-offload-ssd), with the core tier's state streamed too (-core, --grpo-offload-core), each with
the gradients accumulated on the device or in host memory (-host-accum,
--grpo-grad-accumulation host)."""


@dataclass(frozen=True)
class Node:
    """One node's memory and the rates the step time is priced at (defaults: a DGX H100-class
    node; every rate is an assumption, named in docs/planner.md)."""

    gpus: int = 8
    """GPUs on the node (one NVLink domain)."""
    gpu_memory_gb: float = 80.0
    """Memory per GPU, GB."""
    host_memory_gb: float = 2000.0
    """Host RAM of the node, GB."""
    nvme_gb: float = 30000.0
    """NVMe of the node for offloaded state, GB."""
    reserve_gb: float = 0.0
    """Per GPU, held outside model state and activations (CUDA context, NCCL, fragmentation)."""
    host_reserve_gb: float = 100.0
    """Host RAM held by the OS, the data loaders and the ranks' own processes, GB per node."""
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU, TFLOP/s (H100 SXM)."""
    mfu: float = 0.40
    """Model FLOPs utilisation of the compute (recompute's extra forward counted as work)."""
    nvlink_gbs: float = 360.0
    """NVLink busbw per GPU, GB/s (planner/steptime.py's figure)."""
    pcie_gbs: float = 25.0
    """Host <-> GPU copies per GPU per direction, GB/s (PCIe Gen5 x16 with 8 GPUs sharing the
    host's memory bandwidth)."""
    nvme_gbs: float = 12.0
    """NVMe read or write for the whole node, GB/s."""
    host_adam_per_s: float = 2.0e9
    """Parameters the node's CPUs update with Adam per second (all ranks together)."""
    host_add_per_s: float = 10.0e9
    """fp32 elements the node's CPUs add into an accumulator per second (a += b: 12 bytes of
    memory traffic each, ~120 GB/s), all ranks together."""

    FLAGS = {"gpus": "--gpus-per-node", "gpu_memory_gb": "--gpu-memory-gb",
             "host_memory_gb": "--host-memory-gb", "nvme_gb": "--nvme-gb", "reserve_gb": "--reserve-gb",
             "host_reserve_gb": "--host-reserve-gb", "mfu": "--mfu", "pcie_gbs": "--pcie-gbs",
             "nvme_gbs": "--nvme-gbs", "host_adam_per_s": "--host-adam-rate"}

    def name(self, field_name: str) -> str:
        """The field as launch/plan.py's flag where it is one, else as ``Node.<field>``."""
        return self.FLAGS.get(field_name, f"Node.{field_name}")

    def validate(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus <= 0:
            raise ValueError(f"{self.name('gpus')} must be a positive integer, got {self.gpus!r}")
        for f in dataclasses.fields(self):
            if f.name not in ("gpus", "reserve_gb", "host_reserve_gb") and not getattr(self, f.name) > 0:
                raise ValueError(f"{self.name(f.name)} must be > 0, got {getattr(self, f.name)!r}")
        if not 0 <= self.reserve_gb < self.gpu_memory_gb:
            raise ValueError(f"--reserve-gb must be >= 0 and below --gpu-memory-gb, got {self.reserve_gb}")
        if not 0 <= self.host_reserve_gb < self.host_memory_gb:
            raise ValueError(f"--host-reserve-gb must be >= 0 and below --host-memory-gb, "
                             f"got {self.host_reserve_gb}")

    @property
    def limits(self) -> Dict[str, float]:
        """Bytes each resource offers model state: per GPU, host RAM and NVMe of the node."""
        return {"gpu": self.gpu_memory_gb * 1e9,
                "host": (self.host_memory_gb - self.host_reserve_gb) * 1e9,
                "nvme": self.nvme_gb * 1e9}


@dataclass(frozen=True)
class Setting:
    """One point of the search: a layout and a memory option."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    sequence_parallel: bool
    """--sequence-parallel (TP > 1)."""
    recompute: Optional[str]
    """None, "selective" or "full" (uniform, one layer per chunk)."""
    option: str
    """One of MEGATRON_OPTIONS or GRPO_OPTIONS."""
    grad_bytes: int = 4
    """Gradient buffer element bytes: 4 (grad_reduce_in_fp32) or 2 (bf16 gradients)."""

    @property
    def system(self) -> str:
        return "grpo" if self.option in GRPO_OPTIONS else "megatron"

    @property
    def target(self) -> str:
        """GRPO's memory tier: none, cpu or ssd."""
        return "cpu" if "offload-cpu" in self.option else "ssd" if "offload-ssd" in self.option else "none"

    @property
    def host_accum(self) -> bool:
        return self.option.endswith("host-accum")

    @property
    def streams_core(self) -> bool:
        return "-core" in self.option

    def flags(self) -> List[str]:
        """The training flags that set this up (megatron's names; GRPO's on top)."""
        out = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}"]
        out += ["--sequence-parallel"] if self.sequence_parallel else []
        if self.recompute == "full":
            out.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
        elif self.recompute:
            out.append(f"--recompute-granularity {self.recompute}")
        out += {"distributed-optimizer": ["--use-distributed-optimizer"],
                "fsdp": ["--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"],
                "cpu-offload": ["--use-distributed-optimizer --optimizer-cpu-offload "
                                "--use-precision-aware-optimizer"],
                }.get(self.option, [])
        if self.system == "grpo":
            out.append("--use-distributed-optimizer --grpo")
            out += [f"--grpo-offload {self.target}"] if self.target != "none" else []
            out += ["--grpo-offload-core"] if self.streams_core else []
            out += ["--grpo-grad-accumulation host"] if self.host_accum else []
        if self.system == "megatron" and self.grad_bytes == 2:
            out.append("--grad-reduce-in-bf16")
        return out


@dataclass
class Usage:
    """What one setting holds at one layer count."""

    gpu: int
    """Peak bytes per GPU (the busiest stage), reserve included."""
    host: int
    """Host RAM of the node for model state (the host reserve not included)."""
    nvme: int
    """NVMe bytes of the node."""
    offload_fraction: float = 0.0
    """cpu-offload: the share of the optimizer state on the host."""
    per_gpu_offloaded: int = 0
    """Bytes of one GPU's state living off it (host or NVMe): what the step time moves."""


@dataclass
class Winner:
    """The largest model one setting fits, and its predicted step."""

    setting: Setting
    """The setting."""
    layers: int
    """Largest num_layers (a multiple of PP) that fits every limit."""
    params: int
    """Parameters of the whole model at that size."""
    usage: Usage
    """What it holds at that size."""
    bound: str
    """What one more PP's worth of layers exceeds: "gpu", "host" or "nvme"."""
    step_s: float = 0.0
    """Predicted seconds per step at that size."""
    step_parts: Dict[str, float] = field(default_factory=dict)
    """The step's parts, seconds: compute and what the setting adds."""

    def as_json(self, gpus: int) -> dict:
        s = self.setting
        config = {"tp": s.tp, "pp": s.pp, "dp": gpus // (s.tp * s.pp),
                  "sequence_parallel": s.sequence_parallel,
                  "recompute": s.recompute, "option": s.option, "grad_bytes": s.grad_bytes,
                  "num_layers": self.layers, "flags": " ".join(s.flags())}
        if s.option == "cpu-offload":
            config["optimizer_offload_fraction"] = self.usage.offload_fraction
        return {"params": self.params, "config": config, "step_s": self.step_s,
                "step_parts": self.step_parts, "bound": self.bound,
                "gpu_gb": self.usage.gpu / 1e9, "host_gb": self.usage.host / 1e9,
                "nvme_gb": self.usage.nvme / 1e9}


def settings(model: ModelSpec, node: Node, grpo) -> List[Setting]:
    """Every setting the search tries on one node for ``model``'s shape and batch."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > node.gpus or node.gpus % tp or model.heads % tp or model.groups % tp or model.ffn % tp:
            continue
        for pp in (1, 2, 4, 8):
            if tp * pp > node.gpus or node.gpus % (tp * pp):
                continue
            dp = node.gpus // (tp * pp)
            if model.global_batch_size is not None and model.global_batch_size % (model.micro_batch_size * dp):
                continue
            for sp in ((False, True) if tp > 1 else (False,)):
                for rc in RECOMPUTE:
                    for opt in MEGATRON_OPTIONS:
                        for gb in (4, 2):
                            out.append(Setting(tp, pp, sp, rc, opt, gb))
                    if grpo is not None:
                        out += [Setting(tp, pp, sp, rc, opt, 4) for opt in GRPO_OPTIONS]
    return out


def _shaped(model: ModelSpec, s: Setting, layers: int) -> ModelSpec:
    rc = dict(recompute_granularity=s.recompute,
              recompute_method="uniform" if s.recompute == "full" else None,
              recompute_num_layers=1 if s.recompute == "full" else None)
    return dataclasses.replace(model, num_layers=layers, sequence_parallel=s.sequence_parallel, **rc)


def _cluster(node: Node, s: Setting) -> ClusterSpec:
    return ClusterSpec(nodes=1, gpus_per_node=node.gpus, gpu_memory_gb=node.gpu_memory_gb,
                       tp=s.tp, pp=s.pp, nvlink_gbps=node.nvlink_gbs * 8)


def _megatron_stage(model: ModelSpec, cluster: ClusterSpec, st: int, grad_bytes: int,
                    bucket: Optional[int]) -> Tuple[int, int, int, int]:
    """(parameters and gradient buffers, fp32 optimizer state of this rank's shard, activations,
    shard elements) of the DistributedOptimizer on stage ``st``."""
    numels = stage_param_numels(model, cluster, st)
    buckets = ddp_bucket_numels(numels, (bucket or default_bucket_elements(cluster.dp))
                                if st == 0 else None, cluster.dp)
    padded = sum(buckets)
    shard = sum(numels) / cluster.dp
    optimizer = (4 if model.bf16 else 0) * shard + 8 * shard  # masters (bf16 only), moments
    return (padded * (model.param_bytes + grad_bytes), round(optimizer),
            stage_activation_bytes(model, cluster, st), round(shard))


def usage(model: ModelSpec, node: Node, s: Setting, grpo=None, offload=None,
          bucket: Optional[int] = None) -> Usage:
    """What setting ``s`` holds with ``model`` (its num_layers as given) on one node."""
    cluster = _cluster(node, s)
    model.validate()
    cluster.validate(model)
    reserve = int(node.reserve_gb * 1e9)
    budget = int(node.gpu_memory_gb * 1e9) - reserve
    if s.option == "fsdp":
        return Usage(reserve + max(fsdp_memory(model, cluster, st, s.grad_bytes).total
                                   for st in range(s.pp)), 0, 0)
    if s.option in ("distributed-optimizer", "cpu-offload"):
        stages = [_megatron_stage(model, cluster, st, s.grad_bytes, bucket) for st in range(s.pp)]
        if s.option == "distributed-optimizer":
            return Usage(reserve + max(a + b + c for a, b, c, _ in stages), 0, 0)
        # The smallest offload fraction whose device share fits the GPU; the host then holds
        # that share's masters and moments and an fp32 gradient copy, for every rank.
        # (Where even fraction 1 leaves too little room the GPU figure below says so.)
        need = max(max(0.0, 1 - (budget - bufs - act) / opt) for bufs, opt, act, _ in stages)
        frac = min(1.0, math.ceil(need * 20 - 1e-9) / 20)  # megatron's fraction, to 0.05
        host = sum(frac * (opt + 4 * shard) for _, opt, _, shard in stages) * s.tp * (node.gpus // (s.tp * s.pp))
        gpu = reserve + max(b + (1 - frac) * o + a for b, o, a, _ in stages)
        per_gpu = max(frac * shard for *_, shard in stages)
        return Usage(round(gpu), round(host), 0, frac, round(per_gpu))
    # GRPO: the planner's own memory with the tier as configured.
    off = None if s.target == "none" else dataclasses.replace(offload, target=s.target,
                                                                core=s.streams_core)
    if s.host_accum:
        grpo = dataclasses.replace(grpo, grad_accumulation="host")
    p = plan(model, cluster, grpo, bucket_size=bucket, offload=off)
    m = p.grpo_memory
    away = m.offloaded + m.offloaded_between_updates
    elements = sum(stage_param_numels(model, cluster, p.memory_stage))
    # The streamed units' gradient shards leave at their sync for the same target.
    streamed = 1.0 if s.streams_core else 1 - grpo.core_share
    shards = 4 * streamed * elements / cluster.dp \
        if off is not None and off.grads and grpo.release_grads else 0
    host = away + shards if s.target == "cpu" else 0
    nvme = away + shards if s.target == "ssd" else 0
    if s.host_accum:  # an fp32 accumulator per element, and one pinned landing buffer
        host += 4 * elements + 4 * max(p.units)
    return Usage(reserve + m.total, round(host * node.gpus), round(nvme * node.gpus),
                 per_gpu_offloaded=away)


def fits(u: Usage, node: Node) -> Optional[str]:
    """None when ``u`` fits the node, else the first limit it exceeds."""
    return next((what for what, limit in node.limits.items() if getattr(u, what) > limit), None)


def largest(node: Node, s: Setting, measure: Callable[[int], Usage],
            max_layers: int = 2048) -> Tuple[int, Optional[Usage], str]:
    """(largest layers, its usage, what one more step of PP layers exceeds), over multiples of
    PP: every limit grows with each layer, about linearly, so two sizes give a first guess;
    the boundary is then bracketed from it and bisected (every answer checked, none assumed)."""
    step = s.pp
    seen: Dict[int, Tuple[Optional[str], Usage]] = {}

    def verdict(layers: int) -> Tuple[Optional[str], Usage]:
        if layers not in seen:
            u = measure(layers)
            seen[layers] = (fits(u, node), u)
        return seen[layers]

    a, b = 4 * step, 8 * step
    ua, ub = verdict(a)[1], verdict(b)[1]
    guess = float(max_layers)
    for what, limit in node.limits.items():
        x, y = getattr(ua, what), getattr(ub, what)
        if y > x:
            guess = min(guess, a + (limit - x) * (b - a) / (y - x))
    guess = min(max_layers, max(step, int(guess) // step * step))
    if verdict(guess)[0] is None:
        lo, d = guess, step
        while lo + d <= max_layers and verdict(lo + d)[0] is None:
            lo, d = lo + d, d * 2
        hi = lo + d
    else:
        hi, d = guess, step
        while hi - d > 0 and verdict(hi - d)[0] is not None:
            hi, d = hi - d, d * 2
        lo = max(0, hi - d)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if verdict(mid)[0] is None:
            lo = mid
        else:
            hi = mid
    if lo + step > max_layers:
        return lo, verdict(lo)[1], "max_layers"
    bound = verdict(lo + step)[0] or "max_layers"
    return lo, (verdict(lo)[1] if lo else None), bound


def _tokens(model: ModelSpec, dp: int, pp: int) -> int:
    return model.micro_batches(dp, pp) * model.micro_batch_size * model.seq_length


def step_time(model: ModelSpec, node: Node, s: Setting, u: Usage, grpo=None) -> Dict[str, float]:
    """Predicted seconds of one step of ``model`` under ``s`` (module notes): "compute" and
    what the setting adds, with their sum as "step"."""
    from megatron_grpo.compute.flops import attention_flops

    cluster = _cluster(node, s)
    dp, m = cluster.dp, model.micro_batches(cluster.dp, s.pp)
    tokens = _tokens(model, dp, s.pp)
    flops = exact_step_flops(model, tokens, s.tp)
    attention = attention_flops(model.num_layers, tokens, model.seq_length, model.hidden // s.tp)
    if s.recompute == "full":
        flops += flops // 3  # one more forward of every layer (the head's is counted too)
    elif s.recompute == "selective":
        flops += attention // 3  # the core attention's forward again
    bubble = 1 + (s.pp - 1) / m
    parts = {"compute": flops / s.pp * bubble / (node.peak_tflops * 1e12 * node.mfu)}
    per_stage = [sum(stage_param_numels(model, cluster, st)) for st in range(s.pp)]
    stage = max(range(s.pp), key=per_stage.__getitem__)  # the busiest stage sets the pace
    elements = per_stage[stage]
    shard = elements / dp
    wire = lambda nbytes: nbytes / (node.nvlink_gbs * 1e9)  # noqa: E731
    if s.option == "fsdp" and dp > 1:
        comm = wire(fsdp_step_bytes(model, cluster, stage))
        parts["fsdp_comm_unhidden"] = max(0.0, comm - parts["compute"])
    if s.option == "cpu-offload":
        moved = u.offload_fraction * shard
        parts["pcie"] = moved * (4 + model.param_bytes) / (node.pcie_gbs * 1e9)
        parts["host_adam"] = moved * node.gpus / node.host_adam_per_s
    if s.system == "grpo":
        if dp > 1:
            parts["param_gather"] = wire((dp - 1) * shard * model.param_bytes)
        if s.host_accum and m > 1:
            # Every micro-batch but the last: each element's fp32 gradient out and added on the
            # host; then the sum back once (unhidden: the copies wait on backward's thread).
            parts["grad_accum_pcie"] = m * 4 * elements / (node.pcie_gbs * 1e9)
            parts["host_add"] = (m - 1) * elements * node.gpus / node.host_add_per_s
        if s.target != "none":
            # Per step: the dynamic tier's state out and back every step, the stable tier's
            # every --grpo-stable-interval steps (by their shares of what lives away).
            every = grpo.dynamic_share + (grpo.core_share if s.streams_core else 0.0)
            away = every + grpo.stable_share
            per_step = (every + grpo.stable_share / max(1, grpo.stable_interval)) / away if away else 0.0
            moved = 2 * u.per_gpu_offloaded * per_step
            parts["pcie"] = moved / (node.pcie_gbs * 1e9)
            if s.target == "ssd":
                parts["nvme"] = max(0.0, moved * node.gpus / (node.nvme_gbs * 1e9) - parts["pcie"])
    parts["step"] = sum(parts.values())
    return parts


@dataclass
class SearchResult:
    """Every setting's largest model, and the best of each side."""

    node: Node
    """The node searched."""
    winners: List[Winner]
    """Each setting's largest model (settings where nothing fits: 0 layers)."""
    megatron: Optional[Winner]
    """megatron's best: the most parameters, then the shortest step."""
    grpo: Optional[Winner]
    """GRPO's best, the same way."""
    both: Dict[str, Optional[Winner]] = field(default_factory=dict)
    """At megatron's largest size: the fastest setting of each side that fits it."""

    @property
    def ratio(self) -> float:
        return self.grpo.params / self.megatron.params if self.grpo and self.megatron and \
            self.megatron.params else 0.0

    def as_json(self) -> dict:
        gpus = self.node.gpus
        out = {side: (w.as_json(gpus) if w else None) for side, w in
               (("megatron", self.megatron), ("grpo", self.grpo))}
        out["ratio"] = self.ratio
        out["at_megatron_largest"] = {side: (w.as_json(gpus) if w else None)
                                      for side, w in self.both.items()}
        out["node"] = dataclasses.asdict(self.node)
        return out


def _best(winners: List[Winner]) -> Optional[Winner]:
    live = [w for w in winners if w.layers]
    return min(live, key=lambda w: (-w.params, w.step_s)) if live else None


def search(model: ModelSpec, node: Node, grpo=None, offload=None,
           bucket: Optional[int] = None, only: Optional[List[Setting]] = None) -> SearchResult:
    """The largest model of ``model``'s shape for every setting (``only``: those given) on one
    node, each with its predicted step; ``grpo`` None searches megatron alone."""
    from megatron_grpo.offload.config import OffloadConfig
    from megatron_grpo.planner.capacity import model_params

    node.validate()
    if grpo is not None:
        grpo = dataclasses.replace(grpo, enabled=True)
        offload = offload if offload is not None else OffloadConfig()
    winners = []
    for s in only if only is not None else settings(model, node, grpo):
        measure = lambda layers, s=s: usage(_shaped(model, s, layers), node, s, grpo, offload, bucket)  # noqa: E731
        layers, u, bound = largest(node, s, measure)
        w = Winner(s, layers, 0, u or Usage(0, 0, 0), bound)
        if layers:
            sized = _shaped(model, s, layers)
            w.params = model_params(sized, _cluster(node, s))
            w.step_parts = step_time(sized, node, s, u, grpo)
            w.step_s = w.step_parts["step"]
        winners.append(w)
    result = SearchResult(node, winners, _best([w for w in winners if w.setting.system == "megatron"]),
                          _best([w for w in winners if w.setting.system == "grpo"]))
    if result.megatron:
        size = result.megatron.layers
        for side in ("megatron", "grpo"):
            fast = []
            for w in winners:
                if w.setting.system != side or w.layers < size or size % w.setting.pp:
                    continue
                sized = _shaped(model, w.setting, size)
                u = usage(sized, node, w.setting, grpo, offload, bucket)
                if fits(u, node) is None:
                    parts = step_time(sized, node, w.setting, u, grpo)
                    fast.append(Winner(w.setting, size, result.megatron.params, u, "", parts["step"], parts))
            result.both[side] = min(fast, key=lambda w: w.step_s) if fast else None
    return result
