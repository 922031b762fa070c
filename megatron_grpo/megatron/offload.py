"""The memory tier's megatron glue: which tensors of megatron's distributed optimizer belong to
which GRPO tier unit, and the TierPlacement that moves them (megatron_grpo.offload.placement).

Per parameter shard this rank owns, the placed state is the fp32 master shard (GRPO gives fp32
params their own master storage, megatron does for bf16) and the inner optimizer's
per-element state (Adam's exp_avg and exp_avg_sq; TE FusedAdam's master_param with the
precision-aware optimizer); scalar state (torch Adam's step) stays. The inner optimizer is the
one megatron picks: TE's FusedAdam, apex's, or torch's AdamW (megatron_grpo/platform/fused_adam.py has
the fused ones' semantics on CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from megatron_grpo.comm.error_feedback import residual_nbytes
from megatron_grpo.megatron.grad_shards import GradShards
from megatron_grpo.megatron.optimizer import grpo_optimizers
from megatron_grpo.megatron.options import check_grad_shards, check_separate_norm_groups
from megatron_grpo.offload import ChunkStore, OffloadConfig
from megatron_grpo.offload.placement import TierPlacement, planned_bytes
from megatron_grpo.offload.residuals import OffloadedResiduals

# Adam keeps two per-element moments; the SSD file is sized for them and the master up front,
# before the moments exist (torch creates them at a parameter's first update).
PER_ELEMENT_STATES = 3


def unit_state(optimizer, ctrl) -> Dict[Tuple[int, str], List[Tuple[str, torch.Tensor]]]:
    """{(unit index, "master" | "moments"): [(name, tensor)]} of this rank's offloadable
    optimizer state."""
    out: Dict[Tuple[int, str], List[Tuple[str, torch.Tensor]]] = {}
    for oi, opt in enumerate(grpo_optimizers(optimizer)):
        for key, pairs in _opt_state(oi, opt, ctrl).items():
            out.setdefault(key, []).extend(pairs)
    return out


def _opt_state(oi: int, opt, ctrl, only_unit: Optional[int] = None):
    """unit_state of one GRPO optimizer (index ``oi``), or of one of its units."""
    out: Dict[Tuple[int, str], List[Tuple[str, torch.Tensor]]] = {}
    for pi, (model_param, shard) in enumerate(opt._pairs()):
        unit = ctrl.unit_of_bucket[id(opt._bucket_of(model_param))]
        if only_unit is not None and unit != only_unit:
            continue
        out.setdefault((unit, "master"), []).append((f"opt{oi}.p{pi}.master", shard))
        moments = out.setdefault((unit, "moments"), [])
        for key, value in opt.optimizer.state.get(shard, {}).items():
            if torch.is_tensor(value) and value.numel() == shard.numel() and value.numel() > 1:
                moments.append((f"opt{oi}.p{pi}.{key}", value))
    return out


def build_placement(config: OffloadConfig, optimizer, ctrl, rank: int) -> Optional[TierPlacement]:
    """The run's TierPlacement, or None with --grpo-offload none. The store (and its SSD file,
    sized for every offloadable tensor of the rank) is made now, before step 1, so a missing,
    unwritable or too small --grpo-offload-dir fails before any training."""
    if config.target == "none":
        return None
    sizes = []
    for opt in grpo_optimizers(optimizer):
        # TE FusedAdam's master_weights (the precision-aware optimizer) adds an fp32 master.
        per_element = PER_ELEMENT_STATES + bool(getattr(opt.optimizer, "master_weights", False))
        sizes += [shard.numel() * 4 for _, shard in opt._pairs() for _ in range(per_element)]
    residuals = config.residuals and ctrl.config.compressor != "powersgd"
    if residuals:  # room for a residual of every bucket (any unit may become dynamic),
        # in its storage dtype (--grpo-residual-dtype: 4, 2 or about 1 byte per element)
        sizes += [residual_nbytes(b.grad_data.numel(), ctrl.config.residual_dtype,
                                  ctrl.config.compress_chunk)
                  for u in ctrl.units for b in u.group.buckets]
    delayed = ctrl.config.stable_delayed
    if delayed:  # and for an accumulator of every bucket (any unit may become stable)
        sizes += [b.grad_data.numel() * b.grad_data.element_size()
                  for u in ctrl.units for b in u.group.buckets]
    shards = _grad_storages(ctrl) if moves_grads(config, optimizer, ctrl) else []
    if shards:  # and for this rank's gradient shard of every bucket
        # Refused before the store exists and before step 1: a gradient brought back is clipped
        # by the main norm, one in a separate grad-norm group by its own (megatron 0.19, MTP).
        check_separate_norm_groups(_shards_that_may_leave(optimizer, ctrl), rank)
        # megatron divides gradients by the step's token count after the sync (per-token
        # loss), when a streamed unit's shard is already away: refused here, not at that step.
        check_grad_shards([getattr(c, "config", None) for opt in grpo_optimizers(optimizer)
                           for c in getattr(opt, "model_chunks", None) or []], rank)
        sizes += [b.grpo_grads.shard_len * b.grad_data.element_size()
                  for u in ctrl.units for b in u.group.buckets]
    store_cfg = dataclasses.replace(config)
    if config.target == "ssd":
        if not store_cfg.capacity:
            store_cfg.capacity = max(4096, planned_bytes(sizes, config.chunk_bytes))
    else:
        store_cfg.offload_dir = None
    store = ChunkStore(store_cfg, rank=rank)
    target = config.target
    if store.ssd_fallback:  # --grpo-offload-fallback cpu: said on every rank it happens to
        print(f"[grpo-offload] rank {rank}: {store.ssd_fallback} Falling back to host memory "
              f"(--grpo-offload-fallback cpu): offloaded state goes to host memory instead.",
              flush=True)
        target = "cpu"
    placement = TierPlacement(store, target, stream=config.stream, stream_core=config.core)
    if residuals:
        # PowerSGD's residuals are new tensors every step; they stay in memory.
        placement.residuals = OffloadedResiduals(store, target)
        ctrl.ef.use_store(placement.residuals)
    if delayed:
        # The delayed stable tier's gradient sums leave with the rest of the stable tier's
        # state: resident only while read, added to, or read by an update.
        placement.accumulators = OffloadedResiduals(store, target, prefix="accum")
        ctrl.accum.use_store(placement.accumulators)
    if shards:
        # Gradient shards of the units the optimizer step streams leave right after their
        # sync and come back for their unit's update (megatron/grad_shards.py).
        placement.grads = OffloadedResiduals(store, target, prefix="grad")
        grad_shards = GradShards(placement.grads, placement, ctrl, grpo_optimizers(optimizer))
        for storage in shards:
            storage.shards = grad_shards
        for opt in grpo_optimizers(optimizer):
            opt.grad_shards = grad_shards
    for oi, opt in enumerate(grpo_optimizers(optimizer)):
        opt.placement = placement
        if config.stream:
            _window_inner_step(oi, opt, placement, ctrl)
    return placement


def moves_grads(config: OffloadConfig, optimizer, ctrl) -> bool:
    """Do gradient shards go through the placement (--grpo-offload-grads)? They need gradient
    release (shards of their own), the streamed optimizer step (which reads them back), one
    distributed optimizer (with several, megatron's chained step takes the norm over all of
    them itself, so the clipping of shards read back later could not know it) and no zero
    count (megatron counts zeros in every gradient before the step)."""
    opts = grpo_optimizers(optimizer)
    return (config.target != "none" and config.stream and config.grads and len(opts) == 1
            and not opts[0].config.log_num_zeros_in_grad and bool(_grad_storages(ctrl)))


def _shards_that_may_leave(optimizer, ctrl):
    """(unit, model param, shard main param) of every parameter whose gradient shard the memory
    tier may hold away: any unit streams in warm-up; a late param's own copy stays."""
    for opt in grpo_optimizers(optimizer):
        for model_param, shard in opt._pairs():
            bucket = opt._bucket_of(model_param)
            grads = getattr(bucket, "grpo_grads", None)
            if grads is not None and model_param in grads.late:
                continue
            yield ctrl.unit_of_bucket[id(bucket)], model_param, shard


def _grad_storages(ctrl) -> list:
    out = {}
    for u in ctrl.units:
        storage = getattr(u.group, "grpo_storage", None)
        if storage is not None:
            out[id(storage)] = storage
    return list(out.values())


def _window_inner_step(oi: int, opt, placement: TierPlacement, ctrl) -> None:
    """Replace the inner optimizer's step with one that updates the resident units in one call,
    then the streamed units one at a time through ``placement.stream``, each followed by the
    copy of its new weights to the model (the last read of its master), so its state can leave
    at once. Adam's update is per element and per parameter (each parameter is stepped exactly
    once, with the step's own lr), so the result is bit for bit the single call's; only what is
    resident meanwhile differs. That holds for every Adam megatron picks (torch's, TE's and
    apex's FusedAdam) because each call sees only its own parameters (``_only``) and the group
    step counters advance once per iteration (``GroupCounters``)."""
    inner = opt.optimizer
    whole_step = inner.step
    counters = GroupCounters(inner)

    def step_only(params, closure=None):
        with counters.call(params), _only(inner, params):
            return whole_step(closure)

    def windowed_step(closure=None):
        windows = placement.windows(ctrl.step.stable_update)
        unit_of = {id(shard): ctrl.unit_of_bucket[id(opt._bucket_of(mp))] for mp, shard in opt._pairs()}
        streamed, rest = {}, []
        wanted = set(windows)
        away = {id(shard) for pairs in opt._grads_away.values() for _, shard in pairs}
        for group in inner.param_groups:
            for p in group["params"]:
                if _grad(p) is None and id(p) not in away:  # a gradient away comes back
                    continue
                unit = unit_of.get(id(p))
                if unit in wanted:
                    streamed.setdefault(unit, []).append(p)
                else:
                    rest.append(p)
        counters.begin()
        result = step_only(rest, closure) if rest else None

        def update(unit):
            opt.bring_grads(unit)
            step_only(streamed[unit])
            # Adam creates a parameter's moments at its first update: registered now, they
            # leave with this unit's state. Registered only at the next step, every unit's
            # new moments would be resident together until then: the run's peak, 8 bytes per
            # shard element above the streamed steps' (measured: +306 MB per rank at 93 M
            # parameters, bench memcap).
            placement.add(_opt_state(oi, opt, ctrl, only_unit=unit))
            opt._copy_main_params_to_model_params(units={unit})
            _free_unit_grads(ctrl, unit, streamed[unit])

        placement.stream([w for w in windows if w in streamed], update)
        counters.end()
        still_away = opt.grads_still_away()
        if still_away:  # would be a unit silently not updated
            raise RuntimeError(f"GRPO memory tier: gradients of units {still_away} "
                               f"went away but their units were not in this step's stream")
        # A streamed unit with no gradient on this rank was not stepped, so its weights did
        # not change, and its master is away: megatron's copy after the step must skip it.
        opt._grpo_copied_units.update(w for w in windows if w not in streamed)
        return result

    inner.step = windowed_step


def _free_unit_grads(ctrl, unit: int, params) -> None:
    """With gradient release (megatron/grad_storage.py) the unit's gradient shards are spent
    once it is updated: free them now rather than at the step's end, so the streamed step
    holds the shards of the units still to come, not all of them."""
    units = getattr(ctrl, "units", None)
    group = units[unit].group if units is not None else None
    storage = getattr(group, "grpo_storage", None)
    if storage is None or any(ctrl.ef.references_grad((unit, i)) for i in range(len(group.buckets))):
        return
    for p in params:
        p.grad = None
    for b in group.buckets:
        b.grpo_grads.drop()
    storage.released()


def _grad(p):
    # TE FusedAdam with the precision-aware optimizer reads the gradient from decoupled_grad.
    grad = getattr(p, "decoupled_grad", None)
    return p.grad if grad is None else grad


@contextlib.contextmanager
def _only(inner, params):
    """The inner optimizer sees only ``params`` for one step() call: every param group keeps
    just those of its params, and groups left with none are hidden.

    Hiding the other params' gradients is not enough: TE's FusedAdam makes the state of every
    parameter it is handed at its first step(), gradient or not (all units' moments resident
    at once: the tier's peak promise broken), and apex's indexes group["params"][0], so an
    empty group must not be handed to it at all. The group dicts themselves stay the same
    objects (lr, weight decay and the group step counter live there)."""
    wanted = {id(p) for p in params}
    groups = inner.param_groups
    saved = [g["params"] for g in groups]
    kept = []
    for g, ps in zip(groups, saved):
        mine = [p for p in ps if id(p) in wanted]
        if mine:
            g["params"] = mine
            kept.append(g)
    inner.param_groups = kept
    try:
        yield
    finally:
        inner.param_groups = groups
        for g, ps in zip(groups, saved):
            g["params"] = ps


_MISSING = object()


def _copy(value):
    return value.clone() if torch.is_tensor(value) else value


class GroupCounters:
    """TE's and apex's FusedAdam keep one step counter per param group (``group["step"]``) and
    advance it at every step() call, for every group they are handed; Adam's bias correction
    uses it. The windowed step calls step() once per streamed unit, which would advance it
    that many times per iteration (a CPU reproduction: 210 after 10 iterations of 20 units).

    So every call of one iteration starts from the counters as they were before the iteration
    (each sees the value one call would see), and at the end each group holds the value its
    calls gave it. A group handed to no call this iteration (all its params without a
    gradient: a stable unit between updates) advances as one step() call would have advanced
    it (TE and apex: by one, for every non-empty group), once the optimizer has been seen to
    keep group counters. Torch's Adam keeps its counters per parameter (``state["step"]``):
    its group dicts never change here, and nothing is done."""

    def __init__(self, inner):
        self.inner = inner
        self.keeps_group_counters = False  # seen to advance group["step"] in a step() call
        self.groups: list = []
        self.before: list = []
        self.after: dict = {}

    def begin(self) -> None:
        self.groups = list(self.inner.param_groups)
        self.before = [_copy(g.get("step", _MISSING)) for g in self.groups]
        self.after = {}

    @contextlib.contextmanager
    def call(self, params):
        """Around one step() call for ``params`` (outside ``_only``, which hides groups)."""
        wanted = {id(p) for p in params}
        for g, value in zip(self.groups, self.before):
            if value is _MISSING:
                g.pop("step", None)
            else:
                g["step"] = _copy(value)
        yield
        for i, g in enumerate(self.groups):
            if not any(id(p) in wanted for p in g["params"]):
                continue  # not handed to this call
            value = g.get("step", _MISSING)
            if value is not _MISSING:
                # What the optimizer left, even unchanged (TE's capturable mode does not
                # advance on an overflow step).
                self.after[i] = _copy(value)
                if not _same(value, self.before[i]):
                    self.keeps_group_counters = True

    def end(self) -> None:
        for i, g in enumerate(self.groups):
            if i in self.after:
                g["step"] = self.after[i]
            elif self.before[i] is not _MISSING:
                g["step"] = _copy(self.before[i])
                if self.keeps_group_counters and g["params"]:
                    g["step"] = g["step"] + 1
            elif self.keeps_group_counters and g["params"]:
                g["step"] = 1


def _same(a, b) -> bool:
    if a is _MISSING or b is _MISSING:
        return a is b
    if torch.is_tensor(a) or torch.is_tensor(b):
        return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
    return a == b
