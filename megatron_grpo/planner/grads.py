"""The planner's gradient and residual memory with --grpo-release-grads, and the
memory tier's placement of state (--grpo-offload).

Megatron keeps one gradient buffer for the whole model, resident all the time (the baseline,
and GRPO with --no-grpo-release-grads). With release (megatron_grpo/megatron/grad_storage.py)
each tier unit has storage of its own, on one rank:

* it is allocated when backward writes the unit's first gradient and freed once the unit's
  sync has finished; then only the rank's shard (unit / intra-instance DP, fp32) stays, until
  the optimizer step ends. With --overlap-grad-reduce at most --grpo-grad-units-in-flight syncs
  are outstanding (a new one first waits for the oldest), so that many units plus the one being
  filled are full at once; without it every sync runs after backward;
* several micro-batches accumulate: every unit is full from the first micro-batch until its
  sync in the last one;
* frozen stable units between updates hold nothing; delayed ones keep their full gradient to
  the step's end (it is added into their accumulator then);
* parameters megatron reads after the sync keep an own copy of their gradient to the step's end;
* the error-feedback residuals of compressed units are stored in --grpo-residual-dtype, and a
  new one is staged at each unit's sync beside the committed one (kept for a skipped step);
* the first iteration is megatron's "first batch" (every sync after backward) and GRPO's exact
  warm-up, before Adam has created its moments.

The peak is the larger of the steady step's (a stable update step or one between updates) and
the first iteration's. Within a step the bytes are followed unit by unit in the order backward
reaches them, with activations freed in proportion to the gradient elements reached.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_grpo.comm.analytic import ddp_bucket_numels
from megatron_grpo.grpo.config import TIERS

RESIDUAL_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def residual_bytes(numel: int, dtype: str, chunk: int) -> int:
    """One error-feedback residual of ``numel`` elements stored as ``dtype``
    (--grpo-residual-dtype). int8 is the int8 compressor's payload, one row per ``chunk``
    elements: an fp32 scale and the codes, the last chunk zero-padded
    (comm/error_feedback.py ``QuantisedResidual``)."""
    if dtype == "int8":
        return -(-numel // chunk) * (4 + -(-chunk // 4) * 4)
    return RESIDUAL_BYTES[dtype] * numel


@dataclass
class UnitGrads:
    """One tier unit's gradient memory in one kind of step; the weights are shares of the unit
    (0 or 1 with explicit tiers, the quota shares otherwise)."""

    numel: int
    """Padded elements of the unit."""
    full: int
    """Bytes of its full fp32 storage."""
    shard: int
    """Bytes of this rank's shard, kept from the sync to the step's end."""
    late: int
    """Bytes of the own gradient copies of parameters megatron reads after the sync."""
    residual: int
    """Bytes of one of its residuals in --grpo-residual-dtype."""
    syncs: float
    """Share synced this step: its full storage is released at the sync."""
    held: float
    """Share full to the step's end without a sync (delayed stable units between updates)."""
    compressed: float
    """Share with an error-feedback residual (a new one staged at its sync)."""
    away: float = 0.0
    """Share whose shard the memory tier writes out at the sync (--grpo-offload-grads: the units
    the optimizer step streams); resident only while its write is among the last few."""


@dataclass
class GradMoment:
    """Bytes on one rank at one moment of a step: gradients, staged residuals, activations."""

    total: float = 0.0
    """Everything below but ``freed``: activations still held + gradients + staged residuals."""
    full: float = 0.0
    """Units holding their whole gradient (filling, or with a sync in flight)."""
    held: float = 0.0
    """Delayed stable units between updates, full until the step ends."""
    shards: float = 0.0
    """This rank's shards of the units whose sync has finished."""
    late: float = 0.0
    """Own copies of the parameters megatron reads after the sync."""
    staged: float = 0.0
    """New error-feedback residuals staged at the syncs so far."""
    freed: float = 0.0
    """Activations backward has freed by then."""

    @property
    def grads(self) -> float:
        return self.full + self.held + self.shards + self.late


def grad_timeline(units: Sequence[UnitGrads], activations: int, window: Optional[float],
                  prefilled: bool, release: bool = True,
                  events: Optional[Sequence[Tuple[int, float]]] = None,
                  last_activations: Optional[int] = None) -> Tuple[GradMoment, float]:
    """One rank through a step's last backward and the syncs that end it. ``events``: (unit
    index, activation bytes freed once its gradient is written) of each parameter in the order
    backward writes the gradients (``backward_order``); None: each unit at once, in unit order
    (megatron's buffer order: bucket 0 holds the last layers), activations freed in proportion
    to the elements written. A unit is allocated at its first gradient and synced after its
    last. ``window``: --grpo-grad-units-in-flight with --overlap-grad-reduce (a sync stages its
    residual, then waits for the oldest beyond the window); None: every sync after backward
    (no overlap, or megatron's first batch). ``prefilled``: earlier micro-batches made every
    unit full. ``release`` False: megatron's one buffer (pass it ``prefilled``), whose units
    stay full; only the staged residuals come and go. ``activations``: held at the end of
    forward (with the gradients of earlier micro-batches when ``prefilled``);
    ``last_activations`` (default the same): held when this last backward begins, which with
    pipeline parallelism is one micro-batch's. Returns the moment with the most bytes and the
    most gradient bytes at any moment."""
    last = activations if last_activations is None else last_activations
    if events is None:
        elements, done, events = sum(u.numel for u in units) or 1, 0, []
        for i, u in enumerate(units):
            done += u.numel
            events.append((i, last * done / elements))
    now, best, peak = GradMoment(), GradMoment(), [0.0]
    if prefilled:
        now.full = sum(u.syncs * u.full for u in units)
        now.held = sum(u.held * u.full for u in units)
    left = [0] * len(units)
    for i, _ in events:
        left[i] += 1

    held = [activations]

    def record() -> None:
        nonlocal best
        now.total = held[0] - now.freed + now.grads + now.staged
        peak[0] = max(peak[0], now.grads)
        if now.total > best.total:
            best = GradMoment(**vars(now))
            best.freed += activations - held[0]  # the other micro-batches' too

    def sync_done(u: UnitGrads) -> None:
        if not release:
            return
        now.full -= u.syncs * u.full
        now.shards += u.syncs * u.shard
        now.late += u.syncs * u.late
        record()
        if u.away * u.syncs:
            # Written out at once; the store frees the oldest beyond its writes in flight.
            writes.append(u.away * u.syncs * u.shard)
            while len(writes) > SHARD_WRITES_RESIDENT:
                now.shards -= writes.popleft()

    started, in_flight, writes = set(), deque(), deque()
    record()  # the end of forward (the busiest of 1F1B with pipeline parallelism)
    held[0] = last
    for i, freed in events:
        u = units[i]
        now.freed = freed  # what this parameter's module backward has released (frozen too)
        if (u.syncs or u.held) and i not in started:  # a frozen unit writes no gradient
            started.add(i)
            if not prefilled:
                now.full += u.syncs * u.full
                now.held += u.held * u.full
            record()
        left[i] -= 1
        if not left[i] and u.syncs and window is not None:
            now.staged += u.compressed * u.residual
            record()
            if len(in_flight) >= window:  # the oldest sync is waited for
                sync_done(in_flight.popleft())
            in_flight.append(u)
    for u in (in_flight if window is not None else [u for u in units if u.syncs]):
        if window is None:
            now.staged += u.compressed * u.residual
            record()
        sync_done(u)
    record()
    return best, peak[0]


SHARD_WRITES_RESIDENT = 3
"""Gradient shards written out and still resident (--grpo-offload-grads): the store keeps its
last writes in flight, lookahead + 1 (megatron_grpo/offload/residuals.py)."""


def backward_order(layers: int, pre: bool, post: bool, position_table: bool, norm_bias: bool,
                   bias: bool) -> List[Tuple[int, Tuple[str, ...]]]:
    """(index, activation parts freed by the time its gradient is written) of a stage's
    parameters (``analytic.gpt_param_numels`` order, megatron's registration order) in the
    order backward writes their gradients, as measured on megatron-core's local spec
    (tests/multiproc/planner_probe.py): registration order reversed, except that in each layer
    linear_proj (registered before linear_qkv, used after it) comes before linear_qkv; a bias
    added after its matmul (row-parallel biases in bias-dropout-add, linear_fc1's in the
    activation) comes before its weight, one added inside it (linear_qkv's) and a norm's
    after. The parts are ``activations.backward_freed_bytes``'s: "head" at the output layer
    (the loss's and the output layer's saved tensors), a layer's parts
    (``activations.layer_activation_parts``) at the step of backward that frees them,
    "embedding" at the word embedding."""
    norm, lin = (2 if norm_bias else 1), (2 if bias else 1)
    start = (2 if position_table else 1) if pre else 0
    out: List[Tuple[int, Tuple[str, ...]]] = []
    if post:
        base = start + layers * (2 * norm + 4 * lin)
        out += [(base + norm, ("head",))] + [(i, ()) for i in range(base, base + norm)]
    for k in reversed(range(layers)):
        ln1 = start + k * (2 * norm + 4 * lin)
        proj, qkv = ln1 + norm, ln1 + norm + lin
        ln2 = qkv + lin
        fc1, fc2 = ln2 + norm, ln2 + norm + lin
        if bias:  # a bias added after the matmul: its gradient first
            out += [(fc2 + 1, ()), (fc2, ("fc2",)), (fc1 + 1, ("act",)), (fc1, ("fc1",))]
        else:
            out += [(fc2, ("fc2",)), (fc1, ("act", "fc1"))]
        out += [(ln2, ("ln2",))] + [(i, ()) for i in range(ln2 + 1, ln2 + norm)]
        out += [(proj + 1, ()), (proj, ("proj",))] if bias else [(proj, ("proj",))]
        out += [(qkv, ("attention",))] + [(i, ()) for i in range(qkv + 1, qkv + lin)]
        out += [(ln1, ("ln1",))] + [(i, ()) for i in range(ln1 + 1, ln1 + norm)]
    if pre:  # position table, then word embedding
        out += [(i, ("embedding",) if i == 0 else ()) for i in reversed(range(start))]
    return out


def param_units(numels: Sequence[int], bucket_size: Optional[int], dp: int) -> List[int]:
    """The unit (DDP bucket, buffer order) of each parameter: ``analytic.ddp_bucket_numels``'s
    walk over the parameters in reverse, recording where each lands."""
    unit_of = [0] * len(numels)
    bucket, bucket_start, start = 0, 0, 0
    for index in reversed(range(len(numels))):
        start = -(-start // 64) * 64
        end = start + numels[index]
        unit_of[index] = bucket
        if bucket_size is not None and end - bucket_start >= bucket_size:
            bucket_start = start = -(-end // math.lcm(dp, 128)) * math.lcm(dp, 128)
            bucket += 1
        else:
            start = end
    return unit_of


def roles(grpo, update: bool, ef_tiers: set) -> Dict[str, Tuple[float, float, float]]:
    """(syncs, held, compressed) of a whole unit of each tier, on a stable update step or not
    (``grpo``: the GRPOConfig)."""
    stable_syncs = grpo.stable_every_step or (update and grpo.stable_interval > 0)
    stable = (1.0, 0.0) if stable_syncs else (0.0, 1.0 if grpo.stable_delayed else 0.0)
    out = {"core": (1.0, 0.0), "dynamic": (1.0, 0.0), "stable": stable}
    return {t: (*out[t], 1.0 if t in ef_tiers else 0.0) for t in TIERS}


def step_units(units: List[int], weights: List[Dict[str, float]], residuals: List[int],
               late: List[int], shard_ranks: int,
               unit_roles: Dict[str, Tuple[float, float, float]]) -> List[UnitGrads]:
    return [UnitGrads(n, 4 * n, 4 * (n // shard_ranks), lt, r,
                      *(sum(w[t] * unit_roles[t][i] for t in TIERS) for i in range(3)))
            for n, w, r, lt in zip(units, weights, residuals, late)]


def release_memory(g, grpo, units: List[int], weights: List[Dict[str, float]],
                   residuals: List[int], late: List[int], ef_tiers: set, shard_ranks: int,
                   micro_batches: int, overlap_grad_reduce: bool,
                   events: Optional[Sequence[Tuple[int, float]]] = None,
                   last_activations: Optional[int] = None, streamed: bool = False,
                   shards_away: bool = False, core_away: bool = False) -> None:
    """Set the gradient and staged-residual fields of ``g`` (a planner Memory) to the steady
    peak's moment, ``g.grad_peaks`` and ``g.step_peaks`` by kind of step and, with
    --grpo-release-grads, ``g.first_iteration`` to the first iteration's peak. ``events``
    and ``last_activations``: ``grad_timeline``'s. ``shards_away``: the memory tier moves the
    gradient shards of the units its optimizer step streams (the dynamic and stable tiers; every
    unit in the warm-up, hence the first iteration). ``streamed``: the memory tier streams the
    optimizer step, so through the first iteration the masters are away but the two units'
    streaming (4 bytes per shard element each)."""
    release = grpo.release_grads
    prefilled = micro_batches > 1 or not release
    # Without release megatron's own overlap: every sync starts as its unit is ready.
    window = None if not overlap_grad_reduce else grpo.grad_units_in_flight if release else math.inf
    # Everything but gradients, staged residuals and activations: the same all step long.
    base = (g.params + g.master_params + g.optimizer_moments + g.error_feedback
            + g.delayed_accumulators + g.outer_state - g.offloaded)
    best = None
    for kind in ("between", "update"):
        step = step_units(units, weights, residuals, late, shard_ranks,
                          roles(grpo, kind == "update", ef_tiers))
        if not release:  # every unit's storage is there all the time
            step = [dataclasses.replace(u, syncs=1.0, held=0.0) for u in step]
        elif shards_away:
            step = [dataclasses.replace(u, away=w["dynamic"] + w["stable"] + (w["core"] if core_away else 0.0))
                    for u, w in zip(step, weights)]
        moment, g.grad_peaks[kind] = grad_timeline(step, g.activations, window, prefilled, release,
                                                   events, last_activations)
        g.step_peaks[kind] = round(base + moment.total)
        if best is None or moment.total > best.total:
            best = moment
    g.error_feedback_staged, g.activations_freed = round(best.staged), round(best.freed)
    if release:
        g.grads, g.grads_full, g.grads_held = round(best.grads), round(best.full), round(best.held)
        g.grad_shards, g.grad_late_copies = round(best.shards), round(best.late)
    # The first iteration: every unit core, exact and synced after backward; no moments,
    # residuals or accumulators. Without release it holds less than any later step.
    first = [UnitGrads(n, 4 * n, 4 * (n // shard_ranks), lt, 0, 1.0, 0.0, 0.0,
                       1.0 if shards_away else 0.0)
             for n, lt in zip(units, late)]
    # megatron's first batch syncs after backward, unless GRPO starts each sync as its unit is
    # ready (--grpo-first-batch-overlap, with release and overlap).
    early = release and grpo.first_batch_overlap and window is not None
    moment, g.grad_peaks["first"] = grad_timeline(first, g.activations, window if early else None,
                                                  prefilled, release, events, last_activations)
    masters_away = max(0.0, g.master_params - 2 * 4 * max(units) / shard_ranks) if streamed else 0.0
    g.step_peaks["first"] = round(g.params + g.master_params - masters_away + moment.total)
    g.first_iteration = g.step_peaks["first"] if release else 0
    g.grad_peaks = {k: round(v) for k, v in g.grad_peaks.items()}


def late_bytes(pp: int, stage: int, rope: bool, numels: List[int], bucket_elements: int,
               pad_dp: int, n_units: int) -> List[int]:
    """Bytes of the own gradient copies each unit keeps after its sync: megatron's
    finalize_model_grads reads the position embedding's gradient after the sync with pipeline
    parallelism (grad_storage.reads_after_sync; the planner has no sequence parallelism and no
    tied embedding). It is the stage's second parameter, so in the bucket closed after it."""
    out = [0] * n_units
    if pp > 1 and stage == 0 and not rope:
        out[len(ddp_bucket_numels(numels[1:], bucket_elements, pad_dp)) - 1] = 4 * numels[1]
    return out


# ------------------------------------------------------------ the memory tier's placement
def place(g, units: List[int], elements: Dict[str, float], shard: float, dp: int,
          stream: bool, residuals: bool = False, stable_every_step: bool = False,
          unit_residual: int = 0, unit_accumulator: int = 0, core: bool = False) -> None:
    """The memory tier's effect on ``g`` (a planner Memory of one rank) (megatron_grpo/offload/placement.py). Streaming:
    the dynamic and stable units' masters and moments (12 bytes per shard element; the core
    units' too with ``core``) are away at the peak but for two units' worth. Without streaming
    only the stable tier's state moves, and only between its updates (the peak, an update step, keeps it); a stable tier synced
    every step (--grpo-stable-mode compressed) has no such gap and stays resident.
    ``unit_residual``: bytes of the largest unit's residual (committed residuals away but for
    three of them; staged ones are counted resident). ``unit_accumulator``: bytes of the largest
    stable unit's delayed accumulator: they are away but for three too (comm/accumulators.py;
    the update step reads them in backward like the residuals)."""
    total = sum(elements.values()) or 1.0
    share = {t: elements[t] / total for t in elements}
    if stream:  # --grpo-offload-core: the core tier's state streams too
        away = share["dynamic"] + share["stable"] + (share["core"] if core else 0.0)
        g.offloaded = max(0, round(12 * shard * away - stream_window_bytes(units, dp)))
    elif not stable_every_step:
        g.offloaded_between_updates = round(12 * shard * share["stable"])
    if residuals and g.error_feedback:
        # Backward reads residuals lookahead (2) ahead: three buckets' worth resident.
        g.offloaded += max(0, g.error_feedback - RESIDUALS_RESIDENT * unit_residual)
    if g.delayed_accumulators:
        g.offloaded += max(0, round(g.delayed_accumulators - RESIDUALS_RESIDENT * unit_accumulator))


RESIDUALS_RESIDENT = 3
"""Error-feedback residuals (and delayed accumulators) resident at backward's peak with the
memory tier: the one being read and the two read ahead (megatron_grpo/offload/residuals.py,
lookahead 2)."""


def stream_window_bytes(units: List[int], dp: int) -> float:
    """State two units' shards keep resident while the optimizer step streams."""
    return 2 * 12 * max(units) / dp
