"""Tiering and remediation of the GRPO controller: the replica's importance density, a
re-tier and its installation (residuals owed to moved units carried, accumulators dropped),
freezing of stable units, the importance and health measurements, and the remediations the
health figures call for. A mixin of GRPOController (megatron_grpo.grpo.controller.core), which
owns the attributes."""

from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist

from megatron_grpo.grpo.tiers import TierPlan, describe_moves, policy_density


class ControllerTiering:
    def _replica_density(self) -> List[float]:
        """Importance density of every unit of the replica, identical on every rank."""
        scores = self.importance.bucket_scores().to(torch.float64)
        numels = torch.tensor([u.numel for u in self.units], dtype=torch.float64, device=self.device)
        rows = torch.stack([scores.to(self.device), numels], dim=1) if self.units else \
            torch.zeros(0, 2, dtype=torch.float64, device=self.device)
        with self.counter.tag("grpo_control"):
            total = self.layout.sum_over_replica(rows).tolist()
        return [r[0] / r[1] if r[1] > 0 else 0.0 for r in total]

    def _retier(self, k: int) -> None:
        policy = self.config.tier_policy
        density = policy_density(policy, self._replica_density(), k)
        free = [i for i, pinned in enumerate(self.replica_pinned) if not pinned]
        # A random ablation redraws from scratch (no incumbency), as its definition says.
        keep = self.tiered and policy != "random"
        plan = self.planner.plan([density[i] for i in free], [self.replica_numels[i] for i in free],
                                 [self.replica_tiers[i] for i in free] if keep else None,
                                 no_stable=[self.replica_no_stable[i] for i in free])
        tiers = ["core"] * self.layout.num_global
        for i, t in zip(free, plan.tiers):
            tiers[i] = t
        old = self.replica_tiers
        moved = [(i, a, b) for i, (a, b) in enumerate(zip(old, tiers)) if a != b]
        reason = ("initial tiering after warm-up" if not self.tiered else "scheduled re-tier") + \
            (f"; {plan.reason}" if plan.reason else "")
        pinned = sum(self.replica_pinned)
        if pinned:
            reason += f"; {pinned} unit(s) with copies on several pipeline stages pinned to core"
        self.tiered = True
        self._apply_plan(k, TierPlan(tiers=tiers, moved=moved, reason=reason))

    def _apply_plan(self, k: int, plan: TierPlan) -> None:
        """Install a plan over the replica's units; ``plan.moved`` uses replica indices."""
        offset = self.layout.offset
        moved_local = {i - offset for i, _, _ in plan.moved if self.layout.local.start <= i < self.layout.local.stop}
        for key in list(self.ef.keys()):
            if key[0] in moved_local:
                # Error feedback owes this bucket what compression held back: deliver it with
                # the unit's next sync in its new tier (keys are (unit, bucket in group)).
                self.carry[key] = self.ef.residual(key).clone()
                self.ef.drop(key)
                if self.powersgd is not None:
                    self.powersgd.drop(key)
        for key in list(self.accum.counts):
            if key[0] in moved_local:  # re-tiering happens right after a stable update: empty
                self.accum.drop(key)
        self.left_local = sorted(
            i - offset for i, a, b in plan.moved if self.layout.local.start <= i < self.layout.local.stop
            and self.outer.periodic(a) and not self.outer.periodic(b))
        self.replica_tiers = list(plan.tiers)
        self.tiers = self.replica_tiers[self.layout.local]
        plan.shares = self.shares()
        names = self._replica_names()
        event = {"iteration": k, "reason": plan.reason, "moved": len(plan.moved),
                 "shares": plan.shares, "moves": describe_moves(plan, names)}
        self.events.append(event)
        self._new_events.append(event)
        if dist.get_rank() == 0:
            print(f"[grpo] iter {k}: {plan.reason}: {len(plan.moved)} unit(s) moved; shares "
                  + ", ".join(f"{t} {plan.shares.get(t, 0):.1%}" for t in ("core", "dynamic", "stable")),
                  flush=True)
            for line in event["moves"][:20]:
                print(f"[grpo]   {line}", flush=True)

    def _apply_freezing(self) -> None:
        """Frozen stable units skip weight-gradient compute: megatron's linear layers take the
        frozen-weight path when ``requires_grad`` is False, and autograd skips the rest."""
        frozen_mode = self.config.stable_frozen
        for unit, tier in zip(self.units, self.tiers):
            want = not (frozen_mode and tier == "stable" and not self.step.stable_update)
            for p in unit.params:
                if p.requires_grad != want:
                    p.requires_grad_(want)

    # ------------------------------------------------------------------ measurements
    def observe_importance(self, index: int) -> None:
        if not self.step.measure_importance or index in self.estimated_units:
            return
        unit = self.units[index]
        with self.importance_timer.time():
            self.importance.observe(index, [p.main_grad for p in unit.params],
                                    [p.detach() for p in unit.params])

    def health_stats(self, index: int):
        """A callback for a compressed reduce-scatter (dynamic, or compressed core) on
        monitoring steps: (applied, owed)."""
        if self._health is None:
            return None
        return lambda applied, owed: self._health.add(index, applied, owed)

    def _finish_health(self) -> None:
        """Figures of each compressed tier over the whole replica (megatron_grpo.grpo.health); then
        remediation when a tier's relative compression error stays above the limit: the dynamic
        units with the worst error move to core; a compressed core goes exact."""
        with self.counter.tag("grpo_control"):
            sums = self.layout.sum_over_replica(self._health.values)
        self._health = None
        limit = self.config.max_compression_error
        why = (f"above --grpo-max-compression-error {limit} for {self.config.gvr_window} checks")
        units = {t: [i for i, (x, pinned) in enumerate(zip(self.replica_tiers, self.replica_pinned))
                     if x == t and not (t == "core" and pinned)] for t in self._watched_tiers()}
        bad = self.health.judge(sums, units)
        if "core" in bad:
            self._core_to_exact(self.step.k + 1, f"remediation: core relative compression error "
                                f"{bad['core']['rel_error']:.3f} {why}: core synced exactly from here on")
        if "stable" in bad and not self.stable_fallback:
            # Error feedback keeps each stable bucket's residual: only the compressor changes.
            self.stable_fallback = True
            self.remediations += 1
            self._note_remediation(self.step.k + 1, f"remediation: stable relative compression error "
                                   f"{bad['stable']['rel_error']:.3f} {why}: stable sent with "
                                   f"--grpo-compressor {self.config.compressor} from here on")
        if "dynamic" in bad:
            figures, dynamic = bad["dynamic"], units["dynamic"]
            errors = [figures["unit_rel_error"].get(i, math.nan) for i in dynamic]
            worst = self.health.monitors["dynamic"].select_worst(dynamic, errors)
            plan = self.planner.promote(self.replica_tiers, worst,
                                        f"remediation: dynamic relative compression error "
                                        f"{figures['rel_error']:.3f} {why}", numels=self.replica_numels)
            self.remediations += 1
            self._apply_plan(self.step.k + 1, plan)

    def _core_to_exact(self, k: int, reason: str) -> None:
        """From iteration ``k`` core syncs exactly (megatron's own), for the rest of the run.
        What error feedback still owes each core bucket goes with its next (exact) sync."""
        self.core_exact = True
        self.remediations += 1
        for key in list(self.ef.keys()):
            if self.tiers[key[0]] == "core":
                self.carry[key] = self.ef.residual(key).clone()
                self.ef.drop(key)
        self._note_remediation(k, reason)

    def _note_remediation(self, k: int, reason: str) -> None:
        event = {"iteration": k, "reason": reason, "moved": 0, "shares": self.shares(), "moves": []}
        self.events.append(event)
        self._new_events.append(event)
        if dist.get_rank() == 0:
            print(f"[grpo] iter {k}: {reason}", flush=True)
