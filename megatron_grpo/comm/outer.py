"""The outer optimizer of the periodic tiers: parameter deltas averaged across instances.

A periodic tier trains locally inside each distributed-optimizer instance (one node) for H
steps; then every rank holding a shard of a unit sends the delta its instance made since the
last sync, d = anchor - local (an outer "gradient", as in DiLoCo), over the inter-instance group
(the ranks that hold the same shard index in every instance). With the mean delta g over the I
instances, the outer step is Nesterov SGD:

    m <- mu m + g;    step = g + mu m (mu = 0: step = g);    new = anchor - lr * step

and every instance's shard and the anchor become ``new``. lr 1, mu 0 is plain parameter
averaging. The deltas cross either exactly (an fp32 all-reduce) or through
comm.hierarchical.InterInstanceAllReduce with a compressor and error feedback of its own (keys
of this class's ``ef``): every member decodes the same payloads, so ``new`` is bit-identical on
every instance. An exact sync also delivers what compression still owed (the residual is sent
with the delta and dropped), which is why the step before a re-tier syncs exactly.

Plain torch on flat fp32 shards; megatron/outer.py maps a unit's optimizer shards onto them.
Every tensor handed to a collective is on the shard's device. ``sync`` runs only on an applied
step (the optimizer skips the copy it is called from otherwise), so the residual commits at once.
"""

from __future__ import annotations

from typing import Dict, Hashable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.comm.hierarchical import InterInstanceAllReduce


class OuterOptimizer:
    def __init__(self, lr: float, momentum: float, group, residual_dtype: str = "fp32",
                 chunk: int = 256) -> None:
        self.lr, self.mu, self.group = lr, momentum, group
        self.instances = dist.get_world_size(group)
        self.anchor: Dict[Hashable, torch.Tensor] = {}
        self.momentum: Dict[Hashable, torch.Tensor] = {}
        # The compressed delta syncs' residuals (--grpo-residual-dtype, --grpo-compress-chunk).
        self.ef = ErrorFeedback(residual_dtype, chunk)

    def has_anchor(self, key: Hashable) -> bool:
        return key in self.anchor

    def set_anchor(self, key: Hashable, shard: torch.Tensor) -> None:
        """The shard at the start of the unit's first local period (identical on every instance)."""
        self.anchor[key] = shard.detach().to(torch.float32, copy=True)

    def drop(self, key: Hashable) -> None:
        """The unit left the periodic tiers (after an exact sync: nothing is owed)."""
        self.anchor.pop(key, None)
        self.momentum.pop(key, None)
        self.ef.drop(key)

    def keys(self):
        return list(self.anchor)

    def sync(self, key: Hashable, local: torch.Tensor, compressor=None,
             exact_offsets: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Average this unit-shard's deltas across instances and apply the outer step to ``local``
        (a 1-D fp32 shard, written in place). Collective over the inter-instance group.
        ``compressor`` None sends exactly. Returns (sum of squares of this instance's delta minus
        the mean delta, sum of squares of the mean delta) as 0-dim tensors on the shard's device
        (read once per sync by the caller, not once per bucket): how far the instances drifted."""
        anchor = self.anchor[key]
        delta = anchor - local
        mine = delta.clone()
        if compressor is None:
            owed = self.ef.residual(key)  # what an earlier compressed sync still owes goes too
            if owed is not None:  # (padded to a multiple of I there; the padding owes nothing)
                delta.add_(owed[:delta.numel()].to(delta.device))
            dist.all_reduce(delta, group=self.group)
            self.ef.drop(key)
        else:
            InterInstanceAllReduce(key, delta, self.ef, compressor, self.group, async_op=False,
                                   exact_offsets=exact_offsets)
            self.ef.commit()
        mean = delta.div_(self.instances)
        spread = mine.sub_(mean).square().sum()
        size = mean.square().sum()
        if self.mu > 0.0:
            buf = self.momentum.get(key)
            if buf is None:
                buf = self.momentum[key] = torch.zeros_like(mean)
            buf.mul_(self.mu).add_(mean)
            step = mean.add(buf, alpha=self.mu)
        else:
            step = mean
        anchor.sub_(step, alpha=self.lr)
        local.copy_(anchor)
        return spread, size

    def state_dict(self) -> Dict:
        cpu = lambda d: {k: v.detach().to("cpu", copy=True) for k, v in d.items()}  # noqa: E731
        return {"anchor": cpu(self.anchor), "momentum": cpu(self.momentum), "ef": self.ef.state_dict()}

    def load_state_dict(self, state: Optional[Dict], device: torch.device) -> None:
        if not state:
            return
        self.anchor = {k: v.to(device) for k, v in state["anchor"].items()}
        self.momentum = {k: v.to(device) for k, v in state["momentum"].items()}
        self.ef.load_state_dict(state["ef"])
