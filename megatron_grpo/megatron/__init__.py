"""The megatron-core glue of GRPO: the only package that touches megatron-core private classes.

``grpo_hooks(cfg)`` returns the RunHooks that turn the baseline training loop into a
GRPO run: megatron DDP (bucketing kept on all pipeline stages) -> GRPOBucketGroup (per-tier
gradient and parameter sync) -> GRPODistributedOptimizer (per-tier optimizer work), driven by
one GRPOController per model replica.
"""

from __future__ import annotations

import torch

from megatron_grpo.megatron.compat import check_version

check_version()  # before any glue binds to megatron's classes: a clear stop outside 0.16.1-0.19.x

from megatron_grpo.compute.flops import attention_flops  # noqa: E402
from megatron_grpo.compute.plan import SampledBackward  # noqa: E402
from megatron_grpo.hooks import RunHooks  # noqa: E402  (after the version gate, on purpose)
from megatron_grpo.megatron import sampled_linear  # noqa: E402
from megatron_grpo.megatron.bucket_group import GRPOBucketGroup  # noqa: E402
from megatron_grpo.megatron.bucket_install import install  # noqa: E402
from megatron_grpo.megatron.ddp import GRPODistributedDataParallel  # noqa: E402
from megatron_grpo.megatron.frozen_prefix import FrozenPrefix  # noqa: E402
from megatron_grpo.megatron.optimizer import (GRPODistributedOptimizer, get_grpo_optimizer,  # noqa: E402
                                              grpo_optimizers, load_optimizer_state, optimizer_state)
from megatron_grpo.megatron.resident import resident_by_kind  # noqa: E402
from megatron_grpo.platform.layout import parallel_layout  # noqa: E402


def grpo_data_parallel_group():
    """The group GRPO's controller syncs gradients over: megatron's DDP reduces over the
    data-parallel ranks *with* the context-parallel ones (they hold the same parameters and
    gradients of other sequence chunks), and shards its buffers over them."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)


def run_hooks(cfg) -> RunHooks:
    """The hooks a launcher hands ``megatron_grpo.training.loop.run``: the baseline's (empty)
    ones, or GRPO's with --grpo."""
    return grpo_hooks(cfg) if cfg.grpo.enabled else RunHooks()


def grpo_hooks(cfg):
    """RunHooks for ``megatron_grpo.training.loop.run`` with GRPO enabled (and, with
    --grpo-offload cpu|ssd, the memory tier's placement of the stable tier's state)."""
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.megatron.offload import build_placement, unit_state

    state = {"placement": None}

    def after_build(built):
        device = next(built.ddp_model[0].module.parameters()).device
        ctrl = GRPOController(cfg.grpo, built.ddp_model, device, grpo_data_parallel_group())
        ctrl.final_iteration = cfg.training.train_iters
        install(built.ddp_model, ctrl)
        opts = grpo_optimizers(built.optimizer)
        if ctrl.outer.active and len(opts) > 1:
            # megatron's chained norm over several optimizers bypasses their own get_grad_norm,
            # so instances could clip differently: not supported yet.
            raise ValueError(f"rank {torch.distributed.get_rank()}: GRPO's periodic tiers need one "
                             f"distributed optimizer (this model built {len(opts)}: several parameter "
                             f"dtypes or expert parameters); run with per-step tiers")
        for opt in opts:
            opt.bind(ctrl)
        state["ctrl"], state["built"] = ctrl, built
        # The compute policy: every linear layer counts its FLOPs; with --grpo-sampled-backward
        # those below core sample their backward (megatron_grpo.megatron.sampled_linear).
        group = grpo_data_parallel_group()
        plan = SampledBackward(cfg.grpo, ctrl.layout.num_global, ctrl.layout.local,
                               cfg.training.seed, torch.distributed.get_rank(group))
        m, p = cfg.model, cfg.parallel
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        dp = torch.distributed.get_world_size() // (tp * pp)
        plan.flops.other = attention_flops(m.num_layers // pp, cfg.training.global_batch_size // dp
                                           * m.seq_length, m.seq_length, m.hidden_size // tp)
        # The plan is kept on every rank, wrapped layers or not: its end_step is a collective
        # over every rank of the job, so a rank with no linear layer (a pipeline stage of the
        # embedding alone) must enter it too. Its FLOP count is reported only where a layer
        # counts (a TE model wraps none).
        state["compute"] = plan
        state["flops_counted"] = sampled_linear.install(built.ddp_model, ctrl.units, plan) > 0
        state["prefix"] = FrozenPrefix(built.ddp_model) if cfg.grpo.stable_frozen else None
        state["placement"] = build_placement(cfg.offload, built.optimizer, ctrl,
                                             torch.distributed.get_rank())

    def grad_storages():
        return [s for s in (c.__dict__.get("grpo_grad_storage") for c in state["built"].ddp_model)
                if s is not None]

    def after_step(iteration):
        state["ctrl"].end_step()  # reads a held stable gradient: before the storage goes
        with state["ctrl"].counter.tag("grpo_control"):  # the keep-ratio measurement
            state["compute"].end_step(state["ctrl"].layout.sum_over_replica)
        storages = grad_storages()
        if storages:
            # The step has consumed the shards: no gradient memory until the next backward.
            for opt in grpo_optimizers(state["built"].optimizer):
                for _, shard in opt._pairs():
                    shard.grad = None
            for storage in storages:
                storage.after_step()

    def outer_syncs():
        return [o.outer_sync for o in grpo_optimizers(state["built"].optimizer) if o.outer_sync is not None]

    def before_step(iteration):
        ctrl = state["ctrl"]
        ctrl.begin_step(iteration)
        state["compute"].begin_step(iteration + 1, ctrl.replica_tiers, ctrl.tiered)
        ctrl.estimated_units = state["compute"].estimated_units()
        if state["prefix"] is not None:
            state["prefix"].begin_step()  # after the controller set this step's requires_grad
        if ctrl.left_local:
            # Units that left a periodic tier step on synced gradients from now on: their Adam
            # moments, grown on each instance's own gradients, must agree first.
            for outer in outer_syncs():
                outer.average_moments(ctrl.left_local)
        placement = state["placement"]
        if placement is not None:
            # Optimizer state appears at a parameter's first update: registered as it comes.
            placement.add(unit_state(state["built"].optimizer, ctrl))
            placement.begin_step(ctrl.tiers, ctrl.step.stable_update, ctrl.stable_update_next(),
                                 stream_all=not ctrl.tiered)
            shards = grpo_optimizers(state["built"].optimizer)[0].grad_shards
            if shards is not None:  # which units' gradient shards leave this step
                shards.begin_step(ctrl.step.stable_update)

    def step_metrics(iteration, wire, step_time):
        rec = state["ctrl"].metrics(wire["by_tag"], step_time)
        if state["flops_counted"]:
            rec.update(state["compute"].metrics())
        if state["prefix"] is not None:
            rec["frozen_prefix_layers"] = state["prefix"].cut
        drift = [o.last_drift for o in outer_syncs() if o.last_drift is not None]
        if state["ctrl"].outer_synced and drift:
            # How far this rank's instance had drifted from the mean at the sync (rank 0's shards).
            rec["grpo_outer_drift"] = max(drift)
        if state["placement"] is not None:
            rec.update(state["placement"].step_metrics())
        storages = grad_storages()
        rec.update(resident_by_kind(state["built"].optimizer, state["ctrl"], storages,
                                    state["placement"]))
        if storages:
            # Gradient bytes this rank held at most during the step, and after it (0 expected).
            each = [s.metrics() for s in storages]
            rec["grad_bytes_peak"] = sum(m["grad_bytes_peak"] for m in each)
            # This rank's shards resident at once, at most (the memory tier moves them away).
            rec["grad_shard_bytes_peak"] = sum(m["grad_shard_bytes_peak"] for m in each)
            # megatron's whole-model gradient buffer as allocated at setup (0: never, ddp.py).
            rec["grad_bytes_setup_buffer"] = sum(m["grad_bytes_setup_buffer"] for m in each)
            rec["grad_bytes_after_step"] = sum(m["grad_bytes_resident"] for m in each)
            rec["grad_units_full_after_step"] = sum(m["grad_units_full"] for m in each)
            rec["grad_bytes_whole_buffer"] = sum(m["grad_bytes_whole_buffer"] for m in each)
            rec["grad_bytes_largest_bucket"] = max(m["grad_bytes_largest_bucket"] for m in each)
            # --grpo-grad-accumulation host: host bytes, and this step's parks and folds.
            for key in sorted({k for m in each for k in m if k.startswith("grad_host_accum_")}):
                rec[key] = sum(m.get(key, 0.0) for m in each)
        return rec

    def before_save():
        if state["placement"] is not None:
            # Nothing comes back to the device: the optimizer's state dict reads away state
            # from the store into host memory (optimizer.py, _get_main_param_and_optimizer_states).
            # Bringing it all back made every save the run's peak.
            state["placement"].prepare_save()

    def finish():
        if state["placement"] is not None:
            # The run is over and its last checkpoint written: nothing reads the state again,
            # so it is not brought back (that was the run's peak with the memory tier).
            state["placement"].close(restore=False)
            state["placement"] = None

    def checkpoint_state():
        from megatron_grpo.megatron.reshard import gathered_param_steps

        compute = state["compute"].state_dict()
        return {**state["ctrl"].common_state(), "world_size": torch.distributed.get_world_size(),
                "sampled_backward": compute,
                "layout": parallel_layout(),
                "param_steps": gathered_param_steps(state["built"])}

    def load_state(saved):
        state["saved"] = saved or {}  # load_rank_state compares its world size and layout
        state["ctrl"].load_common_state(saved)
        state["compute"].load_state_dict((saved or {}).get("sampled_backward"))

    def rank_state():
        return {"controller": state["ctrl"].rank_state(),
                "optimizer": optimizer_state(state["built"].optimizer)}

    def load_rank_state(saved):
        common = state.get("saved", {})
        if common.get("world_size", torch.distributed.get_world_size()) != torch.distributed.get_world_size() \
                or common.get("layout", parallel_layout()) != parallel_layout():
            from megatron_grpo.megatron.reshard import resume_elsewhere

            # Another world size: this rank has no saved state of its own (another layout is
            # refused at load; megatron_grpo.megatron.reshard).
            resume_elsewhere(state["built"], state["ctrl"], common)
            return
        state["ctrl"].load_rank_state(saved.get("controller", {}))
        load_optimizer_state(state["built"].optimizer, saved.get("optimizer", {}))

    return RunHooks(
        ddp_class=lambda *a, **kw: GRPODistributedDataParallel(*a, grpo_config=cfg.grpo, **kw),
        bucket_size=cfg.grpo.bucket_elements,
        optimizer_factory=lambda opt_config, chunks: get_grpo_optimizer(opt_config, chunks, cfg.grpo),
        after_build=after_build,
        before_step=before_step,
        after_step=after_step,
        step_metrics=step_metrics,
        checkpoint_state=checkpoint_state,
        load_state=load_state,
        rank_state=rank_state,
        load_rank_state=load_rank_state,
        params_between_syncs=lambda: state["ctrl"].params_between_syncs(),
        before_save=before_save,
        finish=finish,
    )


__all__ = ["GRPOBucketGroup", "GRPODistributedDataParallel", "GRPODistributedOptimizer",
           "get_grpo_optimizer", "grpo_data_parallel_group", "grpo_hooks", "install", "run_hooks"]
