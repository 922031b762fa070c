"""The sampled backward's plan: each tier unit's keep ratio, identical on every rank of the job.

Importance decides a unit's tier; variance decides its compute. Core units stay exact (ratio 1).
For the others, every ``--grpo-sample-interval`` iterations the linear layers measure, from their
own rows, the smallest keep ratio that meets ``--grpo-sample-variance-budget``
(``sampler.keep_for_budget``); the next iteration sums those measurements over every rank (one
all-reduce of two numbers per unit, through the replica layout, the same reduction the tier plan
uses) and moves each unit's ratio halfway towards the row-weighted mean, clamped to the floor and
ceiling. Every rank computes the same floats from the same sums, so tensor-parallel ranks and the
copies of a tied weight on two pipeline stages keep the same ratio.

The rows themselves are drawn from a generator seeded by (seed, iteration, backward call of the
step, data-parallel rank): tensor-parallel ranks draw the same rows from the same probabilities,
data-parallel ranks independent ones, and a resumed run draws what the uninterrupted one did.

Data gradients (--grpo-sample-dgrad) are sampled only where no core unit lies below in the
backward. A layer's data gradient is the input of the backward of everything its forward came
after: every earlier pipeline stage, and every parameter used earlier in this stage's forward
(the embedding first; with tied embeddings the output layer comes last, above everything). A
sampled data gradient there would make those gradients noisy, core's included. The forward's
order of parameter use is recorded once, at the first forward (``record_use``); a layer whose
position has a core unit before it, or whose stage has one on an earlier stage, computes its
data gradient exactly. So core gradients stay exact under every sampling flag.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from megatron_grpo.compute.flops import FlopCount
from megatron_grpo.grpo.config import GRPOConfig

SMOOTHING = 0.5
"""Weight of a new measurement in a unit's ratio: measurements of one micro-batch are noisy,
and a ratio that jumps would move compute back and forth between steps."""


class SampledBackward:
    """Keep ratios of the units of one model replica, and this rank's view of them."""

    def __init__(self, config: GRPOConfig, num_global: int, local: slice, seed: int,
                 dp_rank: int) -> None:
        self.config = config
        self.local = local
        self.seed = seed
        self.dp_rank = dp_rank
        self.ratios: List[float] = [1.0] * num_global
        """The plan: every unit's keep ratio (1.0: exact)."""
        self.wanted: List[Optional[float]] = [None] * num_global
        """Smoothed measurement of the ratio each unit's budget needs (also for core, reported)."""
        self.tiers: List[str] = ["core"] * num_global
        self.active = False
        """Sampling runs (after the first tiering); before it every unit is exact."""
        self.iteration = 0
        self.calls = 0
        num_local = local.stop - local.start
        self._sums = torch.zeros(num_local, 2, dtype=torch.float64)
        """Per unit: sum of (wanted ratio x rows) and of rows, on the device the layers measure on."""
        self.forward_order: List[int] = []
        """Local units in the order the first forward used their parameters (``record_use``)."""
        self.order_recorded = False
        self._dgrad_open: List[bool] = []
        """Per position in ``forward_order``: no core unit below it this step."""
        self.measuring = False
        self.flops = FlopCount()
        self._digest: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ per step
    def begin_step(self, iteration: int, replica_tiers: List[str], tiered: bool) -> None:
        """Before iteration ``iteration`` (1-based) runs: this step's ratios."""
        self.iteration = iteration
        self.calls = 0
        self.tiers = list(replica_tiers)
        self.active = tiered
        c = self.config
        # Only the sampled path measures; without it the step must not pay the collective
        # (same value on every rank: config, tiering and iteration agree).
        self.measuring = c.sampled_backward and tiered and iteration % c.sample_interval == 0
        for i, tier in enumerate(self.tiers):
            want = self.wanted[i]
            # Before a unit's first measurement: the ceiling (the sampled path is what measures).
            want = c.sample_max_keep if want is None else want
            # A measuring step keeps every row (ratio 1: the exact sum, in another order): its
            # gradients are the ones importance scores the units below core by (estimated_units).
            self.ratios[i] = 1.0 if (tier == "core" or not tiered or self.measuring) else \
                min(c.sample_max_keep, max(c.sample_min_keep, want))
        self.flops.reset()
        self._digest = None
        self._open_positions()

    def _open_positions(self) -> None:
        """Per position of ``forward_order``: no core unit below it. Again when the order is
        recorded: a resumed run's first forward comes after its first step's plan."""
        # Earlier pipeline stages hold the global units before this stage's (replica.py).
        open_ = not any(t == "core" for t in self.tiers[:self.local.start])
        self._dgrad_open = [open_]
        for unit in self.forward_order:
            open_ = open_ and self.tier(unit) != "core"
            self._dgrad_open.append(open_)

    def end_step(self, sum_over_replica: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the step: on a measuring step (the same on every rank: it follows the
        iteration), sum the measurements over every rank (a collective) and fold them in, so a
        checkpoint written now holds nothing rank-specific."""
        if not self.measuring:
            return
        sums = sum_over_replica(self._sums).double().cpu()
        for i, (weighted, rows) in enumerate(sums.tolist()):
            if rows > 0:
                now = weighted / rows
                old = self.wanted[i]
                self.wanted[i] = now if old is None else (1 - SMOOTHING) * old + SMOOTHING * now
        self._sums.zero_()
        self.measuring = False

    def estimated_units(self) -> frozenset:
        """Local units whose gradient this step may be a sampled estimate: every unit below core
        while sampling runs, except on measuring steps (every row kept). Importance skips them:
        it scores sum |g| |w|, and E|g_hat| >= |g|, so scoring estimates would inflate exactly the
        units that are sampled and bias the next tiering. (Below a sampled data gradient a unit
        whose own rows are all kept is noisy too, hence every unit below core.)"""
        if not (self.config.sampled_backward and self.active) or self.measuring:
            return frozenset()
        return frozenset(u for u in range(self.local.stop - self.local.start) if self.tier(u) != "core")

    def samples(self, local_unit: int) -> bool:
        """Whether this unit's linear layers take the sampled backward this step: below core,
        after the first tiering, with --grpo-sampled-backward (its ratio may still be 1 until
        the first measurement; the sampled path is what measures)."""
        return self.config.sampled_backward and self.active and self.tier(local_unit) != "core"

    def keep(self, local_unit: int) -> float:
        return self.ratios[self.local.start + local_unit]

    def tier(self, local_unit: int) -> str:
        return self.tiers[self.local.start + local_unit]

    def samples_dgrad(self, local_unit: int, position: Optional[int]) -> bool:
        """Whether the data gradient of a layer of this unit is sampled (--grpo-sample-dgrad):
        its tier asks for it and no core unit is below ``position`` (the layer's place in
        ``forward_order``; None before the order is recorded: exact)."""
        mode, tier = self.config.sample_dgrad, self.tier(local_unit)
        wanted = self.keep(local_unit) < 1.0 and (mode == "below-core" or (mode == "stable" and tier == "stable"))
        if not wanted or position is None or not self.order_recorded:
            return False
        return self._dgrad_open[position]

    # ------------------------------------------------------------------ forward order
    def record_use(self, local_units) -> None:
        """The first forward used these units' parameters next (sampled_linear's hooks)."""
        if not self.order_recorded:
            self.forward_order.extend(local_units)

    def position(self) -> int:
        """Where the first forward is now: how many uses came before."""
        return len(self.forward_order)

    def end_recording(self) -> None:
        self.order_recorded = True
        self._open_positions()

    def record(self, local_unit: int, wanted: torch.Tensor, rows: torch.Tensor) -> None:
        """One layer's measurement on a measuring step: the keep ratio its rows needed. Both are
        device tensors, summed on the device: no host synchronisation per layer."""
        wanted, rows = torch.as_tensor(wanted), torch.as_tensor(rows)
        if self._sums.device != wanted.device:
            self._sums = self._sums.to(wanted.device)
        self._sums[local_unit, 0] += wanted.double() * rows
        self._sums[local_unit, 1] += rows

    def generator(self, device: torch.device) -> torch.Generator:
        """A fresh generator for the next backward call of this step (see the module docstring)."""
        self.calls += 1
        g = torch.Generator(device=device)
        mixed = (self.seed * 1_000_003 + self.iteration) * 1_000_033 + self.calls
        g.manual_seed((mixed * 65_537 + self.dp_rank) % (2 ** 63 - 1))
        return g

    def note_rows(self, kept: torch.Tensor) -> None:
        """Fold a draw's kept row indices into the step's digest, on the device (no host sync
        until the step's metrics): ranks that draw the same rows report the same digest."""
        term = ((kept.to(torch.int64) + 1) * (self.calls * 2_654_435_761 % 1_000_000_007)).remainder(
            1_000_000_007).sum()
        self._digest = term if self._digest is None else (self._digest + term).remainder(1_000_000_007)

    # ------------------------------------------------------------------ reports and state
    def metrics(self) -> Dict[str, float]:
        out = self.flops.metrics()
        if self._digest is not None:
            out["sample_rows_digest"] = int(self._digest)
        for tier in ("dynamic", "stable"):
            ratios = [r for r, t in zip(self.ratios, self.tiers) if t == tier]
            if ratios and self.active:
                out[f"sample_keep_{tier}"] = sum(ratios) / len(ratios)
        return out

    def state_dict(self) -> Dict:
        """Identical on every rank: the ratios and measurements (a resume samples as the
        uninterrupted run would; the generator seeds follow from the iteration)."""
        return {"ratios": list(self.ratios), "wanted": list(self.wanted)}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        if not state:
            return
        if len(state["ratios"]) != len(self.ratios):
            raise ValueError(f"the checkpoint's sampled-backward plan has {len(state['ratios'])} "
                             f"units but this model replica has {len(self.ratios)}: resume with "
                             f"the same model, layout and --grpo-bucket-mb")
        self.ratios = list(state["ratios"])
        self.wanted = list(state["wanted"])
