"""Device-resident bytes of GRPO's state by kind and tier, every step.

One record per step, ``mem_<kind>_<tier>`` in bytes of this rank, for the tier units' kinds:

* ``grads``: gradient storage at the step's gradient peak (megatron/grad_storage.py; with
  --no-grpo-release-grads the whole buffer, always resident);
* ``masters`` and ``moments``: the fp32 master shards and Adam's per-element state (the memory
  tier's placement decides where they are);
* ``residuals``: committed error-feedback residuals;
* ``accumulators``: the delayed stable tier's gradient sums.

All but ``grads`` are taken after the step. State the memory tier is moving counts where the move
goes (as TierPlacement.resident_bytes counts it): a write in flight is away, a read-back is
resident. The tier is the unit's after the step (a re-tiering step reports the new map).
"""

from __future__ import annotations

from typing import Dict, Iterable

from megatron_grpo.grpo.config import TIERS
from megatron_grpo.megatron.offload import unit_state

KINDS = ("grads", "masters", "moments", "residuals", "accumulators")


def resident_by_kind(optimizer, ctrl, storages: Iterable, placement=None) -> Dict[str, int]:
    """{"mem_<kind>_<tier>": bytes on the device} of this rank (every kind and tier present)."""
    out = {f"mem_{k}_{t}": 0 for k in KINDS for t in TIERS}

    def tier(unit: int) -> str:
        return ctrl.tiers[unit] if unit < len(ctrl.tiers) else "core"

    for storage in storages:
        peak = storage.peak_by_bucket or [0] * len(storage.buckets)
        for grads, nbytes in zip(storage.buckets, peak):
            out[f"mem_grads_{tier(ctrl.unit_of_bucket[id(grads.bucket)])}"] += nbytes
    if not storages:  # megatron's one buffer: every unit's gradient, all the time
        for unit in ctrl.units:
            for b in unit.group.buckets:
                out[f"mem_grads_{tier(unit.index)}"] += b.grad_data.numel() * b.grad_data.element_size()
    for (unit, kind), pairs in unit_state(optimizer, ctrl).items():
        name = "masters" if kind == "master" else "moments"
        if placement is not None and (unit, kind) in placement.units:
            out[f"mem_{name}_{tier(unit)}"] += placement.device_bytes((unit, kind))
            continue
        for _, t in pairs:  # resident unless a store freed it (zero-byte storage)
            if t.untyped_storage().nbytes():
                out[f"mem_{name}_{tier(unit)}"] += t.numel() * t.element_size()
    for name, state in (("residuals", ctrl.ef), ("accumulators", ctrl.accum)):
        for key, nbytes in state.device_bytes_by_key().items():
            out[f"mem_{name}_{tier(key[0])}"] += nbytes
    return out
