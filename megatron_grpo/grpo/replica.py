"""One tier plan for the whole model replica: the layout of tier units over pipeline stages, and
the reductions that make every rank of the job see the same numbers.

Why over the whole job and not the data-parallel group: every rank that holds a copy of a
parameter must give it the same tier. Data-parallel replicas hold copies of everything; tensor-
parallel ranks hold copies of the replicated parameters (layernorms, row-parallel biases) in
the bucket of the same index (the bucket layout is a function of the per-rank shapes, equal on
every TP rank); pipeline stages share the tied word embedding. Planning on the data-parallel
group alone let two TP ranks give the same bucket different tiers (measured: a unit stable on
tp0 and dynamic on tp1), and their replicated parameters drifted apart.

So each rank lays its units' statistics into the slots of its pipeline stage in one vector over
all units of the replica (stage 0's units first), and one all-reduce over every rank of the
job sums them: the sum covers dp x tp (x cp) copies of each slot. An all-reduce gives every
member the same bytes, so every rank plans from identical floats and reaches the same plan,
which the planner (pure Python, ties broken by index) guarantees.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


class ReplicaLayout:
    """Where this rank's tier units sit among all units of the model replica."""

    def __init__(self, num_local_units: int, stage: int, num_stages: int, device,
                 group=None) -> None:
        self.group = group
        self.device = device
        self.stage = stage
        self.num_stages = num_stages
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world > 1:
            mine = torch.tensor([stage, num_local_units], dtype=torch.int64, device=device)
            everyone = torch.zeros(world * 2, dtype=torch.int64, device=device)
            dist.all_gather_into_tensor(everyone, mine, group=group)
            pairs = everyone.view(world, 2).tolist()
        else:
            pairs = [[stage, num_local_units]]
        counts: List[Optional[int]] = [None] * num_stages
        members = [0] * num_stages
        for rank, (s, n) in enumerate(pairs):
            if not 0 <= s < num_stages:
                raise RuntimeError(f"GRPO: rank {rank} reports pipeline stage {s} of {num_stages}")
            if counts[s] is not None and counts[s] != n:
                raise RuntimeError(
                    f"GRPO: ranks of pipeline stage {s} have different numbers of tier units "
                    f"({counts[s]} and {n} on rank {rank}): every data- and tensor-parallel rank of "
                    f"a stage must build the same DDP buckets (same model, --grpo-bucket-mb and dtype)")
            counts[s] = n
            members[s] += 1
        if any(c is None for c in counts):
            raise RuntimeError(f"GRPO: no rank reported pipeline stages "
                               f"{[s for s, c in enumerate(counts) if c is None]}")
        if len(set(members)) != 1:
            raise RuntimeError(f"GRPO: pipeline stages have different rank counts {members}")
        self.stage_counts: List[int] = [int(c) for c in counts]
        self.copies = members[0]
        """Ranks per stage (dp x tp x cp): how many copies of each slot the sum holds."""
        self.offset = sum(self.stage_counts[:stage])
        self.num_local = num_local_units
        self.num_global = sum(self.stage_counts)

    @property
    def local(self) -> slice:
        return slice(self.offset, self.offset + self.num_local)

    def sum_over_replica(self, local_rows: torch.Tensor) -> torch.Tensor:
        """[num_local, k] per-unit values of this rank -> [num_global, k] summed over every rank
        of the job (dp x tp copies of a stage add up in its slots). Identical on all ranks."""
        if local_rows.shape[0] != self.num_local:
            raise ValueError(f"expected {self.num_local} rows, got {local_rows.shape[0]}")
        full = torch.zeros((self.num_global,) + tuple(local_rows.shape[1:]), dtype=local_rows.dtype,
                           device=self.device)
        full[self.local] = local_rows.to(self.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(full, group=self.group)
        return full

    def all_agree(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is True on every rank (one all-reduce)."""
        value = torch.tensor([0.0 if flag else 1.0], dtype=torch.float32, device=self.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return float(value) == 0.0
