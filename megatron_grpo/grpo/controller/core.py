"""GRPOController: the state and schedule of GRPO for one data-parallel replica of a model.

Data flows one way: gradients -> importance -> tiers -> per-tier policy -> optimizer. The
controller owns the tier of every tier unit (one megatron DDP bucket group), the importance EMA,
the error-feedback residuals, the stable tier's schedule and the monitors; the megatron glue
(``megatron_grpo.megatron``) asks it what to do and reports back. Everything here is decided
identically on every rank of the job: the only inputs are the iteration number and values
summed over all ranks (one plan for the whole model replica, megatron_grpo.grpo.replica), so every
rank that holds a copy of a parameter (data-parallel replicas, tensor-parallel copies of
replicated parameters, the tied embedding on two pipeline stages) gives it the same tier.
Every tensor handed to a collective is created on ``device`` (NCCL serves CUDA tensors only).

Schedule of iteration k (1-based):
* k <= warmup_iters: every unit is core (megatron's exact collectives); importance is measured.
* the first tiering, and each re-tiering ``retier_interval`` later, happens at the start of the
  first iteration k with (k-1) % stable_interval == 0, i.e. right after a stable update, so no
  delayed gradient is pending when tiers change (stable_interval 0, the static-freeze ablation:
  stable units are never updated, and tiering waits for no boundary). A dynamic unit's
  error-feedback residual that leaves the tier is carried into that unit's next sync (nothing
  is lost).
* stable units are updated (wgrad, exact sync, optimizer step) when k % stable_interval == 0;
  otherwise they are frozen (no wgrad, no communication, no optimizer work) or, in ``delayed``
  mode, their gradients accumulate locally.
* with instances > 1 a periodic tier (--grpo-{core,dynamic}-sync-interval > 1, --grpo-stable-mode
  local) trains locally inside each instance and syncs across instances on OuterSchedule's
  schedule; a re-tier waits for, and is preceded by, an exact sync of every periodic tier.
* a step the optimizer skips (a non-finite gradient on any rank, ``note_nonfinite``, or an
  update megatron skips after that check, ``note_applied``) changes
  no GRPO state: error-feedback residuals, carries, delayed accumulators and importance are
  only updated by ``end_step`` of an applied step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_grpo.comm.accumulators import DelayedAccumulators
from megatron_grpo.comm.compress import build_compressor
from megatron_grpo.comm.powersgd import BucketLayout, PowerSGDState
from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.comm.replicated import ReplicatedElements
from megatron_grpo.comm.wire import wire_counter
from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.grpo.controller.links import LinkPolicy
from megatron_grpo.grpo.controller.report import ControllerReport
from megatron_grpo.grpo.controller.state import ControllerState
from megatron_grpo.grpo.controller.tiering import ControllerTiering
from megatron_grpo.grpo.health import HealthSums, HealthWatch
from megatron_grpo.grpo.importance import ImportanceTracker
from megatron_grpo.grpo.outer_schedule import OuterSchedule
from megatron_grpo.grpo.replica import ReplicaLayout
from megatron_grpo.grpo.tiers import GVRMonitor, TierPlanner, lone_unit_notice
from megatron_grpo.grpo.timing import IntervalTimer


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
    pinned: Optional[str] = None
    """Tier this unit must keep (see GRPOController), or None."""
    sparse: bool = False
    """Holds a sparse-gradient parameter (an embedding table: rows of unseen tokens get none)."""


@dataclass
class StepPlan:
    """What iteration ``k`` does, decided at its start."""

    k: int = 0
    stable_update: bool = True
    measure_importance: bool = False
    measure_health: bool = False


def _unit_name(names: List[str]) -> str:
    if not names:
        return "(empty)"
    common = names[0].rsplit(".", 1)[0]
    return common if len(names) == 1 else f"{common} (+{len(names) - 1} more)"


def _pipeline_position():
    """(stage, stages, tensor-parallel size) from megatron's parallel_state, (0, 1, 1) without it."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                    ps.get_tensor_model_parallel_world_size())
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        pass
    return 0, 1, 1


class GRPOController(ControllerState, ControllerReport, ControllerTiering):
    """GRPO state for one model replica chunk list; see the module docstring.

    ``plan_group`` is the group of every rank that must agree on the tier plan: all ranks of
    the job by default (data-parallel replicas, tensor-parallel ranks and pipeline stages all
    hold copies of some parameter; see megatron_grpo.grpo.replica).
    """

    def __init__(self, config: GRPOConfig, ddp_chunks: list, device: torch.device,
                 dp_group, plan_group=None) -> None:
        self.config = config
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.device = torch.device(device)
        self.counter = wire_counter()
        # Under strict mode the counter checks every tensor GRPO hands to these groups.
        self.counter.bind_group_device(dp_group, self.device)
        self.counter.bind_group_device(plan_group, self.device)
        self.units: List[TierUnit] = []
        self.unit_of_bucket: Dict[int, int] = {}
        stage, stages, tp_size = _pipeline_position()
        for chunk in ddp_chunks:
            if getattr(chunk, "expert_parallel_bucket_groups", None):
                raise ValueError("GRPO does not tier expert-parallel parameters yet: their bucket "
                                 "layout differs between expert-parallel ranks; run without MoE")
            names = {p: n for n, p in chunk.module.named_parameters()}
            for group in chunk.bucket_groups:
                params = [p for b in group.buckets for p in b.params_list]
                unit = TierUnit(len(self.units), group, params,
                                sum(b.grad_data.numel() for b in group.buckets),
                                _unit_name([names.get(p, "?") for p in params]))
                # The tied word embedding has a copy on the first and on the last pipeline stage
                # (megatron all-reduces its gradient between them after the data-parallel sync):
                # planned per stage, the two copies could get different tiers and drift apart.
                if stages > 1 and any(getattr(p, "shared_embedding", False) or getattr(p, "shared", False)
                                      for p in params):
                    unit.pinned = "core"
                unit.sparse = any(names.get(p, "").endswith("word_embeddings.weight") for p in params)
                for b in group.buckets:
                    self.unit_of_bucket[id(b)] = unit.index
                self.units.append(unit)
        n = len(self.units)
        self.layout = ReplicaLayout(n, stage, stages, self.device, plan_group)
        # One unit in the whole model: nothing to tier; it stays in the exact warm-up for good.
        self.lone = self.layout.num_global < 2
        rows = torch.tensor([[u.numel, 1.0 if u.pinned else 0.0, 1.0 if u.sparse else 0.0]
                             for u in self.units], dtype=torch.float64, device=self.device).view(n, 3)
        with self.counter.tag("grpo_control"):
            replica = self.layout.sum_over_replica(rows).tolist()
        self.replica_numels = [int(round(r[0] / self.layout.copies)) for r in replica]
        self.replica_pinned = [r[1] > 0 for r in replica]
        self.replica_no_stable = [r[2] > 0 and config.sparse_gradient_tier == "no-stable"
                                  for r in replica]
        self.replica_tiers: List[str] = ["core"] * self.layout.num_global
        self.tiers: List[str] = ["core"] * n
        # Replicated (non-TP-split) parameters of compressed buckets travel exactly, so their
        # TP copies stay bit-identical (megatron_grpo.comm.replicated).
        self.replicated: Dict[tuple, ReplicatedElements] = {}
        if tp_size > 1 and self.dp_size > 1:
            rank = dist.get_rank(dp_group)
            for unit in self.units:
                for i, b in enumerate(unit.group.buckets):
                    rep = ReplicatedElements.for_bucket(b, b.grad_data.numel() // self.dp_size, rank,
                                                        b.grad_data.device)
                    if rep is not None:
                        self.replicated[(unit.index, i)] = rep
        self.importance = ImportanceTracker(n, [len(u.params) for u in self.units],
                                            config.importance_decay, self.device,
                                            score=config.importance_score)
        self.planner = TierPlanner.from_config(config)
        self.health = HealthWatch(lambda: GVRMonitor.from_config(config), config.max_compression_error)
        self.core_exact = False  # set by remediation: a compressed core that stayed bad
        self.stable_fallback = False  # set by remediation: a compressed stable tier that stayed bad
        # PowerSGD (a peer, for the evidence suite) compresses gradients only: the parameter
        # deltas of its buckets go through the int4 quantiser.
        self.powersgd = (PowerSGDState(config.powersgd_rank, seed=1)
                         if config.compressor == "powersgd" else None)
        self.powersgd_layouts = {(u.index, i): BucketLayout.for_bucket(b, b.grad_data.device)
                                 for u in self.units for i, b in enumerate(u.group.buckets)
                                 } if self.powersgd is not None else {}
        self.compressor = build_compressor("int4" if self.powersgd else config.compressor,
                                           config.compress_chunk, config.topk_ratio)
        self.core_compressor = (None if config.core_compressor == "none" else
                                build_compressor(config.core_compressor, config.compress_chunk,
                                                 config.topk_ratio))
        self.stable_compressor = (build_compressor(config.stable_compressor, config.compress_chunk)
                                  if config.stable_every_step else None)
        self.ef = ErrorFeedback(config.residual_dtype, config.compress_chunk)
        # Where the formats pay on this run's links (--grpo-compress; measured now, before step 1).
        formats = {c.name: c for c in (self.compressor, self.core_compressor, self.stable_compressor)
                   if c is not None}
        self.links = LinkPolicy(config, self.units, dp_group, self.device, self.counter, formats,
                                plan_group)
        # Keyed by (unit, bucket index in its group), like the error-feedback residuals.
        self.carry: Dict[tuple, torch.Tensor] = {}
        self.accum = DelayedAccumulators()
        self.staging: Dict[tuple, torch.Tensor] = {}
        # What this step used or held; applied by end_step only when the step was not skipped.
        self._carry_used: set = set()
        self._health: Optional[HealthSums] = None
        self.step_skipped = False
        self._awaiting_update = 0  # optimizers that found this step finite and have not applied it
        self.skipped_steps = 0
        cuda = self.device.type == "cuda"
        self.side_stream = torch.cuda.Stream(device=self.device) if cuda else None
        event = torch.cuda.Event if cuda else None
        self.importance_timer = IntervalTimer(event)
        self.wait_timer_ = IntervalTimer(event)
        self.step = StepPlan()
        self.estimated_units: frozenset = frozenset()
        """Units whose gradient this step is a sampled estimate (the compute policy sets it
        each step): importance does not score them, an estimate's |g| is biased upwards."""
        self.tiered = False
        self.retier_pending = False
        # Iteration the exact warm-up counts from: 0, or a resume without GRPO state (another
        # layout with --no-load-optim, a baseline checkpoint) at its first step; None until then.
        self.warmup_origin: Optional[int] = None
        self.events: List[Dict] = []
        self._new_events: List[Dict] = []
        self.pending_events: List[Dict] = []
        self.remediations = 0
        # Local updates between instances (megatron_grpo.grpo.outer_schedule): which tiers sync when.
        self.instances = getattr(ddp_chunks[0].ddp_config, "num_distributed_optimizer_instances", 1) \
            if ddp_chunks else 1
        self.outer = OuterSchedule(config, self.instances)
        self.outer_synced: List[str] = []  # tiers the last applied step synced across instances
        # This rank's units that the last re-tier moved out of a periodic tier: their optimizer
        # moments differ per instance and are averaged by the glue before the step runs.
        self.left_local: List[int] = []
        self.final_iteration: Optional[int] = None  # --train-iters, set by the glue
        if self.lone:  # once per run, in the first step's record and on rank 0's log
            self.note_event(lone_unit_notice(self.layout.num_global, config.bucket_mb))

    # ------------------------------------------------------------------ streams and timers
    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def stream_context(self, stream):
        return torch.cuda.stream(stream)

    def join_side_stream(self) -> None:
        """Make the main stream wait for the side stream's work (importance, held gradients)."""
        if self.side_stream is not None:
            self.current_stream().wait_stream(self.side_stream)

    def wait_timer(self):
        """Times a wait for communication (RU): device time on GPU, host time on CPU."""
        return self.wait_timer_.time()

    # ------------------------------------------------------------------ schedule
    def begin_step(self, iteration: int) -> None:
        """Called before iteration ``iteration + 1`` runs (``iteration`` steps are done)."""
        c = self.config
        k = iteration + 1
        if self.warmup_origin is None and iteration > 0:
            self.note_event(f"resumed at iteration {iteration} without GRPO state (--no-load-optim, "
                             f"or a checkpoint written without --grpo): a new exact warm-up of "
                             f"{c.warmup_iters} iterations starts")
        # Events noted before the first step (a resume at another world size) show in its record.
        self._new_events, self.pending_events = self.pending_events, []
        for event in self._new_events:
            event["iteration"] = k
        if self.warmup_origin is None:
            self.warmup_origin = iteration
        done = k - 1 - self.warmup_origin  # steps since the warm-up began
        if done >= c.warmup_iters and (not self.tiered or (done - c.warmup_iters) % c.retier_interval == 0):
            self.retier_pending = not self.lone
        interval = self._stable_step_interval()
        never = interval == 0  # static freeze: stable units are never updated
        self.left_local = []
        # A pending sync across instances (kept by a skipped step) must happen before tiers move.
        if self.retier_pending and (never or (k - 1) % interval == 0) and not self.outer.pending:
            self._retier(k)
            self.retier_pending = False
        # The last iteration also syncs every periodic tier exactly: the run ends on one model.
        self.outer.plan(k, self.tiered, self._retier_at(k + 1) or k == self.final_iteration)
        # The replica's compressed elements (identical on every rank: the A/B's collective
        # must be entered by all ranks alike).
        self.links.begin_step(k, self.tiered, sum(n for n, t in zip(self.replica_numels, self.replica_tiers)
                                                  if t != "core" or self._core_compressed()))
        self._settle_exact_units()
        self.step = StepPlan(
            k=k,
            stable_update=(not never and k % interval == 0) or not self.tiered,
            measure_importance=not self.lone and k % c.importance_interval == 0,
            measure_health=self.tiered and (k % c.gvr_interval == 0) and bool(self._watched_tiers()),
        )
        self.step_skipped = False
        self._awaiting_update = 0
        self._health = HealthSums(len(self.units), self.device) if self.step.measure_health else None
        self.health.new_step()
        self.importance_timer.reset()
        self.wait_timer_.reset()
        self._apply_freezing()

    def _stable_step_interval(self) -> int:
        """Steps between stable updates; a compressed or local stable tier steps every iteration
        (an interval of 1: re-tier at any step)."""
        c = self.config
        return 1 if c.stable_every_step else c.stable_interval

    def _retier_at(self, k: int) -> bool:
        """Will iteration ``k`` (the next one) start with a re-tier? Decided as begin_step will."""
        c = self.config
        done = k - 1 - self.warmup_origin
        due = self.retier_pending or (done >= c.warmup_iters and (
            not self.tiered or (done - c.warmup_iters) % c.retier_interval == 0))
        interval = self._stable_step_interval()
        return due and (interval == 0 or (k - 1) % interval == 0)

    def note_event(self, reason: str) -> Dict:
        """An event of the next step (in its record's grpo_retier; its iteration is set there),
        kept in the checkpointed events and printed by rank 0."""
        event = {"iteration": None, "reason": reason, "moved": 0, "shares": self.shares(), "moves": []}
        self.events.append(event)
        self.pending_events.append(event)
        if dist.get_rank() == 0:
            print(f"[grpo] {reason}", flush=True)
        return event

    def note_nonfinite(self, found: bool) -> None:
        """An optimizer found a non-finite gradient (agreed over all ranks): the step is skipped.
        With several chained optimizers each reports; one finding is enough. Finite, the
        optimizer still has to apply it (``note_applied``)."""
        self.step_skipped = self.step_skipped or bool(found)
        if not found:
            self._awaiting_update += 1

    def note_applied(self) -> None:
        """An optimizer that found its gradients finite applied the update
        (``step_with_ready_grads``). megatron may skip it after the check (0.18's
        ``grad_norm_skip_threshold``, megatron/compat.py): a step some optimizer prepared but
        did not apply is skipped for GRPO too, or its residuals and accumulators would be
        committed for an update Adam never took."""
        self._awaiting_update -= 1

    def end_step(self) -> None:
        """Called after the optimizer step of the current iteration: applies what the step used
        (residuals, carries, accumulators, importance) or, if it was skipped, leaves them."""
        self.join_side_stream()
        self.staging.clear()
        if self._awaiting_update > 0:
            self.step_skipped = True  # found finite, then not applied (see note_applied)
        self._awaiting_update = 0
        if self.step_skipped:
            self.skipped_steps += 1
            self.outer_synced = []  # its syncs across instances stay pending (OuterSchedule)
            self.ef.discard()
            if self.powersgd is not None:
                self.powersgd.discard()
            self.importance.discard()
            self._carry_used.clear()
            self.accum.discard()
            self._health = None
            event = {"iteration": self.step.k, "reason": "step skipped: non-finite gradient; "
                     "residuals, accumulators and importance left as they were", "moved": 0}
            self.events.append(event)
            self._new_events.append(event)
            if dist.get_rank() == 0:
                print(f"[grpo] iter {self.step.k}: {event['reason']}", flush=True)
            return
        self.ef.commit()
        self.outer_synced = self.outer.applied()
        if self.powersgd is not None:
            self.powersgd.commit()
        for key in self._carry_used:
            self.carry.pop(key, None)
        self._carry_used.clear()
        self.accum.commit()
        if self.step.measure_importance:
            self.importance.commit()
        if self._health is not None:
            self._finish_health()

    def stable_update_next(self) -> bool:
        """Will the step after this one update the stable tier? (The memory tier prefetches the
        stable tier's state one step ahead.) A re-tier at that step only moves units out of
        stable right after an update, when their state is resident anyway."""
        if self.config.stable_every_step:
            return True
        interval = self.config.stable_interval
        return interval > 0 and (self.step.k + 1) % interval == 0

    def unit_active(self, index: int) -> bool:
        """False when the unit is stable and this is not its update step (nothing to do)."""
        return self.tiers[index] != "stable" or self.step.stable_update

    def unit_periodic(self, index: int) -> bool:
        """Does the unit train locally inside its instance this step (synced across instances
        every few steps through the outer optimizer)? Never in the warm-up, never for a unit
        pinned to core (its copies on two pipeline stages are synced exactly every step)."""
        return self.tiered and self.outer.periodic(self.tiers[index]) and not self.units[index].pinned

    def params_between_syncs(self) -> set:
        """Ids of this rank's parameters whose instances may differ after this step: those of
        periodic units whose tier did not sync at it (the same set on every data-parallel rank)."""
        return {id(p) for u in self.units if self.unit_periodic(u.index)
                and self.tiers[u.index] not in self.outer_synced for p in u.params}

    def unit_compressor(self, index: int):
        """The compressor of the unit's gradient and parameter sync this step, or None for an
        exact one (megatron's own). Core is compressed only with --grpo-core-compressor, once
        tiered (the warm-up is the baseline's exact sync, all units core), and never for a unit
        pinned to core (its copies on two pipeline stages must stay exact); stable is
        compressed in --grpo-stable-mode compressed (with the dynamic tier's compressor after
        remediation); with one data-parallel rank there is nothing to send, so nothing is
        compressed."""
        if self.dp_size <= 1 or self.unit_periodic(index):
            return None
        tier, chosen = self.tiers[index], None
        if tier == "dynamic":
            chosen = self.compressor
        elif tier == "stable" and self.stable_compressor is not None and self.tiered:
            chosen = self.compressor if self.stable_fallback else self.stable_compressor
        elif tier == "core" and self._core_compressed() and not self.units[index].pinned:
            chosen = self.core_compressor
        # --grpo-compress: a format that does not pay on this group syncs exactly (links.py).
        return chosen if chosen is not None and self.links.compresses(chosen.name) else None

    def _settle_exact_units(self) -> None:
        """A unit whose sync became exact (the link decision, its A/B) gets what error feedback
        still owes it with its next exact sync, as a unit that leaves a compressed tier does."""
        for key in list(self.ef.keys()):
            if not self.unit_periodic(key[0]) and self.unit_compressor(key[0]) is None:
                self.carry[key] = self.ef.residual(key).clone()
                self.ef.drop(key)
                if self.powersgd is not None:
                    self.powersgd.drop(key)

    def delta_compressor(self, tier: str):
        """The compressor of a periodic tier's parameter deltas across instances (None: exact)."""
        return {"core": self.core_compressor, "dynamic": self.compressor,
                "stable": self.stable_compressor}[tier]

    def _core_compressed(self) -> bool:
        return self.tiered and self.core_compressor is not None and not self.core_exact

    def _watched_tiers(self) -> List[str]:
        """Tiers of the replica that go through error-feedback compression (the same on every
        rank: replica tiers and flags agreed by all), hence what a monitoring step measures."""
        # A periodic tier sends no gradients across instances: nothing to watch per step.
        local = self.outer.periodic
        out = ["dynamic"] if "dynamic" in self.replica_tiers and not local("dynamic") else []
        if self._core_compressed() and not local("core") and any(t == "core" and not pinned for t, pinned
                                           in zip(self.replica_tiers, self.replica_pinned)):
            out.append("core")
        if self.stable_compressor is not None and "stable" in self.replica_tiers and not local("stable"):
            out.append("stable")
        return out

    def tier_of_bucket(self, bucket) -> str:
        return self.tiers[self.unit_of_bucket[id(bucket)]]

    # -- what a sync uses this step (applied by end_step) ------------------------------------
    def use_carry(self, key: tuple) -> Optional[torch.Tensor]:
        carry = self.carry.get(key)
        if carry is not None:
            self._carry_used.add(key)
        return carry

    def use_accumulator(self, key: tuple) -> Optional[Tuple[torch.Tensor, int]]:
        """(sum, steps summed) of a delayed stable bucket at its update; release it after use."""
        return self.accum.take(key)

    def hold(self, key: tuple, grad: torch.Tensor, local=None) -> None:
        """A delayed stable bucket's scaled gradient, added to its accumulator at end_step;
        ``local``: (indices, values now) of elements rewritten before then (DelayedAccumulators.hold)."""
        self.accum.hold(key, grad, local)

    def held_gradients(self) -> List[torch.Tensor]:
        """Local gradients held this step (the optimizer's non-finite check covers them)."""
        return self.accum.held()

    # ------------------------------------------------------------------ tiering
