"""The memory tier's megatron glue: which tensors of megatron's distributed optimizer belong to
which GRPO tier unit, and the TierPlacement that moves them (megatron_grpo.offload.placement).

Per parameter shard this rank owns, the placed state is the fp32 master shard (GRPO gives fp32
params their own master storage, megatron does for bf16) and the inner torch optimizer's
per-element state (Adam's exp_avg and exp_avg_sq); scalar state (Adam's step) stays.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from megatron_grpo.megatron.optimizer import grpo_optimizers
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
    masters = [shard for (_, kind), pairs in unit_state(optimizer, ctrl).items() if kind == "master"
               for _, shard in pairs]
    sizes = [s.numel() * 4 for s in masters for _ in range(PER_ELEMENT_STATES)]
    residuals = config.residuals and ctrl.config.compressor != "powersgd"
    if residuals:  # room for a residual of every bucket (any unit may become dynamic)
        sizes += [b.grad_data.numel() * 4 for u in ctrl.units for b in u.group.buckets]
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
    placement = TierPlacement(store, target, stream=config.stream)
    if residuals:
        # PowerSGD's residuals are new tensors every step; they stay in memory.
        placement.residuals = OffloadedResiduals(store, target)
        ctrl.ef.use_store(placement.residuals)
    for oi, opt in enumerate(grpo_optimizers(optimizer)):
        opt.placement = placement
        if config.stream:
            _window_inner_step(oi, opt, placement, ctrl)
    return placement


def _window_inner_step(oi: int, opt, placement: TierPlacement, ctrl) -> None:
    """Replace the inner torch optimizer's step with one that updates the resident units in one
    call, then the streamed units one at a time through ``placement.stream``, each followed by
    the copy of its new weights to the model (the last read of its master), so its state can
    leave at once. Adam's update is per element and per parameter (each parameter is stepped
    exactly once, with the step's own lr), so the result is bit for bit the single call's; only
    what is resident meanwhile differs."""
    inner = opt.optimizer
    whole_step = inner.step

    def step_only(params, closure=None):
        wanted = {id(p) for p in params}
        held = []
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in wanted:
                    held.append((p, p.grad))
                    p.grad = None
        try:
            return whole_step(closure)
        finally:
            for p, grad in held:
                p.grad = grad

    def windowed_step(closure=None):
        windows = placement.windows(ctrl.step.stable_update)
        unit_of = {id(shard): ctrl.unit_of_bucket[id(opt._bucket_of(mp))] for mp, shard in opt._pairs()}
        streamed, rest = {}, []
        wanted = set(windows)
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                unit = unit_of.get(id(p))
                if unit in wanted:
                    streamed.setdefault(unit, []).append(p)
                else:
                    rest.append(p)
        result = step_only(rest, closure) if rest else None

        def update(unit):
            step_only(streamed[unit])
            # Adam creates a parameter's moments at its first update: registered now, they
            # leave with this unit's state. Registered only at the next step, every unit's
            # new moments would be resident together until then: the run's peak, 8 bytes per
            # shard element above the streamed steps' (measured: +306 MB per rank at 93 M
            # parameters, bench memcap).
            placement.add(_opt_state(oi, opt, ctrl, only_unit=unit))
            opt._copy_main_params_to_model_params(units={unit})

        placement.stream([w for w in windows if w in streamed], update)
        # A streamed unit with no gradient on this rank was not stepped, so its weights did
        # not change, and its master is away: megatron's copy after the step must skip it.
        opt._grpo_copied_units.update(w for w in windows if w not in streamed)
        return result

    inner.step = windowed_step
