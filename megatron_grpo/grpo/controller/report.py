"""Reporting of the GRPO controller: tier shares, unit names for the re-tier log and the per-step
metrics record. A mixin of GRPOController (megatron_grpo.grpo.controller.core), which owns the attributes."""

from __future__ import annotations

from typing import Dict, List


class ControllerReport:
    def _replica_names(self) -> List[str]:
        """Names for the re-tier log: this stage's units by name, other stages' by position."""
        names = []
        for stage, count in enumerate(self.layout.stage_counts):
            for i in range(count):
                if stage == self.layout.stage:
                    names.append(self.units[i].name)
                else:
                    names.append(f"stage {stage} unit {i}")
        return names

    def shares(self) -> Dict[str, float]:
        """Share of the replica's gradient elements in each tier."""
        total = sum(self.replica_numels) or 1
        return {t: sum(n for n, x in zip(self.replica_numels, self.replica_tiers) if x == t) / total
                for t in ("core", "dynamic", "stable")}

    def metrics(self, wire_by_tag: Dict[str, int], step_time_s: float) -> Dict:
        out = {f"grpo_share_{t}": v for t, v in self.shares().items()}
        for t in ("core", "dynamic", "stable"):
            out[f"wire_bytes_{t}"] = wire_by_tag.get(t, 0)
        out["wire_bytes_grpo_control"] = wire_by_tag.get("grpo_control", 0)
        if self.outer.active:
            # Periodic tiers: their parameter deltas (and, after a re-tier, averaged moments)
            # crossing the instances, and which tiers synced at the end of this step.
            out["wire_bytes_outer"] = wire_by_tag.get("outer", 0)
            out["grpo_outer_synced"] = "".join(t[0] for t in self.outer_synced)
        out["grpo_importance_time_s"] = self.importance_timer.total_s()
        wait = self.wait_timer_.total_s()
        out["grpo_wait_time_s"] = wait
        out["grpo_ru"] = max(0.0, 1.0 - wait / step_time_s) if step_time_s > 0 else None
        out["grpo_timing"] = "cuda_events" if self.wait_timer_.on_device else "host"
        out["grpo_stable_update"] = self.step.stable_update
        out["grpo_tiered"] = self.tiered
        out["grpo_ef_bytes"] = self.ef.nbytes()
        out["grpo_skipped_steps"] = self.skipped_steps
        if not self.step_skipped:
            for tier in sorted(self.health.measured):
                h = self.health.last[tier]
                out[f"grpo_gvr_{tier}"] = h["gvr"]
                out[f"grpo_rel_error_{tier}"] = h["rel_error"]
                out[f"grpo_cosine_{tier}"] = h["cosine"]
            if "dynamic" in self.health.measured:
                h = self.health.last["dynamic"]
                out["grpo_gvr_in_range"] = self.config.gvr_min <= h["gvr"] <= self.config.gvr_max
        self.links.record(self.step.k, step_time_s)
        out.update(self.links.metrics())
        out["grpo_core_exact"] = self.core_exact
        out["grpo_stable_fallback"] = self.stable_fallback
        if self._new_events:
            out["grpo_retier"] = self._new_events
        out["grpo_tier_map"] = "".join(t[0] for t in self.tiers)
        return out
