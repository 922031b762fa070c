"""GRPOBucketGroup: megatron-core's bucket group with per-tier gradient and parameter sync.

Thin overrides of ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup``
(0.16.1); each names the upstream method it replaces:

* ``start_grad_sync``: importance is measured from the bucket's local gradient first (the
  bucket-ready path, during backward; on a side CUDA stream on GPU). Then by tier: an exact
  core (the warm-up, or --grpo-core-compressor none) and a stable unit on its update step call
  megatron's own method (bit-identical to the baseline); dynamic, and core with its int8
  default, send a compressed reduce-scatter with error feedback; a stable unit between
  updates sends nothing (delayed mode accumulates the gradient locally).
* ``finish_grad_sync``: waits on whichever handle the tier produced (RU; sync_handles.py).
* ``start_param_sync``: exact core/stable-update use megatron's all-gather; compressed units
  send the owners' quantised parameter deltas; a stable unit between updates has nothing new
  to send.

With megatron's partial distributed optimizer (``num_distributed_optimizer_instances`` > 1, one
instance per node) GRPO acts on the traffic between instances only: inside an instance every
tier reduce-scatters and all-gathers exactly (megatron's own collectives), and a compressing
tier all-reduces its shard across instances through ``comm.hierarchical`` instead of
megatron's exact all-reduce. The parameter all-gather stays inside the instance, so it is
megatron's exact one for every tier.

The class is installed by swapping ``__class__`` on the groups DDP built, so megatron's own
bucket layout, ready-count bookkeeping and overlap with backward stay as they are.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from megatron_grpo.comm.dynamic import CompressedReduceScatter, gather_param_delta, prepare_param_delta
from megatron_grpo.comm.hierarchical import InterInstanceAllReduce
from megatron_grpo.comm.powersgd import PowerSGDReduceScatter
from megatron_grpo.comm.replicated import bucket_ranges
from megatron_grpo.megatron import compat, grad_accum
from megatron_grpo.megatron.options import sum_scaling_factor
from megatron_grpo.megatron.sync_handles import Completed as _Completed, Handles as _Handles
from megatron_grpo.megatron.sync_handles import comm_order, wait_for_grad_sync


class GRPOBucketGroup(_ParamAndGradBucketGroup):
    grpo = None          # GRPOController, set by install()
    grpo_unit = -1       # index of this group's tier unit
    grpo_storage = None  # GradStorage of its DDP chunk with --grpo-release-grads (grad_storage.py)

    # -- helpers -----------------------------------------------------------------------------
    @property
    def _group(self):
        return self.intra_distributed_optimizer_instance_group

    @property
    def _hierarchical(self) -> bool:
        """Partial distributed optimizer: exact inside an instance, GRPO between instances."""
        return getattr(self.ddp_config, "num_distributed_optimizer_instances", 1) > 1

    def _own_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a bucket buffer inside its instance (megatron's layout)."""
        size = self._group.size()
        shard = flat.numel() // size
        rank = self._group.rank()
        return flat[rank * shard:(rank + 1) * shard]

    def _replicated_in_shard(self, i: int, bucket) -> Optional[torch.Tensor]:
        """Offsets, in this rank's shard inside its instance, of the bucket's tensor-parallel
        replicated elements (None without any): they cross instances exactly."""
        rep = self.grpo.replicated.get((self.grpo_unit, i))
        if rep is None:
            return None
        cache = self.__dict__.setdefault("_grpo_shard_replicated", {})
        if i not in cache:
            shard = bucket.grad_data.numel() // self._group.size()
            start = self._group.rank() * shard
            index = rep.index
            offsets = index[(index >= start) & (index < start + shard)] - start
            # The same shard position in every instance: all members agree on None.
            cache[i] = offsets if offsets.numel() else None
        return cache[i]

    def _sum_factor(self, bucket) -> float:
        """What a rank's gradient is scaled by before a collective GRPO issues, which *sums*:
        megatron's ``gradient_scaling_factor``, and with ``average_in_collective`` (factor 1.0,
        ReduceOp.AVG, a 1/n pre-multiplication in NCCL) the 1/n of the average over all
        data-parallel x context-parallel ranks (intra-instance AVG, then inter-instance AVG)."""
        if not getattr(self.ddp_config, "average_in_collective", False):
            return bucket.gradient_scaling_factor
        size = self.intra_distributed_optimizer_instance_size
        if self._hierarchical:
            size *= self.inter_distributed_optimizer_instance_group.size()
        return sum_scaling_factor(bucket.gradient_scaling_factor, True, size)

    def _side_stream(self):
        stream = self.grpo.side_stream
        if stream is None:
            return contextlib.nullcontext()
        # The side stream first waits for the backward kernels that produced the gradients;
        # the collectives issued under it then wait for the importance kernels, not the reverse,
        # so backward keeps running while importance is computed. A compressed sync also
        # decodes here (sync_handles.py): the main stream waits on its "decoded" event; for
        # other units it joins the side stream in finish_grad_sync (and the controller at end of
        # step): a held stable unit has nothing else carrying that dependency to zero_grad_buffer.
        stream.wait_stream(self.grpo.current_stream())
        return self.grpo.stream_context(stream)

    def _add_pending(self, scale_first: bool, multiplier: float = 1.0) -> None:
        """Deliver carried residuals (a unit that left the dynamic tier) with this sync. The
        carry is removed only when the step is applied (GRPOController.end_step), so a skipped
        step delivers it again next time."""
        for i, b in enumerate(self.buckets):
            carry = self.grpo.use_carry((self.grpo_unit, i))
            if carry is None:
                continue
            # Megatron scales by gradient_scaling_factor (or averages) inside start_grad_sync;
            # the carry is already scaled, so pre-divide it when the exact path scales afterwards.
            factor = self._sum_factor(b)
            value = carry if scale_first or factor == 1.0 else carry / factor
            if multiplier != 1.0:
                value = value * multiplier
            if value.numel() != b.grad_data.numel():
                # Hierarchical: the residual was this rank's part of the inter-instance
                # all-reduce (its shard, maybe padded); on its own shard the intra-instance
                # reduce-scatter delivers it once.
                own = self._own_shard(b.grad_data)
                own.add_(value[:own.numel()])
                continue
            b.grad_data.add_(value)

    # -- gradient sync (replaces _ParamAndGradBucketGroup.start_grad_sync) ---------------------
    def start_grad_sync(self, force_all_reduce: bool = False):
        ctrl = self.grpo
        if ctrl is None:
            return super().start_grad_sync(force_all_reduce)
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # megatron's first-batch guard: already dispatched from finish_grad_sync
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        grad_accum.fold_group(self)  # --grpo-grad-accumulation host: the earlier micro-batches
        self._start_tiered(force_all_reduce)
        self._in_flight(force_all_reduce)

    def _start_tiered(self, force_all_reduce: bool) -> None:
        ctrl = self.grpo
        unit = self.grpo_unit
        tier = ctrl.tiers[unit]
        with self._side_stream():
            ctrl.observe_importance(unit)
            if ctrl.unit_periodic(unit):
                self._start_local_reduce(tier)
                return
            if tier == "stable" and not ctrl.step.stable_update:
                self._hold_stable_gradient()
                self.grad_reduce_handle = _Completed()
                return
            if tier == "stable" and ctrl.config.stable_delayed:
                self._merge_stable_accumulator()
            compressor = ctrl.unit_compressor(unit)
            if compressor is not None:
                self._start_compressed_reduce(tier, compressor)
                return
            self._add_pending(scale_first=False)
            if not self._hierarchical:
                with ctrl.counter.tag(tier):
                    super().start_grad_sync(force_all_reduce)
        if self.grad_reduce_handle is None and self._hierarchical:
            # megatron's hierarchical sync scales on the current stream and makes its own
            # communication stream wait for the default stream only; run it on the main stream,
            # after the side stream's importance kernels, as megatron expects.
            ctrl.join_side_stream()
            with ctrl.counter.tag(tier):
                super().start_grad_sync(force_all_reduce)
        if self.grad_reduce_handle is None and self.ddp_config.overlap_grad_reduce:
            # Synchronous inside megatron (no async handle): mark it done for finish.
            self.grad_reduce_handle = _Completed()

    def _scale(self) -> None:
        for b in self.buckets:
            factor = self._sum_factor(b)
            if factor != 1.0:
                b.grad_data *= factor

    def _start_compressed_reduce(self, tier: str, compressor) -> None:
        """Dynamic, core with --grpo-core-compressor, or stable with --grpo-stable-mode
        compressed: a compressed reduce-scatter with error
        feedback; on monitoring steps it reports its health sums (megatron_grpo.grpo.health)."""
        ctrl = self.grpo
        self._scale()
        self._add_pending(scale_first=True)
        rank = self._group.rank()
        async_op = self.ddp_config.overlap_grad_reduce
        stats = ctrl.health_stats(self.grpo_unit)
        if self._hierarchical:
            self._start_inter_instance(tier, compressor, async_op, stats)
            return
        handles = []
        with ctrl.counter.tag(tier):
            for i, b in enumerate(self.buckets):
                shard = b.grad_data.numel() // self._group.size()
                out = b.grad_data[rank * shard:(rank + 1) * shard]
                key = (self.grpo_unit, i)
                if ctrl.powersgd is not None and tier == "dynamic":
                    handles.append(PowerSGDReduceScatter(
                        key, b.grad_data, out, ctrl.ef, ctrl.powersgd, ctrl.powersgd_layouts[key],
                        self._group, async_op,
                        tag=lambda: ctrl.counter.tag("dynamic"), replicated=ctrl.replicated.get(key),
                        stats=stats, order=comm_order(ctrl)))
                    continue
                handles.append(CompressedReduceScatter(
                    key, b.grad_data, out, ctrl.ef, compressor, self._group, async_op,
                    replicated=ctrl.replicated.get(key), stats=stats, order=comm_order(ctrl)))
        self.grad_reduce_handle = _Handles(handles) if async_op else _Completed()

    def _start_inter_instance(self, tier: str, compressor, async_op: bool, stats) -> None:
        """Hierarchical: megatron's exact reduce-scatter inside the instance (gradients already
        scaled), then the compressed all-reduce of this rank's shard across instances."""
        ctrl = self.grpo
        inter = self.inter_distributed_optimizer_instance_group
        handles = []
        with ctrl.counter.tag(tier):
            for i, b in enumerate(self.buckets):
                own = self._own_shard(b.grad_data)
                torch.distributed.reduce_scatter_tensor(own, b.grad_data, group=self._group)
                handles.append(InterInstanceAllReduce((self.grpo_unit, i), own, ctrl.ef, compressor,
                                                      inter, async_op, stats=stats,
                                                      exact_offsets=self._replicated_in_shard(i, b),
                                                      order=comm_order(ctrl)))
        self.grad_reduce_handle = _Handles(handles) if async_op else _Completed()

    def _start_local_reduce(self, tier: str) -> None:
        """A periodic tier (local updates): megatron's exact reduce-scatter inside the instance
        only; nothing crosses instances until the outer sync (megatron/outer.py). The sum factor
        (megatron's 1/dp, or the AVG's: ``_sum_factor``) is for a sum over all instances; one instance's sum is scaled by
        I/dp instead, so each instance steps on its own mean gradient. A carried residual (the
        unit left a per-step compressed tier) is owed to the mean over instances: I times it in
        one instance's gradient delivers it once on average."""
        ctrl = self.grpo
        instances = self.inter_distributed_optimizer_instance_group.size()
        for b in self.buckets:
            b.grad_data *= self._sum_factor(b) * instances
        self._add_pending(scale_first=True, multiplier=float(instances))
        async_op = self.ddp_config.overlap_grad_reduce
        handles = []
        with ctrl.counter.tag(tier):
            for b in self.buckets:
                handles.append(torch.distributed.reduce_scatter_tensor(
                    self._own_shard(b.grad_data), b.grad_data, group=self._group, async_op=async_op))
        self.grad_reduce_handle = _Handles(handles) if async_op else _Completed()

    def _hold_stable_gradient(self) -> None:
        """Between updates: frozen units have no gradient; delayed units keep theirs (scaled) in
        the grad buffer, and the controller adds it to the accumulator once the step is applied
        (a skipped step must leave the accumulator as it was)."""
        ctrl = self.grpo
        if not ctrl.config.stable_delayed:
            return
        self._scale()
        for i, b in enumerate(self.buckets):
            # megatron's finalize_model_grads rewrites some elements in place before the step
            # ends (_late_index): their local values are kept now, the rest read at commit.
            late = self._late_index(i, b)
            local = (late, b.grad_data.index_select(0, late)) if late is not None else None
            ctrl.hold((self.grpo_unit, i), b.grad_data, local)

    def _late_index(self, i: int, bucket) -> Optional[torch.Tensor]:
        """Indices in ``bucket`` of the parameters megatron's ``finalize_model_grads`` all-reduces
        in place after the data-parallel sync (``grpo_late_params``, set by install: sequence-
        parallel and qk layernorms over TP, the tied and position embeddings over PP); None
        without any. Taken from the ``main_grad`` views while the bucket is full (a hold)."""
        late = self.__dict__.get("grpo_late_params")
        if not late:
            return None
        cache = self.__dict__.setdefault("_grpo_late_index", {})
        if i not in cache:
            pieces = [torch.arange(start, end, dtype=torch.int64)
                      for p, (start, end) in bucket_ranges(bucket).items() if p in late]
            cache[i] = torch.cat(pieces).to(bucket.grad_data.device) if pieces else None
        return cache[i]

    def _merge_stable_accumulator(self) -> None:
        """Update step in delayed mode: sync the mean gradient of the steps since the last one."""
        for i, b in enumerate(self.buckets):
            key = (self.grpo_unit, i)
            acc = self.grpo.use_accumulator(key)
            if acc is None:
                continue
            total, count = acc
            factor = self._sum_factor(b)
            # total holds scaled gradients; megatron scales the current one inside start_grad_sync.
            b.grad_data.add_(total / factor if factor != 1.0 else total)
            b.grad_data.div_(count + 1)
            self.grpo.accum.release(key)  # with the memory tier: its device copy goes at once

    # -- extends _ParamAndGradBucketGroup.register_grad_ready (overlap_grad_reduce) --------------
    def register_grad_ready(self, param, force_all_reduce: Optional[bool] = False):
        """megatron's, and in the first batch (--grpo-first-batch-overlap, with gradient release)
        the unit's sync starts once every parameter's gradient is ready, as in later batches,
        instead of after backward: otherwise every unit is full at once then (the peak)."""
        super().register_grad_ready(param, force_all_reduce)
        grad_accum.on_grad_ready(self, param)  # before the last micro-batch: to the host
        if not (self.is_first_batch and self.is_last_microbatch and self.grpo is not None
                and self.grpo_storage is not None and self.grpo.config.first_batch_overlap):
            return
        counts = self.per_param_grad_ready_counts
        if self.__dict__.get("_grpo_first_started"):
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            raise RuntimeError(
                f"rank {rank}: GRPO first-batch overlap: a gradient hook of "
                f"unit {self.grpo_unit} ({self.grpo.units[self.grpo_unit].name}) ran "
                f"{counts[param]} times in one backward, after the unit's sync had "
                f"started; run with --no-grpo-first-batch-overlap (megatron then learns the "
                f"count in the first batch)")
        if len(counts) == len(self.params):
            self.__dict__["_grpo_first_started"] = True
            self.start_grad_sync(force_all_reduce)

    # -- replaces _ParamAndGradBucketGroup.finish_grad_sync ------------------------------------
    def finish_grad_sync(self, force_all_reduce: bool = False):
        if self.grpo is None:
            return super().finish_grad_sync(force_all_reduce)
        self.param_gather_dispatched = False
        overlap = self.ddp_config.overlap_grad_reduce
        # megatron's rule (compat.FINISH_FLAG): with overlap, once per iteration, so that a
        # successor group may drain this one (reduce_scatter_with_fp32_accumulation) before the
        # end-of-step loop finishes every group; set only once the wait returned, so the call
        # after a finish that raised still waits. Without overlap each call syncs again.
        if overlap and self.__dict__.get(compat.FINISH_FLAG):
            return
        # Nothing to wait for: finished in backward to bound the units in flight (_in_flight),
        # or a frozen stable unit, which computed no gradient (megatron never marked it ready).
        done = self.__dict__.pop("_grpo_completed", False) or (
            self.grpo.config.stable_frozen and not self.grpo.unit_active(self.grpo_unit)
            and self.grad_reduce_handle is None)
        if not done:
            if not overlap or self.is_first_batch:
                if self.grad_reduce_handle is None:
                    self.start_grad_sync(force_all_reduce)
            self._complete()
        self.__dict__[compat.FINISH_FLAG] = overlap

    # -- extends _ParamAndGradBucketGroup.reset (zero_grad_buffer) ----------------------------------
    def reset(self):
        self.__dict__.pop("_grpo_completed", None)  # a step that ended by an exception
        self.__dict__.pop("_grpo_first_started", None)
        super().reset()
        self.__dict__[compat.FINISH_FLAG] = False  # megatron 0.16/0.17 do not know the flag

    # -- gradient release (megatron/grad_storage.py) -------------------------------------------------
    def _in_flight(self, force_all_reduce: bool) -> None:
        """With overlap, at most ``grad_units_in_flight`` syncs stay outstanding in backward: the
        oldest is finished (waited for) and its full gradient released before this one goes on."""
        storage = self.grpo_storage
        if storage is None:
            return
        self.__dict__["_grpo_keep_full"] = bool(force_all_reduce)  # an all-reduce needs it all
        if not self.ddp_config.overlap_grad_reduce:
            return  # synchronous: finish_grad_sync releases right after
        storage.outstanding.append(self)
        while len(storage.outstanding) > storage.window:
            oldest = storage.outstanding.pop(0)
            oldest._complete()
            oldest.__dict__["_grpo_completed"] = True

    def _release_grads(self) -> None:
        """The sync has finished: each bucket keeps this rank's shard only. Not for a unit
        between stable updates (a delayed one's full gradient is added to its accumulator when
        the step ends; a frozen one has none), nor while error feedback still reads the
        gradient at commit (``ErrorFeedback.references_grad``)."""
        storage = self.grpo_storage
        if storage is None:
            return
        if self in storage.outstanding:
            storage.outstanding.remove(self)
        if self.__dict__.get("_grpo_keep_full") or not self.grpo.unit_active(self.grpo_unit):
            return
        # With the memory tier, shards of units the optimizer step streams leave at once
        # (megatron/grad_shards.py).
        shards = storage.shards if storage.shards is not None and storage.shards.wants(self.grpo_unit) else None
        for i, b in enumerate(self.buckets):
            if not self.grpo.ef.references_grad((self.grpo_unit, i)):
                if shards is not None:
                    shards.release(self.grpo_unit, i, b.grpo_grads)
                else:
                    b.grpo_grads.release()
        storage.released()

    def _complete(self) -> None:
        """Wait for this group's sync (whichever handle its tier produced), then release."""
        if self.grad_reduce_handle is None:
            if not self.ddp_config.overlap_grad_reduce:
                self._release_grads()  # megatron's synchronous collective has returned
                return
            raise AssertionError(
                f"Communication call has not been issued for this bucket "
                f"({len(self.per_param_grad_ready_counts)}/{len(self.params)} params have grad "
                f"available; GRPO unit {self.grpo_unit}, tier {self.grpo.tiers[self.grpo_unit]})")
        wait_for_grad_sync(self)
        self.grad_reduce_handle = None
        self._release_grads()

    # -- replaces _ParamAndGradBucketGroup.start_param_sync ------------------------------------
    def start_param_sync(self, force_sync: bool = False):
        ctrl = self.grpo
        if ctrl is None:
            return super().start_param_sync(force_sync)
        unit = self.grpo_unit
        tier = ctrl.tiers[unit]
        if not ctrl.unit_active(unit):
            # Frozen stable unit: its parameters did not change, every rank already has them.
            self.param_gather_dispatched = True
            return
        compressor = ctrl.unit_compressor(unit)
        if compressor is not None and ctrl.config.compress_param_gather and not self._hierarchical:
            rank = self._group.rank()
            with ctrl.counter.tag(tier):
                for i, b in enumerate(self.buckets):
                    param_flat = b.param_data.view(-1)
                    prepared = ctrl.staging.pop((unit, i), None)
                    if prepared is None:
                        # This rank owns no parameter of the bucket (its shard is padding): it
                        # still joins the gather, sending a zero update, because every rank
                        # must issue the same collectives whatever its data.
                        shard = param_flat.numel() // self._group.size()
                        staged = param_flat[rank * shard:(rank + 1) * shard].to(torch.float32, copy=True)
                        prepared = prepare_param_delta(param_flat, staged, compressor, self._group.size(),
                                                       rank, ctrl.replicated.get((unit, i)))
                    gather_param_delta(param_flat, prepared, compressor, self._group,
                                       replicated=ctrl.replicated.get((unit, i)))
            self.param_gather_dispatched = True
            return
        with ctrl.counter.tag(tier):
            if self.ddp_config.overlap_param_gather:
                super().start_param_sync(force_sync)
            else:
                with ctrl.wait_timer():  # synchronous: the caller waits for it
                    super().start_param_sync(force_sync)
