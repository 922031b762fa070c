"""The GRPO controller's checkpoint state: what is stored once for the job (the replica's plan)
and what each rank keeps (residuals, importance, accumulators), and how both are restored.
A mixin of GRPOController (megatron_grpo.grpo.controller.core), which owns the attributes."""

from __future__ import annotations

from typing import Dict


class ControllerState:
    def common_state(self) -> Dict:
        """Identical on every rank of the job (the replica's plan): stored once (rank 0)."""
        return {"tiers": list(self.replica_tiers), "tiered": self.tiered,
                "retier_pending": self.retier_pending, "events": self.events,
                "remediations": self.remediations, "skipped_steps": self.skipped_steps,
                "core_exact": self.core_exact, "stable_fallback": self.stable_fallback,
                "warmup_origin": self.warmup_origin or 0, "outer": self.outer.state_dict(),
                "links": self.links.state_dict(),
                **self.health.state_dict()}

    def rank_state(self) -> Dict:
        """Differs per rank: residuals, local importance, delayed accumulators, carries."""
        return {"ef": self.ef.state_dict(), "importance": self.importance.state_dict(),
                "carry": {k: v.cpu() for k, v in self.carry.items()},
                "accum": self.accum.state_dict(),
                "powersgd": self.powersgd.state_dict() if self.powersgd is not None else None}

    def load_common_state(self, state: Dict) -> None:
        if not state:
            return
        if len(state["tiers"]) != self.layout.num_global:
            raise ValueError(f"checkpointed GRPO tier map has {len(state['tiers'])} units but this "
                             f"model replica has {self.layout.num_global}: resume with the same model, "
                             f"layout and --grpo-bucket-mb")
        self.replica_tiers = list(state["tiers"])
        self.tiers = self.replica_tiers[self.layout.local]
        self.links.load_state_dict(state.get("links"))
        self.tiered = state["tiered"]
        self.retier_pending = state["retier_pending"]
        self.events = list(state["events"])
        self.remediations = state["remediations"]
        self.health.load_state_dict(state)
        self.skipped_steps = state.get("skipped_steps", 0)
        self.core_exact = state.get("core_exact", False)  # absent before the core monitor
        self.stable_fallback = state.get("stable_fallback", False)  # absent before the int2 stable tier
        self.warmup_origin = state.get("warmup_origin", 0)  # absent before --no-load-optim
        self.outer.load_state_dict(state.get("outer"))  # absent before the periodic tiers

    def load_rank_state(self, state: Dict) -> None:
        if not state:
            return
        self.ef.load_state_dict(state["ef"])
        self.importance.load_state_dict(state["importance"])
        self.carry = {k: v.to(self.device) for k, v in state["carry"].items()}
        self.accum.load_state_dict(state["accum"], self.device)
        if self.powersgd is not None and state.get("powersgd"):
            self.powersgd.load_state_dict(state["powersgd"])
