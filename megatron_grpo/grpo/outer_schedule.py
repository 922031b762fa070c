"""OuterSchedule: when each periodic tier crosses the distributed-optimizer instances.

With megatron's partial distributed optimizer (one instance per node) a tier may train locally
inside each instance and cross the slow link only every H steps, as parameter deltas through
an outer optimizer (local updates, as DiLoCo; the math and collectives are in comm/outer.py,
the optimizer glue in megatron/outer.py). This module is the policy only: which tiers sync at
the end of iteration k. Everything here is decided from the iteration number and the replica's
tier plan, so every rank of the job decides the same and issues the same collectives.

* Phases count from the first tiering (``origin`` = iterations done then): a tier with period H
  syncs at the end of iteration k when (k - origin) % H == 0.
* Tiers change only when every instance agrees: the step before a re-tier syncs every periodic
  tier, exactly (no compression, residuals delivered), so a unit that leaves a periodic tier
  leaves identical on every instance and owes nothing. So does the run's last iteration
  (--train-iters): the run ends on one model, which is what it evaluates and saves.
* A sync is cleared only by an applied step; a skipped step (a non-finite gradient anywhere)
  keeps it pending, and the next applied step performs it. A re-tier waits while one is pending.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

from megatron_grpo.grpo.config import TIERS, GRPOConfig


class OuterSchedule:
    def __init__(self, config: GRPOConfig, instances: int) -> None:
        self.instances = instances
        self.intervals: Dict[str, int] = {t: config.sync_interval(t) for t in TIERS}
        local = set()
        if instances > 1:
            local = {t for t in ("core", "dynamic") if self.intervals[t] > 1}
            if config.stable_local:
                local.add("stable")
        self.local_tiers = frozenset(local)
        self.origin: Optional[int] = None
        self.pending: Set[str] = set()
        self.exact = False

    @property
    def active(self) -> bool:
        return bool(self.local_tiers)

    def periodic(self, tier: str) -> bool:
        """Does ``tier`` train locally between syncs across instances?"""
        return tier in self.local_tiers

    def plan(self, k: int, tiered: bool, sync_all: bool) -> None:
        """At the start of iteration ``k`` (after any re-tier): add the tiers due at its end;
        ``sync_all``: every periodic tier, exactly (the next iteration re-tiers, or this is the
        run's last)."""
        if not self.local_tiers or not tiered:
            return
        if self.origin is None:
            self.origin = k - 1
        for tier in self.local_tiers:
            if (k - self.origin) % self.intervals[tier] == 0:
                self.pending.add(tier)
        if sync_all:
            # Every instance must agree on every unit before tiers change or the run ends.
            self.pending |= self.local_tiers
            self.exact = True

    def due(self, tier: str) -> bool:
        """Does ``tier`` sync at the end of this iteration?"""
        return tier in self.pending

    def applied(self) -> List[str]:
        """The step was applied: its syncs happened. Returns the tiers synced."""
        done = sorted(self.pending)
        self.pending.clear()
        self.exact = False
        return done

    def state_dict(self) -> Dict:
        return {"origin": self.origin, "pending": sorted(self.pending), "exact": self.exact}

    def load_state_dict(self, state: Optional[Dict]) -> None:
        if not state:
            return
        self.origin = state["origin"]
        self.pending = set(state["pending"])
        self.exact = state["exact"]
