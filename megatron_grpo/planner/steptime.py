"""Step time, megatron beside GRPO: a model, not a measurement.

A step is the compute (model FLOPs at a named MFU) plus what the data-parallel sync adds on top
of it: the part of the gradient reduce-scatter that the backward does not hide, and the
parameter all-gather after the optimizer step. GRPO's sync is priced with its codec (encode,
decode, error feedback) and with the runtime's own rule for where a format is used
(megatron_grpo.comm.link_decision: a tier compresses on a link only where its compressed path,
codec included, takes at most 0.9 of the exact path's time), decided link by link: inside a
node (NVLink) and between nodes (the network); then, as the runtime's A/B of step time does,
kept only where it shortens the step (the rule sees sync time, not what the backward hid).

The data-parallel group of a stage has ``g`` ranks on each of ``I`` nodes. Its sync is priced
as two stages: inside the node over ``g`` ranks (every element on NVLink) and between the nodes
over ``I`` ranks (the 1/g shard the node stage left, on this GPU's own NIC). On a rail-optimised
fabric NCCL's rings move about that many bytes per NIC for megatron's flat collective too (g
rings leave a node, one per NIC), and GRPO's hierarchical layout (exact inside the node,
compressed between nodes) is this decomposition by construction. Each stage of k ranks moves
(k-1)/k of its elements per phase: the busbw definition, so a link is named by its NCCL busbw.

Every assumption is a field below (with its figure's source) or a line of docs/planner.md,
"Step time (modelled, not measured)". Nothing here is measured; launch/plan.py --step-time prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_grpo.comm.analytic import ddp_bucket_numels
from megatron_grpo.grpo.config import default_bucket_elements
from megatron_grpo.planner.compute import exact_step_flops
from megatron_grpo.planner.plan import ClusterSpec, stage_param_numels

FORMAT_BYTES = {"int8": 1.0, "int4": 0.5, "int2": 0.25}
"""Code bytes per element of each quantised format; one fp32 scale per chunk comes on top
(comm/compress.py's payload_bytes: ``code + 4 / chunk`` per element, rounding aside)."""


@dataclass(frozen=True)
class GPU:
    """One accelerator; the defaults are an H100 SXM 80 GB."""

    peak_flops: float = 989e12
    """Dense bf16 tensor-core peak, FLOP/s (NVIDIA's H100 SXM datasheet: 989 TFLOP/s without
    sparsity)."""
    mfu: float = 0.40
    """Model FLOPs utilisation of the compute alone: forward, backward, recompute, TP and PP
    communication and the pipeline bubble are inside it; the data-parallel sync is not (it is
    added on top). 40 % is a typical Megatron-LM figure for dense GPTs on H100 (an assumption)."""
    hbm_bytes_per_s: float = 3.35e12
    """HBM3 bandwidth (H100 SXM datasheet: 3.35 TB/s)."""
    hbm_efficiency: float = 0.70
    """Share of the HBM bandwidth a memory-bound codec kernel reaches."""
    launch_s: float = 5e-6
    """Host time per kernel launch; launches are added to the codec's device time, not hidden
    under it (an upper bound: the codec is never cheaper than this)."""

    @property
    def hbm_effective(self) -> float:
        return self.hbm_bytes_per_s * self.hbm_efficiency


@dataclass(frozen=True)
class Codec:
    """How GRPO's quantise/dequantise work is implemented."""

    name: str
    """Label in the table."""
    hbm_bytes_per_element: float
    """HBM bytes moved per element of a unit in one phase (the gradient's reduce-scatter, or the
    parameter deltas' gather): encode, error feedback, decode and sum together."""
    launches_per_unit: int
    """Kernel launches per unit and phase."""


EAGER = Codec("eager", 175.0, 300)
"""The eager PyTorch codec: ~150-200 HBM bytes per element (175 taken) and ~300 launches per
128 MB unit (one op per chunk step, per received shard)."""
FUSED = Codec("fused", 10.0, 3)
"""A fused Triton codec: ~10 HBM bytes per element, 3 launches per unit (encode with error
feedback, decode-and-sum, parameter-delta apply)."""
CODECS = (EAGER, FUSED)


@dataclass(frozen=True)
class Cluster:
    """Nodes and the links one data-parallel rank uses."""

    name: str
    """Label in the table."""
    nodes: int
    """Nodes in the job."""
    gpus_per_node: int = 8
    """GPUs per node (one NVLink domain)."""
    nvlink_gbs: float = 360.0
    """NVLink reduce-scatter / all-gather busbw per GPU, GB/s: the low end of NCCL's measured
    360-480 GB/s on an 8 x H100 SXM node (nccl-tests reduce_scatter_perf without NVLS ~360-370;
    all_reduce with NVLS 460-480). The low end is the conservative choice for the claim that
    NVLink stays exact: a slower link only favours compression."""
    network: str = ""
    """Name of the inter-node link (empty: one node)."""
    network_gbs: float = 0.0
    """Inter-node busbw per GPU, GB/s (one NIC per GPU, rail-optimised)."""


CLUSTERS = (
    Cluster("1 node, NVLink", 1),
    # 400 Gb/s = 50 GB/s line rate; nccl-tests reach ~46-49 GB/s busbw per NIC at large sizes.
    Cluster("16 nodes, IB 400G", 16, network="IB", network_gbs=48.0),
    # 100 Gb/s = 12.5 GB/s line rate; RoCE reaches ~11-12 GB/s busbw.
    Cluster("16 nodes, Eth 100G", 16, network="Eth", network_gbs=11.5),
)


@dataclass(frozen=True)
class StepTimeConfig:
    """The model's knobs beside the GPU and the codec."""

    gpu: GPU = GPU()
    """The accelerator."""
    grad_bytes: int = 2
    """Bytes per gradient element on the exact path's wire: 2 = bf16 reduce-scatter (megatron's
    reduce_scatter_with_fp32_accumulation, Megatron-LM --grad-reduce-in-bf16); 4 = fp32
    (grad_reduce_in_fp32, Megatron-LM's bf16 default and what GRPO runs on today)."""
    param_bytes: int = 2
    """Bytes per parameter element of the all-gather (bf16 parameters)."""
    pays: float = 0.9
    """A format is used on a link only where its compressed path takes at most this share of the
    exact path's time (the runtime's link_decision.PAYS)."""
    contention: float = 1.0
    """Share of the codec's device time that, when it runs during the backward, delays the
    backward (1: all of it, the codec's memory-bound kernels take SMs and HBM from the GEMMs)."""


@dataclass
class Sync:
    """Seconds of one unit's sync: codec and wire, for each phase."""

    rs_codec: float = 0.0
    """Encode, error feedback, decode and sum of the gradient."""
    rs_wire: float = 0.0
    """The gradient's reduce-scatter (GRPO: all-to-all of payloads) on the wire."""
    ag_codec: float = 0.0
    """Encode and apply of the parameter deltas."""
    ag_wire: float = 0.0
    """The parameter all-gather (GRPO: of the deltas' payloads) on the wire."""

    def add(self, other: "Sync", weight: float) -> None:
        for name in ("rs_codec", "rs_wire", "ag_codec", "ag_wire"):
            setattr(self, name, getattr(self, name) + weight * getattr(other, name))


@dataclass(frozen=True)
class Link:
    """One stage of the data-parallel sync: ``ranks`` ranks on a link of ``gbs`` GB/s, each
    unit entering it with 1/``divisor`` of its elements."""

    name: str
    """Label of the link (NVLink, IB, Eth)."""
    ranks: int
    """Ranks k of this stage; (k-1)/k of what enters it crosses the link per phase."""
    divisor: int
    """A unit enters this stage with 1/divisor of its elements (the node stage's shard)."""
    gbs: float
    """busbw per GPU, GB/s."""


def dp_per_node(cluster: Cluster, tp: int, dp: int) -> int:
    """Ranks of one data-parallel group on a node under megatron's rank order (TP innermost,
    then DP): a node holds gpus_per_node / tp of them (one when TP fills the node)."""
    per_node = min(dp, max(1, cluster.gpus_per_node // tp))
    if dp % per_node:
        raise ValueError(f"a data-parallel group of {dp} does not split into nodes of {per_node}")
    return per_node


def dp_links(cluster: Cluster, tp: int, dp: int) -> List[Link]:
    """The stages of a data-parallel group: ``g`` ranks share a node, ``I = dp / g`` nodes."""
    per_node = dp_per_node(cluster, tp, dp)
    nodes = dp // per_node
    links = []
    if per_node > 1:
        links.append(Link("NVLink", per_node, 1, cluster.nvlink_gbs))
    if nodes > 1:
        if cluster.network_gbs <= 0:
            raise ValueError(f"{cluster.name}: the group spans {nodes} nodes but no network is given")
        links.append(Link(cluster.network or "network", nodes, per_node, cluster.network_gbs))
    return links


def format_bytes(fmt: str, chunk: int) -> float:
    if fmt not in FORMAT_BYTES:
        raise ValueError(f"the step-time model prices int8/int4/int2, not {fmt!r}")
    return FORMAT_BYTES[fmt] + 4 / chunk


def link_sync(n: float, link: Link, fmt: Optional[str], codec: Codec, cfg: StepTimeConfig,
              chunk: int = 256) -> Sync:
    """One unit of ``n`` elements through one stage: exact (``fmt`` None) or in ``fmt``."""
    m = n / link.divisor
    share = (link.ranks - 1) / link.ranks * m / (link.gbs * 1e9)  # seconds per wire byte/element
    if fmt is None:
        return Sync(rs_wire=share * cfg.grad_bytes, ag_wire=share * cfg.param_bytes)
    c = format_bytes(fmt, chunk)
    work = m * codec.hbm_bytes_per_element / cfg.gpu.hbm_effective + \
        codec.launches_per_unit * cfg.gpu.launch_s
    return Sync(work, share * c, work, share * c)


def pays(n: float, link: Link, fmt: str, codec: Codec, cfg: StepTimeConfig, chunk: int = 256) -> bool:
    """The runtime's rule on one link: encode + compressed wire + decode, both phases, at most
    ``cfg.pays`` of the exact path's time."""
    exact = link_sync(n, link, None, codec, cfg, chunk)
    comp = link_sync(n, link, fmt, codec, cfg, chunk)
    total = lambda s: s.rs_codec + s.rs_wire + s.ag_codec + s.ag_wire  # noqa: E731
    return total(comp) <= cfg.pays * total(exact)


def break_even_gbs(n: float, link: Link, fmt: str, codec: Codec, cfg: StepTimeConfig,
                   chunk: int = 256) -> float:
    """The link busbw (GB/s) below which ``fmt`` pays on ``link`` for a unit of ``n`` elements.

    With f = (k-1)/k, M = n / divisor, b0 = grad + param bytes, c the format's bytes per element
    and W = M h / B_hbm_eff + launches x launch_s the codec's time per phase, compressing pays
    while f M c 2 / BW + 2 W <= pays x f M b0 / BW, i.e. below BW* = f M (pays b0 - 2 c) / (2 W).
    Without launches, margin and ring factor: (1 - r) b0' B / h per phase (b0' one phase's exact
    bytes, r = c / b0')."""
    m = n / link.divisor
    f = (link.ranks - 1) / link.ranks
    saved = f * m * (cfg.pays * (cfg.grad_bytes + cfg.param_bytes) - 2 * format_bytes(fmt, chunk))
    work = m * codec.hbm_bytes_per_element / cfg.gpu.hbm_effective + \
        codec.launches_per_unit * cfg.gpu.launch_s
    return max(0.0, saved / (2 * work) / 1e9)


def tier_formats(grpo) -> List[Tuple[float, Optional[str]]]:
    """(weight per step, format) of GRPO's tiers, by element share (the planner's quota-share
    assumption): core and dynamic every step; a frozen or delayed stable tier exact on one
    step in --grpo-stable-interval, a compressed one every step."""
    if grpo.periodic:
        raise ValueError("the step-time model does not price periodic tiers "
                         "(--grpo-*-sync-interval > 1, --grpo-stable-mode local)")
    out = [(grpo.core_share, None if grpo.core_compressor == "none" else grpo.core_compressor),
           (grpo.dynamic_share, grpo.compressor)]
    if grpo.stable_share > 0:
        if grpo.stable_compressed:
            out.append((grpo.stable_share, grpo.stable_compressor))
        elif grpo.stable_interval:
            out.append((grpo.stable_share / grpo.stable_interval, None))
    return out


def decide(links: Sequence[Link], grpo, codec: Codec, cfg: StepTimeConfig) -> Dict[str, Dict[str, bool]]:
    """Per link, per format: whether it compresses (judged on one full unit, as the runtime's
    probe judges on a bucket)."""
    formats = sorted({f for _, f in tier_formats(grpo) if f is not None})
    return {link.name: {f: pays(grpo.bucket_elements, link, f, codec, cfg, grpo.compress_chunk)
                        for f in formats} for link in links}


def unit_sync(n: float, links: Sequence[Link], weights: Sequence[Tuple[float, Optional[str]]],
              decision: Optional[Dict[str, Dict[str, bool]]], codec: Codec,
              cfg: StepTimeConfig, chunk: int = 256) -> Sync:
    """Expected seconds of one unit's sync over the tiers' weights; ``decision`` None: exact."""
    out = Sync()
    for weight, fmt in weights:
        for link in links:
            used = fmt if fmt is not None and decision and decision[link.name].get(fmt) else None
            out.add(link_sync(n, link, used, codec, cfg, chunk), weight)
    return out


def reduce_scatter_delay(units: Sequence[int], syncs: Sequence[Sync], window: float,
                         slack: float, contention: float) -> float:
    """Seconds a stage's gradient sync adds to the step. Units leave in buffer (backward) order,
    each ready once the last micro-batch's backward (``window`` seconds, proportional to
    elements) has produced it; the link takes one at a time (codec, then wire). The stage's
    backward ends ``slack`` before the step's compute does (1F1B: stage k ends k backward
    passes before stage 0). Codec time run before the backward ends is charged x contention."""
    total, done, free, hidden = sum(units), 0, 0.0, 0.0
    for n, s in zip(units, syncs):
        done += n
        start = max(window * done / total, free)
        hidden += max(0.0, min(start + s.rs_codec, window) - start)
        free = start + s.rs_codec + s.rs_wire
    return max(0.0, free - window - slack) + contention * hidden


def gather_stall(units: Sequence[int], syncs: Sequence[Sync], window: float, slack: float) -> float:
    """megatron's --overlap-param-gather: units gathered back to back from the step's start,
    each needed when the first micro-batch's forward (``window``) reaches it (forward order is
    the buffer's reverse); the forward waits for the latest. Stage k starts k forwards late."""
    total, before, free, stall = sum(units), 0, 0.0, 0.0
    for n, s in zip(reversed(units), reversed(syncs)):
        free += s.ag_codec + s.ag_wire
        stall = max(stall, free - window * before / total)
        before += n
    return max(0.0, stall - slack)


@dataclass
class StepTime:
    """Predicted seconds per step of one preset on one cluster."""

    preset: str
    """The preset's label."""
    cluster: str
    """The cluster's label."""
    layout: str = ""
    """TP x PP x DP and the data-parallel group's ranks per node x nodes."""
    note: str = ""
    """Why there is no prediction (the layout needs more GPUs), else empty."""
    micro_batches: int = 0
    """Micro-batches per data-parallel rank and step (global batch / (micro-batch x DP))."""
    compute_s: float = 0.0
    """FLOPs / (GPUs x MFU x peak)."""
    megatron_s: float = 0.0
    """megatron-core DDP + distributed optimizer, overlap_grad_reduce, parameter gather after
    the optimizer step (overlap_param_gather off: megatron's default and the launcher's)."""
    megatron_opg_s: float = 0.0
    """The same with --overlap-param-gather (GRPO refuses that option)."""
    grpo_s: Dict[str, float] = field(default_factory=dict)
    """Per codec name: GRPO with the link-aware decision."""
    decisions: Dict[str, Dict[str, Dict[str, bool]]] = field(default_factory=dict)
    """Per codec name, per link, per format: what the runtime's probe rule chose."""
    fell_back: Dict[str, bool] = field(default_factory=dict)
    """Per codec name: the A/B of step time found the probe's choice slower than exact, so
    every tier syncs exactly (``grpo_s`` is then the exact path's)."""

    def ratio(self, codec: str) -> float:
        return self.grpo_s[codec] / self.megatron_s if self.megatron_s else 0.0


def step_from_stages(compute_s: float, t_b: float, t_f: float,
                     stages: Sequence[Tuple[Sequence[int], Sequence[int]]], links: Sequence[Link],
                     grpo, cfg: StepTimeConfig, codecs: Sequence[Codec] = CODECS,
                     result: Optional[StepTime] = None) -> StepTime:
    """The step from its compute and each pipeline stage's (megatron buckets, GRPO units), both
    in buffer order. ``t_b``/``t_f``: one micro-batch's backward/forward on one stage."""
    r = result or StepTime("", "")
    r.compute_s = compute_s
    exact = [(1.0, None)]
    chunk = grpo.compress_chunk
    rs, ag, ag_opg = [], [], []
    for k, (buckets, _) in enumerate(stages):
        # megatron: every element exact on every link (no codec: the codec argument is unused).
        syncs = [unit_sync(n, links, exact, None, FUSED, cfg, chunk) for n in buckets]
        rs.append(reduce_scatter_delay(buckets, syncs, t_b, k * t_b, cfg.contention))
        ag.append(sum(s.ag_wire for s in syncs))
        ag_opg.append(gather_stall(buckets, syncs, t_f, k * t_f))
    r.megatron_s = compute_s + max(rs) + max(ag)
    r.megatron_opg_s = compute_s + max(rs) + max(ag_opg)
    weights = tier_formats(grpo)

    def grpo_step(decision, codec: Codec) -> float:
        rs, ag = [], []
        for k, (_, units) in enumerate(stages):
            syncs = [unit_sync(n, links, weights, decision, codec, cfg, chunk) for n in units]
            rs.append(reduce_scatter_delay(units, syncs, t_b, k * t_b, cfg.contention))
            ag.append(sum(s.ag_codec + s.ag_wire for s in syncs))  # after the optimizer step
        return compute_s + max(rs) + max(ag)

    for codec in codecs:
        decision = decide(links, grpo, codec, cfg)
        r.decisions[codec.name] = decision
        chosen = grpo_step(decision, codec)
        if any(on for formats in decision.values() for on in formats.values()):
            # The runtime's A/B: the probe's choice stays only where the step is faster than
            # the same run synced exactly (the probe sees sync time, not what overlap hid).
            exact_step = grpo_step(None, codec)
            if chosen >= exact_step:
                r.fell_back[codec.name], chosen = True, exact_step
        r.grpo_s[codec.name] = chosen
    return r


def predict(model, tp: int, pp: int, grpo, cluster: Cluster, cfg: StepTimeConfig = StepTimeConfig(),
            bucket_size: Optional[int] = None, preset: str = "",
            codecs: Sequence[Codec] = CODECS) -> StepTime:
    """Step time of ``model`` (a planner ModelSpec) at TP ``tp`` x PP ``pp`` on ``cluster``:
    megatron, and GRPO (``grpo``) with each codec. A layout that does not fit the cluster's
    GPUs comes back with ``note`` set and no times."""
    r = StepTime(preset, cluster.name)
    world = cluster.nodes * cluster.gpus_per_node
    if world % (tp * pp):
        r.note = f"TP x PP = {tp * pp} needs a multiple of {tp * pp} GPUs, not {world}"
        return r
    spec = ClusterSpec(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, tp=tp, pp=pp)
    try:
        spec.validate(model)
    except ValueError as exc:  # e.g. a global batch the data-parallel size does not divide
        r.note = str(exc)
        return r
    dp = spec.dp
    links = dp_links(cluster, tp, dp)
    per_node = dp_per_node(cluster, tp, dp)
    r.layout = f"{tp} x {pp} x {dp} ({per_node} x {dp // per_node})"
    r.micro_batches = m = model.micro_batches(dp, pp)
    tokens = m * model.micro_batch_size * dp * model.seq_length
    compute_s = exact_step_flops(model, tokens) / (world * cfg.gpu.mfu * cfg.gpu.peak_flops)
    # 1F1B: (m + pp - 1) slots of one forward and one backward per stage; full recompute
    # repeats the forward inside the backward.
    backward = 0.75 if model.recompute_granularity == "full" else 2 / 3
    slot = compute_s / (m + pp - 1)
    bucket = bucket_size or default_bucket_elements(dp)
    stages = []
    for st in range(pp):
        numels = stage_param_numels(model, spec, st)
        # megatron buckets only the first stage; later ones sync in one bucket.
        stages.append((ddp_bucket_numels(numels, bucket if st == 0 else None, dp),
                       ddp_bucket_numels(numels, grpo.bucket_elements, dp)))
    return step_from_stages(compute_s, backward * slot, (1 - backward) * slot, stages, links, grpo,
                            cfg, codecs, r)


def decision_text(r: StepTime, codec: str) -> str:
    """e.g. ``NVLink: exact; IB: int8+int4``; ``, A/B: exact`` when the A/B turned it off."""
    decision = r.decisions[codec]
    if not decision:
        return "no DP sync"
    parts = []
    for link, formats in decision.items():
        used = [f for f in sorted(formats, key=lambda f: -FORMAT_BYTES[f]) if formats[f]]
        parts.append(f"{link}: {'+'.join(used) if used else 'exact'}")
    return "; ".join(parts) + (", A/B: exact" if r.fell_back.get(codec) else "")


def format_steptime(rows: Sequence[StepTime], cfg: StepTimeConfig = StepTimeConfig()) -> str:
    """The markdown table launch/plan.py --step-time prints (docs/planner.md)."""
    g = cfg.gpu
    head = (f"Modelled, not measured: H100 SXM {g.peak_flops / 1e12:g} TFLOP/s at {g.mfu:.0%} MFU; "
            f"exact path {8 * cfg.grad_bytes}-bit gradients + {8 * cfg.param_bytes}-bit parameters; "
            f"HBM {g.hbm_bytes_per_s / 1e12:g} TB/s at {g.hbm_efficiency:.0%}; "
            f"launch {g.launch_s * 1e6:g} us; "
            f"a format pays at <= {cfg.pays:g} x the exact time.")
    lines = [head, "",
             "| preset | cluster | TP x PP x DP (DP per node x nodes) | micro-batches | compute, s "
             "| megatron, s (+DP ms) | GRPO eager, s (ratio) | GRPO fused, s (ratio) "
             "| compresses: eager | compresses: fused | megatron --overlap-param-gather, s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.note:
            lines.append(f"| {r.preset} | {r.cluster} | n/a: {r.note} | | | | | | | | |")
            continue
        dp_ms = (r.megatron_s - r.compute_s) * 1e3
        cells = [f"{r.grpo_s[c]:.3f} ({r.ratio(c):.4f})" for c in ("eager", "fused")]
        lines.append(f"| {r.preset} | {r.cluster} | {r.layout} | {r.micro_batches} | {r.compute_s:.3f} "
                     f"| {r.megatron_s:.3f} (+{dp_ms:.1f}) | {cells[0]} | {cells[1]} "
                     f"| {decision_text(r, 'eager')} | {decision_text(r, 'fused')} "
                     f"| {r.megatron_opg_s:.3f} |")
    return "\n".join(lines)


def format_break_even(units: int, cfg: StepTimeConfig = StepTimeConfig(), chunk: int = 256,
                      ranks: Sequence[int] = (2, 4, 8, 16)) -> str:
    """Lines naming each codec's and format's break-even busbw for one full unit."""
    out = [f"break-even busbw (GB/s) of a {units * 4 / 2 ** 20:g} MB unit against the exact "
           f"{8 * cfg.grad_bytes}-bit path (compression pays below it):"]
    for codec in CODECS:
        for fmt in ("int8", "int4"):
            cells = ", ".join(
                f"{k} ranks {break_even_gbs(units, Link('', k, 1, 1.0), fmt, codec, cfg, chunk):.1f}"
                for k in ranks)
            out.append(f"- {codec.name} {fmt}: {cells}")
    return "\n".join(out)
