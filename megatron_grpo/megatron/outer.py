"""The periodic tiers in megatron's distributed optimizer: anchors, outer syncs, per-instance state.

With --num-distributed-optimizer-instances I > 1 and a periodic tier (OuterSchedule), each
instance steps its own shard of a periodic unit on its own gradients (the bucket group's local
reduce-scatter). ``OuterSync`` maps a unit's optimizer shards (the fp32 master params megatron
keeps for this rank's part of each bucket) onto one flat shard per bucket, in the bucket's own
layout, and hands it to comm.outer.OuterOptimizer:

* ``capture`` (before the inner step, in ``_copy_model_grads_to_main_grads``): a unit that just
  became periodic records its anchor (identical on every instance: tiers change only right
  after an exact sync of every periodic tier); a unit that left drops it.
* ``sync`` (after the inner step, before megatron copies masters to the model and all-gathers
  inside the instance): the units of every tier due sync their deltas across instances.
* ``average_moments``: a unit that left a periodic tier had its Adam moments evolve on its own
  instance's gradients; they are averaged across instances (exactly) so the now per-step synced
  copies stay identical.
* ``state_dict``/``load_state_dict``: between syncs the instances hold different masters and
  moments for periodic units, but megatron's checkpoint keeps one copy (instance 0's). Each
  rank saves its own shard of them with the outer state, and on load restores them, copies its
  masters into the model and all-gathers each periodic bucket inside its instance (megatron's
  own collective), so a resume mid-period is exact.

Every rank walks the replica's periodic units in the same order and joins every bucket's
collective, whether or not it owns parameters there (a shard of padding sends zeros).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_grpo.comm.outer import OuterOptimizer


class OuterSync:
    def __init__(self, optimizer, ctrl) -> None:
        self.opt, self.ctrl = optimizer, ctrl
        self.intra = optimizer.data_parallel_group  # the instance (megatron passes its own group)
        units = ctrl.units
        first = units[0].group
        self.inter = first.inter_distributed_optimizer_instance_group
        cfg = ctrl.config  # the delta residuals are stored like the per-step ones
        self.outer = OuterOptimizer(cfg.outer_lr, cfg.outer_momentum, self.inter,
                                    residual_dtype=cfg.residual_dtype, chunk=cfg.compress_chunk)
        self.instances = self.outer.instances
        # (unit, bucket index) -> [(shard main param, its offset in the rank's shard of the bucket)]
        self.segments: Dict[Tuple[int, int], List] = {}
        self.buckets: Dict[Tuple[int, int], object] = {}
        rank, size = self.intra.rank(), self.intra.size()
        for model_param, shard in optimizer._pairs():
            bucket = optimizer._bucket_of(model_param)
            unit = ctrl.unit_of_bucket[id(bucket)]
            i = optimizer._bucket_index_in_group(ctrl, unit, bucket)
            world = optimizer._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
            shard_len = bucket.param_data.numel() // size
            self.segments.setdefault((unit, i), []).append((shard, world.start - rank * shard_len))
        mine = {id(b) for buf in optimizer.buffers for b in buf.buckets}
        for unit in units:
            for i, b in enumerate(unit.group.buckets):
                if id(b) in mine:  # with several optimizers (dtypes) each syncs its own buffers
                    self.buckets[(unit.index, i)] = b
        self.last_drift = None  # sqrt(sum |own delta - mean|^2 / sum |mean|^2) of the last sync

    # -- flat shards ------------------------------------------------------------------------------
    def _shard_len(self, key) -> int:
        return self.buckets[key].param_data.numel() // self.intra.size()

    def _gather(self, key, get) -> torch.Tensor:
        """This rank's shard of bucket ``key`` as one fp32 vector, from get(main param)."""
        bucket = self.buckets[key]
        flat = torch.zeros(self._shard_len(key), dtype=torch.float32, device=bucket.param_data.device)
        for shard, offset in self.segments.get(key, []):
            flat[offset:offset + shard.numel()].copy_(get(shard).view(-1))
        return flat

    def _scatter(self, key, flat: torch.Tensor, get) -> None:
        for shard, offset in self.segments.get(key, []):
            get(shard).view(-1).copy_(flat[offset:offset + shard.numel()])

    def _keys(self, units) -> List[Tuple[int, int]]:
        return [k for k in self.buckets if k[0] in units]

    def _periodic_units(self) -> List[int]:
        return [u.index for u in self.ctrl.units if self.ctrl.unit_periodic(u.index)]

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> None:
        periodic = set(self._periodic_units())
        for key in self.outer.keys():
            if key[0] not in periodic:
                self.outer.drop(key)
        for key in self._keys(periodic):
            if not self.outer.has_anchor(key):
                self.outer.set_anchor(key, self._gather(key, lambda p: p))

    @torch.no_grad()
    def sync(self) -> None:
        ctrl = self.ctrl
        due = [u for u in self._periodic_units() if ctrl.outer.due(ctrl.tiers[u])]
        if not due:
            return
        spread = size = 0  # 0-dim device tensors once summed: one host read per sync
        with ctrl.counter.tag("outer"):
            for key in self._keys(set(due)):
                flat = self._gather(key, lambda p: p)
                compressor = None if ctrl.outer.exact else ctrl.delta_compressor(ctrl.tiers[key[0]])
                group = ctrl.units[key[0]].group
                s, n = self.outer.sync(key, flat, compressor,
                                       exact_offsets=group._replicated_in_shard(key[1], self.buckets[key]))
                spread, size = spread + s, size + n
                self._scatter(key, flat, lambda p: p)
        spread, size = float(spread), float(size)
        self.last_drift = math.sqrt(spread / size) if size > 0 else 0.0

    @torch.no_grad()
    def average_moments(self, units: List[int]) -> None:
        """Average the Adam moments of ``units`` (they left a periodic tier) across instances."""
        state = self.opt.optimizer.state
        with self.ctrl.counter.tag("outer"):
            for key in self._keys(set(units)):
                for name in ("exp_avg", "exp_avg_sq"):
                    get = _moment(state, name)
                    flat = self._gather(key, get)
                    dist.all_reduce(flat, group=self.inter)
                    self._scatter(key, flat.div_(self.instances), get)

    def common_norm(self, norm: float) -> float:
        """sqrt(mean over instances of norm^2): one gradient norm (and clipping coefficient) on
        every instance. Collective over the inter-instance group (one scalar)."""
        device = next(iter(self.buckets.values())).param_data.device
        square = torch.tensor([float(norm) ** 2], dtype=torch.float64, device=device)
        with self.ctrl.counter.tag("grpo_control"):
            dist.all_reduce(square, group=self.inter)
        return math.sqrt(float(square.item()) / self.instances)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> Dict:
        state = self.opt.optimizer.state
        local = {}
        for key in self._keys(set(self._periodic_units())):
            local[key] = [self._gather(key, get).cpu()
                          for get in (lambda p: p, _moment(state, "exp_avg"), _moment(state, "exp_avg_sq"))]
        return {"outer": self.outer.state_dict(), "local": local}

    @torch.no_grad()
    def load_state_dict(self, saved: Dict) -> None:
        if not saved:
            return
        state = self.opt.optimizer.state
        device = next(iter(self.buckets.values())).param_data.device
        self.outer.load_state_dict(saved.get("outer"), device)
        local = saved.get("local", {})
        for key in sorted(local):
            values = [v.to(device) for v in local[key]]
            for value, get in zip(values, (lambda p: p, _moment(state, "exp_avg"), _moment(state, "exp_avg_sq"))):
                self._scatter(key, value, get)
            # The model copy of this instance: own masters in, then megatron's all-gather.
            bucket = self.buckets[key]
            flat = bucket.param_data.view(-1)
            shard_len = self._shard_len(key)
            rank = self.intra.rank()
            for shard, offset in self.segments.get(key, []):
                start = rank * shard_len + offset
                flat[start:start + shard.numel()].copy_(shard.view(-1))
            dist.all_gather_into_tensor(flat, flat[rank * shard_len:(rank + 1) * shard_len].clone(),
                                        group=self.intra)


def _moment(state, name: str):
    """A getter of Adam's ``name`` for a main param (created as zeros if the param never stepped)."""
    def get(p):
        st = state[p]
        if name not in st:
            st[name] = torch.zeros_like(p)
        return st[name]
    return get
