"""GRPODistributedOptimizer and get_grpo_optimizer, beside megatron's get_megatron_optimizer.

A subclass of ``megatron.core.optimizer.distrib_optimizer.DistributedOptimizer`` (0.16.1) with
thin overrides:

* ``_copy_model_grads_to_main_grads``: ranges of stable units between their updates get
  ``grad = None``, so torch Adam skips them (no moment drift, no weight decay) and the global
  gradient norm (hence clipping) is taken over the gradients actually applied; with gradient
  release the others read the shard each bucket kept after its sync (megatron/grad_storage.py),
  megatron's whole-model buffer being gone. A shard the memory tier holds away
  (megatron/grad_shards.py) is read back just before its unit's update (``bring_grads``); until
  then its norm stands in for it (``get_main_grads_for_grad_norm``, 0.19's
  ``get_grads_for_grad_norm``: megatron/compat.py) and its clipping waits.
* ``_copy_main_params_to_model_params``: a compressed unit's (dynamic, or core with
  --grpo-core-compressor) updated master shard goes to a staging
  buffer instead of the parameter buffer, quantised against the model copy once complete
  (``prepare_param_delta``); the bucket group then sends it (see megatron_grpo.comm.dynamic). Frozen stable units are not copied (nothing changed).
* ``state_dict``: skipped params make torch Adam's per-param ``step`` counters differ, and
  megatron asserts a single one; the checkpoint stores the largest (the optimizer's iteration)
  and GRPO's rank state keeps the exact per-param counters (``param_steps``).
* ``_get_main_param_and_optimizer_states`` (what every save format reads): state the memory tier
  holds away is read from its store into host memory, never brought back to the device.

With fp32 parameters megatron's main params are views of the model params; GRPO gives them
their own storage (as bf16 training already has) so the owner's exact master and every rank's
model copy can differ by the compression error while the copies stay bit-identical.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_grpo.comm.dynamic import prepare_param_delta
from megatron_grpo.megatron.options import check_model_options, check_optimizer_options


class GRPODistributedOptimizer(DistributedOptimizer):
    grpo = None  # GRPOController, bound by bind()
    placement = None  # TierPlacement of the memory tier (--grpo-offload), set by build_placement
    outer_sync = None  # OuterSync of the periodic tiers between instances (megatron/outer.py)
    grad_shards = None  # GradShards of the memory tier (megatron/grad_shards.py), if gradients move
    # Unbound (megatron's own tests swap this class in): no gradient is away. bind() and each
    # step give the instance its own; the class's is never changed in place.
    _grads_away: Dict[int, list] = {}
    _norm = None

    def bind(self, controller) -> None:
        # GRPO features a model option cannot carry, refused before the first step: here as well
        # as in get_grpo_optimizer, since a script may build the optimizer without grpo_config.
        check_model_options(controller.config, [getattr(c, "config", None) for c in
                                                getattr(self, "model_chunks", None) or []],
                            _rank(), getattr(controller, "dp_size", None))
        self.grpo = controller
        self._grpo_copied_units = set()  # units whose weights the memory tier's stream copied
        self._grads_away: Dict[int, list] = {}  # unit -> [(model param, shard)] whose grad is away
        self._norm = None  # this step's gradient norm, for the clipping of gradients away
        # Separate master storage for fp32 params (bf16 params already have fp32 masters).
        for group in self.shard_fp32_groups:
            for shard in group:
                shard.data = shard.data.clone()
        if controller.outer.active:
            from megatron_grpo.megatron.outer import OuterSync

            self.outer_sync = OuterSync(self, controller)

    # -- helpers ---------------------------------------------------------------------------------
    def _pairs(self):
        """(model param, shard main param) for every param with a shard on this rank."""
        for model_groups, shard_groups in ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
                                           (self.model_fp32_groups, self.shard_fp32_groups)):
            for model_group, shard_group in zip(model_groups, shard_groups):
                yield from zip(model_group, shard_group)

    def _bucket_of(self, model_param):
        gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
        return self.buffers[gbuf_index].buckets[bucket_id]

    # -- replaces DistributedOptimizer._copy_model_grads_to_main_grads ------------------------------
    def _copy_model_grads_to_main_grads(self):
        ctrl = self.grpo
        if ctrl is None:
            return super()._copy_model_grads_to_main_grads()
        if self.outer_sync is not None:
            self.outer_sync.capture()  # before the inner step: anchors of newly periodic units
        self._grads_away, self._norm = {}, None
        for model_param, shard in self._pairs():
            bucket = self._bucket_of(model_param)
            unit = ctrl.unit_of_bucket[id(bucket)]
            if not ctrl.unit_active(unit):
                shard.grad = None
                continue
            grads = getattr(bucket, "grpo_grads", None)
            if grads is not None and grads.placed(model_param):
                # On host memory or SSD until its unit's update (bring_grads). Never one of
                # megatron's separate grad-norm groups: refused at build (build_placement).
                shard.grad = None
                self._grads_away.setdefault(unit, []).append((model_param, shard))
                continue
            shard.grad = self._main_grad(model_param, bucket)
        if self._grads_away:
            # Backward is over: start reading back the shards the step updates first.
            self.grad_shards.expect([u for u in self.placement.windows(ctrl.step.stable_update)
                                     if u in self._grads_away])

    def _main_grad(self, model_param, bucket) -> torch.Tensor:
        ranges = self._get_model_param_range_map(model_param)
        grads = getattr(bucket, "grpo_grads", None)
        if grads is None:  # megatron's own: a view of the whole-model gradient buffer
            grad = model_param.main_grad.view(-1)[ranges["param"].start:ranges["param"].end]
        else:  # --grpo-release-grads: the shard kept after the sync (grad_storage.py)
            grad = grads.param_grad(model_param, ranges["param"], ranges["gbuf_world_in_bucket"])
        return grad.float()

    def bring_grads(self, unit: int) -> list:
        """The memory tier's stream, before ``unit``'s update: its gradient shards back on the
        device as main grads, clipped as megatron clipped the resident ones (its own function,
        the same norm: the same multiplication). Returns the shard params given a gradient."""
        pairs = self._grads_away.pop(unit, [])
        if not pairs:
            return []
        self.grad_shards.fetch(unit)
        for model_param, shard in pairs:
            shard.grad = self._main_grad(model_param, self._bucket_of(model_param))
        if self.config.clip_grad > 0.0:
            from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

            if self._norm is None:
                raise RuntimeError("GRPO memory tier: gradients came back for an update before "
                                   "the step's gradient norm was taken")
            clip_grad_by_total_norm_fp32([s for _, s in pairs], self.config.clip_grad, self._norm,
                                         self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return [s for _, s in pairs]

    def grads_still_away(self) -> List[int]:
        """Units whose gradients were away and never brought back this step (must be none)."""
        return sorted(self._grads_away)

    # -- replaces MegatronOptimizer.get_main_grads_for_grad_norm (megatron <= 0.18) and
    #    get_grads_for_grad_norm (0.19 and later; compat.GRAD_NORM_METHODS) -------------------------
    def get_main_grads_for_grad_norm(self):
        """megatron's list, with each gradient the memory tier holds away represented by its
        norm taken at release (a one-element tensor: its norm is that norm exactly), in the
        same place in the list."""
        with self._away_grads_stand_in() as norms_for:
            return norms_for(super().get_main_grads_for_grad_norm())

    def get_grads_for_grad_norm(self, grad_norm_group=None):
        """megatron 0.19's name (and its separate grad-norm groups, e.g. MTP): as above. Only
        the old name overridden, gradients away dropped out of the norm (0.0 in a step where
        every gradient was away) and clipping was silently weakened."""
        with self._away_grads_stand_in() as norms_for:
            return norms_for(super().get_grads_for_grad_norm(grad_norm_group))

    @contextlib.contextmanager
    def _away_grads_stand_in(self):
        """While megatron builds its list (its own filters: shared, TP duplicates, norm groups,
        whatever the version), each shard whose gradient is away carries a stand-in gradient
        of one element broadcast to its shape (no memory); the stand-ins in megatron's list are
        then replaced by the norms taken at release, so the list keeps megatron's order."""
        stand_ins = {}
        for pairs in self._grads_away.values():
            for _, shard in pairs:
                if shard.grad is None:
                    shard.grad = torch.zeros(1, dtype=shard.dtype, device=shard.device).expand(shard.shape)
                    stand_ins[id(shard.grad)] = shard

        def norms_for(grads):
            return [self.grad_shards.norm_of(stand_ins[id(g)]).reshape(1) if id(g) in stand_ins else g
                    for g in grads]
        try:
            yield norms_for
        finally:
            for shard in stand_ins.values():
                shard.grad = None

    # -- extends DistributedOptimizer.prepare_grads (megatron's found-inf path) --------------------
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """megatron's own check (with a grad scaler), then GRPO's: a non-finite value in any
        gradient this rank applies, or in a delayed stable unit's held local gradient, skips the
        step on every rank (the flag is all-reduced over the whole job), exactly as megatron skips an fp16 overflow step. The
        controller then leaves residuals, accumulators and importance as they were; without the
        check, one Inf in a dynamic bucket made its error-feedback chunk non-finite for good."""
        ctrl = self.grpo
        if self.placement is not None and ctrl is not None:
            # First use of optimizer state in the step: offloaded state this step updates must
            # be back (prefetched a step ahead; any wait is reported as offload_stall_s).
            self.placement.ensure(ctrl.step.stable_update)
        found = super().prepare_grads()
        if ctrl is None:
            return found
        device = ctrl.device
        flag = torch.full((1,), 1.0 if found else 0.0, dtype=torch.float32, device=device)
        grads = [shard.grad for _, shard in self._pairs() if shard.grad is not None] if not found else []
        grads += [g for g in ctrl.held_gradients()] if not found else []
        if not found:  # gradients away: their norms, taken at release, say as much
            grads += [self.grad_shards.norm_of(s).reshape(1)
                      for pairs in self._grads_away.values() for _, s in pairs]
        if grads:
            # Sum of norms is finite iff every gradient is (one fused kernel per dtype).
            norms = torch._foreach_norm(grads)
            flag += (~torch.isfinite(torch.stack([n.float() for n in norms]).sum())).float().to(device)
        # Over the whole job, whatever megatron found: its grad-stats group is one instance with
        # --num-distributed-optimizer-instances > 1, and instances that disagree on skipping
        # would issue different collectives (the outer sync) and diverge.
        with ctrl.counter.tag("grpo_control"):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        found = bool(flag.item() > 0)
        ctrl.note_nonfinite(found)
        return found

    # -- extends DistributedOptimizer.step_with_ready_grads (run only for an applied step) ---------
    def step_with_ready_grads(self) -> bool:
        ctrl = self.grpo
        if ctrl is not None and self.placement is None:
            # Every optimizer found its gradients finite (megatron calls this only then), so the
            # step is applied: the staged error-feedback residuals become the residuals now, and
            # the old ones (kept in case the step were skipped) are freed before Adam's peak
            # rather than after it. With the memory tier their write-out waits for the step's
            # end, off the streamed state's copies (GRPOController.end_step).
            ctrl.ef.commit()
        if ctrl is not None:
            ctrl.note_applied()
        return super().step_with_ready_grads()

    # -- extend MegatronOptimizer.get_grad_norm / clip_grad_norm -----------------------------------
    def get_grad_norm(self):
        """megatron's norm is taken over the instance (its grad-stats group). With periodic tiers
        each instance's local gradients differ, so the norms, hence the clipping coefficients,
        would differ, and the units synced every step would drift apart between instances.
        Every instance uses sqrt(mean over instances of norm^2) instead: the same norm for a
        synced model, one common coefficient everywhere."""
        norm = super().get_grad_norm()
        if self.outer_sync is not None:
            norm = self.outer_sync.common_norm(norm)
        self._norm = norm  # the clipping of gradients brought back later uses it
        return norm

    def clip_grad_norm(self, clip_grad: float) -> float:
        """megatron's, with the norm from get_grad_norm (megatron's own takes it directly); the
        gradients away are clipped when they come back (bring_grads)."""
        if self.outer_sync is None and not self._grads_away:
            return super().clip_grad_norm(clip_grad)
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        norm = self.get_grad_norm()
        params = self.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, clip_grad, norm,
                                         self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return norm

    # -- replaces DistributedOptimizer._copy_main_params_to_model_params ----------------------------
    def _copy_main_params_to_model_params(self, units=None):
        """``units``: copy only these units now (the memory tier's stream, right after their
        update, before their masters leave); the call megatron makes after the step then skips
        them."""
        ctrl = self.grpo
        if ctrl is None:
            return super()._copy_main_params_to_model_params()
        if units is None and self.outer_sync is not None:
            # The inner step is applied (megatron skips this copy on a skipped step): the periodic
            # tiers due now average their deltas across instances, before the instance's gather.
            self.outer_sync.sync()
        # Hierarchical (partial distributed optimizer): the parameter all-gather stays inside the
        # instance and is megatron's exact one.
        compress = (ctrl.config.compress_param_gather
                    and getattr(self.ddp_config, "num_distributed_optimizer_instances", 1) == 1)
        rank = self.data_parallel_group.rank()
        copied = self._grpo_copied_units
        staged_now = {}
        for model_param, shard in self._pairs():
            bucket = self._bucket_of(model_param)
            unit = ctrl.unit_of_bucket[id(bucket)]
            if not ctrl.unit_active(unit) or (units is not None and unit not in units) \
                    or (units is None and unit in copied):
                continue
            world_range = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
            param_flat = bucket.param_data.view(-1)
            if compress and ctrl.unit_compressor(unit) is not None:
                shard_len = param_flat.numel() // self.data_parallel_group.size()
                index = (unit, self._bucket_index_in_group(ctrl, unit, bucket))
                staged = ctrl.staging.get(index)
                if staged is None:
                    # Start from the current model copy so untouched (padding) ranges send 0.
                    staged = param_flat[rank * shard_len:(rank + 1) * shard_len].detach().float().clone()
                    ctrl.staging[index] = staged
                    staged_now[index] = (param_flat, ctrl.unit_compressor(unit))
                start = world_range.start - rank * shard_len
                staged[start:start + world_range.size].copy_(shard.detach().view(-1))
            else:
                param_flat[world_range.start:world_range.end].copy_(shard.detach().view(-1))
        # Each staged shard is complete now: keep its quantised update, not the fp32 copy.
        dp = self.data_parallel_group.size()
        for index, (param_flat, compressor) in staged_now.items():
            ctrl.staging[index] = prepare_param_delta(param_flat, ctrl.staging[index], compressor, dp,
                                                      rank, ctrl.replicated.get(index))
        if units is not None:
            copied.update(units)
        else:
            copied.clear()  # the step's last copy: the next step starts afresh

    @staticmethod
    def _bucket_index_in_group(ctrl, unit: int, bucket) -> int:
        for i, b in enumerate(ctrl.units[unit].group.buckets):
            if b is bucket:
                return i
        raise KeyError("bucket not in its GRPO unit")

    # -- replaces DistributedOptimizer.state_dict -------------------------------------------------
    @contextlib.contextmanager
    def _uniform_steps(self):
        """Temporarily give every param the optimizer's iteration as Adam ``step``."""
        state = self.optimizer.state
        saved = {p: s["step"] for p, s in state.items() if "step" in s}
        if saved:
            top = max(float(v) for v in saved.values())
            for p in saved:
                state[p]["step"] = torch.tensor(top)
        try:
            yield
        finally:
            for p, v in saved.items():
                state[p]["step"] = v

    def state_dict(self):
        with self._uniform_steps():
            return super().state_dict()

    # -- replaces DistributedOptimizer._get_main_param_and_optimizer_states (the save's reads) ---
    def _get_main_param_and_optimizer_states(self, model_param):
        """megatron's {"param": master shard, "exp_avg": ..., ...} of ``model_param``, each
        tensor the memory tier holds away replaced by a host copy of its bytes read from the
        store (TierPlacement.saved_tensor), so a checkpoint brings no state back to the device.
        megatron only references these tensors here (the precision-aware optimizer, which would
        unscale them, is refused: options.py); every save format reads through this method."""
        tensors = super()._get_main_param_and_optimizer_states(model_param)
        if self.placement is None:
            return tensors
        return {k: self.placement.saved_tensor(v) if torch.is_tensor(v) else v
                for k, v in tensors.items()}

    def param_steps(self) -> List[float]:
        """Per-param Adam step counters in inner-optimizer order (rank-local)."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p, {})
                out.append(float(st["step"]) if "step" in st else 0.0)
        return out

    def load_param_steps(self, steps: List[float]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(steps) != len(params):
            raise ValueError(f"checkpoint has Adam steps for {len(steps)} params, this rank's "
                             f"optimizer has {len(params)}: resume with the same layout")
        for p, s in zip(params, steps):
            if "step" in self.optimizer.state.get(p, {}):
                self.optimizer.state[p]["step"] = torch.tensor(s)


def named_param_steps(optimizer, names: Dict, stage: int) -> Dict[str, float]:
    """This rank's Adam step counter of every model parameter it holds a shard of, keyed
    ``"stage{pp}/{name}"`` (names repeat across pipeline stages; TP and DP copies of one
    parameter share a counter, since tiers are planned for the whole replica)."""
    out = {}
    for o in grpo_optimizers(optimizer):
        for model_param, shard in o._pairs():
            st = o.optimizer.state.get(shard, {})
            if "step" in st:
                out[f"stage{stage}/{names[model_param]}"] = float(st["step"])
    return out


def load_named_param_steps(optimizer, names: Dict, stage: int, steps: Dict[str, float]):
    """Set every shard's Adam step from ``steps`` (named_param_steps of any layout with the same
    pipeline stages). Returns (restored, missing) counts; a missing one keeps megatron's loaded
    step (the largest at save)."""
    restored = missing = 0
    for o in grpo_optimizers(optimizer):
        for model_param, shard in o._pairs():
            st = o.optimizer.state.get(shard, {})
            if "step" not in st:
                continue
            value = steps.get(f"stage{stage}/{names[model_param]}")
            if value is None:
                missing += 1
            else:
                st["step"] = torch.tensor(value)
                restored += 1
    return restored, missing


def grpo_optimizers(optimizer) -> List[GRPODistributedOptimizer]:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, GRPODistributedOptimizer)]


def get_grpo_optimizer(config, model_chunks, grpo_config=None, **kwargs):
    """megatron's ``get_megatron_optimizer`` with GRPODistributedOptimizer in place of
    DistributedOptimizer (megatron looks the class up by name when it builds optimizers, so the
    swap is scoped to this call). Returns what megatron returns (usually a ChainedOptimizer)."""
    import megatron.core.optimizer as mopt

    if not config.use_distributed_optimizer:
        raise ValueError("GRPO runs inside megatron's distributed optimizer: set "
                         "--use-distributed-optimizer (OptimizerConfig.use_distributed_optimizer=True)")
    check_optimizer_options(config, _rank())
    if grpo_config is not None:  # before megatron allocates any optimizer state
        check_model_options(grpo_config, [getattr(c, "config", None) for c in model_chunks],
                            _rank(), _dp_size())
    original = mopt.DistributedOptimizer
    mopt.DistributedOptimizer = GRPODistributedOptimizer
    try:
        return mopt.get_megatron_optimizer(config, model_chunks, **kwargs)
    finally:
        mopt.DistributedOptimizer = original


def optimizer_state(optimizer) -> Dict:
    opts = grpo_optimizers(optimizer)
    return {"param_steps": [o.param_steps() for o in opts],
            "outer": [o.outer_sync.state_dict() if o.outer_sync is not None else None for o in opts]}


def load_optimizer_state(optimizer, state: Dict) -> None:
    """Per-rank optimizer extras; call after megatron's load (the outer sync's per-instance
    masters and moments replace the ones megatron restored from instance 0)."""
    opts = grpo_optimizers(optimizer)
    for o, steps in zip(opts, state.get("param_steps", [])):
        o.load_param_steps(steps)
    for o, outer in zip(opts, state.get("outer", [None] * len(opts))):
        if o.outer_sync is not None:
            o.outer_sync.load_state_dict(outer)


def _dp_size():
    """The data-parallel x context-parallel size megatron reduces gradients over (what the
    controller's group spans), or None before megatron's parallel state exists."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return ps.get_data_parallel_world_size(with_context_parallel=True)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
