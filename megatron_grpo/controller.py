"""GRPOController: the state and schedule of GRPO for one data-parallel replica of a model.

Data flows one way: gradients -> importance -> tiers -> per-tier policy -> optimizer. The
controller owns the tier of every tier unit (one megatron DDP bucket group), the importance EMA,
the error-feedback residuals, the stable tier's schedule and the monitors; the megatron glue
(``megatron_grpo.megatron``) asks it what to do and reports back. Everything here is decided
identically on every data-parallel rank: the only inputs are the iteration number and values
all-reduced over the data-parallel group.

Schedule of iteration k (1-based):
* k <= warmup_iters: every unit is core (megatron's exact collectives); importance is measured.
* the first tiering, and each re-tiering ``retier_interval`` later, happens at the start of the
  first iteration k with (k-1) % stable_interval == 0, i.e. right after a stable update, so no
  delayed gradient is pending when tiers change. A dynamic unit's error-feedback residual that
  leaves the tier is carried into that unit's next sync (nothing is lost).
* stable units are updated (wgrad, exact sync, optimizer step) when k % stable_interval == 0;
  otherwise they are frozen (no wgrad, no communication, no optimizer work) or, in ``delayed``
  mode, their gradients accumulate locally.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_grpo.comm.compress import ErrorFeedback, build_compressor
from megatron_grpo.comm.wire import wire_counter
from megatron_grpo.config import GRPOConfig
from megatron_grpo.importance import ImportanceTracker
from megatron_grpo.tiers import GVRMonitor, TierPlan, TierPlanner, describe_moves


@dataclass
class TierUnit:
    """One megatron bucket group: the unit a tier is assigned to."""

    index: int
    group: object
    """megatron _ParamAndGradBucketGroup (class swapped to GRPOBucketGroup)."""
    params: List[torch.nn.Parameter]
    numel: int
    """Padded gradient elements of the group's buckets."""
    name: str
    """Human-readable span of parameter names, for re-tier logs."""


@dataclass
class StepPlan:
    """What iteration ``k`` does, decided at its start."""

    k: int = 0
    stable_update: bool = True
    measure_importance: bool = False
    measure_gvr: bool = False


@dataclass
class StepStats:
    importance_time_s: float = 0.0
    wait_time_s: float = 0.0
    gvr_sums: List[float] = field(default_factory=lambda: [0.0] * 5)
    unit_errors: Dict[int, float] = field(default_factory=dict)


def _unit_name(names: List[str]) -> str:
    if not names:
        return "(empty)"
    common = names[0].rsplit(".", 1)[0]
    return common if len(names) == 1 else f"{common} (+{len(names) - 1} more)"


class GRPOController:
    def __init__(self, config: GRPOConfig, ddp_chunks: list, device: torch.device,
                 dp_group) -> None:
        self.config = config
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.device = device
        self.counter = wire_counter()
        self.units: List[TierUnit] = []
        self.unit_of_bucket: Dict[int, int] = {}
        for chunk in ddp_chunks:
            names = {p: n for n, p in chunk.module.named_parameters()}
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                params = [p for b in group.buckets for p in b.params_list]
                unit = TierUnit(len(self.units), group, params,
                                sum(b.grad_data.numel() for b in group.buckets),
                                _unit_name([names.get(p, "?") for p in params]))
                for b in group.buckets:
                    self.unit_of_bucket[id(b)] = unit.index
                self.units.append(unit)
        n = len(self.units)
        self.tiers: List[str] = ["core"] * n
        self.importance = ImportanceTracker(n, [len(u.params) for u in self.units],
                                            config.importance_decay, device)
        self.planner = TierPlanner.from_config(config)
        self.monitor = GVRMonitor.from_config(config)
        self.compressor = build_compressor(config.compressor, config.compress_chunk, config.topk_ratio)
        self.ef = ErrorFeedback()
        # Keyed by (unit, bucket index in its group), like the error-feedback residuals.
        self.carry: Dict[tuple, torch.Tensor] = {}
        self.accum: Dict[tuple, List] = {}
        self.staging: Dict[int, torch.Tensor] = {}
        self.step = StepPlan()
        self.stats = StepStats()
        self.tiered = False
        self.retier_pending = False
        self.events: List[Dict] = []
        self._new_events: List[Dict] = []
        self.last_gvr: Optional[float] = None
        self.remediations = 0

    # ------------------------------------------------------------------ schedule
    def begin_step(self, iteration: int) -> None:
        """Called before iteration ``iteration + 1`` runs (``iteration`` steps are done)."""
        c = self.config
        k = iteration + 1
        self._new_events = []
        if k - 1 >= c.warmup_iters and (not self.tiered or
                                        (k - 1 - c.warmup_iters) % c.retier_interval == 0):
            self.retier_pending = True
        if self.retier_pending and (k - 1) % c.stable_interval == 0:
            self._retier(k)
            self.retier_pending = False
        self.step = StepPlan(
            k=k,
            stable_update=(k % c.stable_interval == 0) or not self.tiered,
            measure_importance=(k % c.importance_interval == 0),
            measure_gvr=self.tiered and (k % c.gvr_interval == 0) and "dynamic" in self.tiers,
        )
        self.stats = StepStats()
        self._apply_freezing()

    def end_step(self) -> None:
        """Called after the optimizer step of the current iteration."""
        if self.step.measure_importance:
            self.importance.commit()
        if self.step.measure_gvr and self.dp_size >= 1:
            self._finish_gvr()

    def unit_active(self, index: int) -> bool:
        """False when the unit is stable and this is not its update step (nothing to do)."""
        return self.tiers[index] != "stable" or self.step.stable_update

    def tier_of_bucket(self, bucket) -> str:
        return self.tiers[self.unit_of_bucket[id(bucket)]]

    # ------------------------------------------------------------------ tiering
    def _bucket_numels(self) -> List[int]:
        return [u.numel for u in self.units]

    def _agreed_scores(self) -> torch.Tensor:
        """Average the importance EMA over data-parallel ranks so every rank plans the same."""
        scores = self.importance.scores_tensor().clone()
        if self.dp_size > 1:
            with self.counter.tag("grpo_control"):
                dist.all_reduce(scores, group=self.dp_group)
            scores /= self.dp_size
        self.importance.set_scores(scores)
        return scores

    def _retier(self, k: int) -> None:
        self._agreed_scores()
        density = self.importance.bucket_density(self._bucket_numels())
        plan = self.planner.plan(density, self._bucket_numels(),
                                 self.tiers if self.tiered else None)
        if not self.tiered:  # the first plan moves units out of the all-core warm-up
            plan.moved = [(i, old, new) for i, (old, new) in enumerate(zip(self.tiers, plan.tiers))
                          if old != new]
        plan.reason = ("initial tiering after warm-up" if not self.tiered else "scheduled re-tier") + \
            (f"; {plan.reason}" if plan.reason else "")
        self.tiered = True
        self._apply_plan(k, plan)

    def _apply_plan(self, k: int, plan: TierPlan) -> None:
        moved = {index for index, old, new in plan.moved}
        for key in list(self.ef.keys()):
            if key[0] in moved:
                # Error feedback owes this bucket what compression held back: deliver it with
                # the unit's next sync in its new tier (keys are (unit, bucket in group)).
                self.carry[key] = self.ef.residual(key).clone()
                self.ef.drop(key)
        for key in list(self.accum):
            if key[0] in moved:  # re-tiering happens right after a stable update: empty
                self.accum.pop(key)
        self.tiers = list(plan.tiers)
        event = {"iteration": k, "reason": plan.reason, "moved": len(plan.moved),
                 "shares": plan.shares,
                 "moves": describe_moves(plan, [u.name for u in self.units])}
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
        frozen_mode = self.config.stable_mode == "frozen"
        for unit, tier in zip(self.units, self.tiers):
            want = not (frozen_mode and tier == "stable" and not self.step.stable_update)
            for p in unit.params:
                if p.requires_grad != want:
                    p.requires_grad_(want)

    # ------------------------------------------------------------------ measurements
    def observe_importance(self, index: int) -> None:
        if not self.step.measure_importance:
            return
        t0 = time.perf_counter()
        unit = self.units[index]
        self.importance.observe(index, [p.main_grad for p in unit.params],
                                [p.detach() for p in unit.params])
        self.stats.importance_time_s += time.perf_counter() - t0

    def gvr_stats(self, index: int):
        """A callback for the dynamic reduce-scatter on GVR steps: (applied, exact) local grads."""
        if not self.step.measure_gvr:
            return None

        def record(applied: torch.Tensor, exact: torch.Tensor) -> None:
            a, e = applied.double(), exact.double()
            sums = self.stats.gvr_sums
            for i, v in enumerate((a.sum(), (a * a).sum(), e.sum(), (e * e).sum())):
                sums[i] += float(v)
            sums[4] += a.numel()
            self.stats.unit_errors[index] = float((a - e).norm() / e.norm().clamp(min=1e-30))
        return record

    def _finish_gvr(self) -> None:
        """GVR of the dynamic tier: Var(applied) / Var(exact), over all dynamic elements of all
        data-parallel ranks (local contributions, before the sum); then remediation."""
        n = len(self.units)
        vec = torch.zeros(5 + n, dtype=torch.float64)
        vec[:5] = torch.tensor(self.stats.gvr_sums, dtype=torch.float64)
        for i, err in self.stats.unit_errors.items():
            vec[5 + i] = err
        if self.dp_size > 1:
            with self.counter.tag("grpo_control"):
                dist.all_reduce(vec, group=self.dp_group)
        sa, sa2, se, se2, cnt = vec[:5].tolist()
        if cnt <= 0:
            return
        var_a = sa2 / cnt - (sa / cnt) ** 2
        var_e = se2 / cnt - (se / cnt) ** 2
        self.last_gvr = var_a / var_e if var_e > 0 else 1.0
        if self.monitor.update(self.last_gvr):
            dynamic = [i for i, t in enumerate(self.tiers) if t == "dynamic"]
            errors = [float(vec[5 + i]) / self.dp_size for i in dynamic]
            worst = self.monitor.select_worst(dynamic, errors)
            plan = self.planner.promote(self.tiers, worst,
                                        f"remediation: dynamic GVR {self.last_gvr:.3f} outside "
                                        f"[{self.config.gvr_min}, {self.config.gvr_max}] for "
                                        f"{self.config.gvr_window} checks")
            self.remediations += 1
            self._apply_plan(self.step.k + 1, plan)

    # ------------------------------------------------------------------ reporting
    def shares(self) -> Dict[str, float]:
        total = sum(u.numel for u in self.units) or 1
        return {t: sum(u.numel for u, x in zip(self.units, self.tiers) if x == t) / total
                for t in ("core", "dynamic", "stable")}

    def metrics(self, wire_by_tag: Dict[str, int], step_time_s: float) -> Dict:
        s = self.shares()
        out = {f"grpo_share_{t}": v for t, v in s.items()}
        for t in ("core", "dynamic", "stable"):
            out[f"wire_bytes_{t}"] = wire_by_tag.get(t, 0)
        out["wire_bytes_grpo_control"] = wire_by_tag.get("grpo_control", 0)
        out["grpo_importance_time_s"] = self.stats.importance_time_s
        out["grpo_ru"] = max(0.0, 1.0 - self.stats.wait_time_s / step_time_s) if step_time_s > 0 else None
        out["grpo_stable_update"] = self.step.stable_update
        out["grpo_tiered"] = self.tiered
        out["grpo_ef_bytes"] = self.ef.nbytes()
        if self.step.measure_gvr and self.last_gvr is not None:
            out["grpo_gvr_dynamic"] = self.last_gvr
            out["grpo_gvr_core"] = 1.0  # exact by construction
        if self._new_events:
            out["grpo_retier"] = self._new_events
        out["grpo_tier_map"] = "".join(t[0] for t in self.tiers)
        return out

    # ------------------------------------------------------------------ checkpoint state
    def common_state(self) -> Dict:
        """Identical on every data-parallel rank: stored once (rank 0)."""
        return {"tiers": list(self.tiers), "tiered": self.tiered, "retier_pending": self.retier_pending,
                "events": self.events, "remediations": self.remediations,
                "monitor": dict(vars(self.monitor)), "last_gvr": self.last_gvr}

    def rank_state(self) -> Dict:
        """Differs per rank: residuals, local importance, delayed accumulators, carries."""
        return {"ef": self.ef.state_dict(), "importance": self.importance.state_dict(),
                "carry": {k: v.cpu() for k, v in self.carry.items()},
                "accum": {k: (v[0].cpu(), v[1]) for k, v in self.accum.items()}}

    def load_common_state(self, state: Dict) -> None:
        if not state:
            return
        if len(state["tiers"]) != len(self.units):
            raise ValueError(f"checkpointed GRPO tier map has {len(state['tiers'])} units but this "
                             f"model has {len(self.units)}: resume with the same model, layout and "
                             f"--grpo-bucket-mb")
        self.tiers = list(state["tiers"])
        self.tiered = state["tiered"]
        self.retier_pending = state["retier_pending"]
        self.events = list(state["events"])
        self.remediations = state["remediations"]
        vars(self.monitor).update(state["monitor"])
        self.last_gvr = state["last_gvr"]

    def load_rank_state(self, state: Dict) -> None:
        if not state:
            return
        self.ef.load_state_dict(state["ef"])
        self.importance.load_state_dict(state["importance"])
        self.carry = {k: v.to(self.device) for k, v in state["carry"].items()}
        self.accum = {k: [v[0].to(self.device), v[1]] for k, v in state["accum"].items()}
