"""The megatron-core glue of GRPO: the only package that touches megatron-core private classes.

``grpo_hooks(cfg)`` returns the RunHooks that turn the baseline training loop into a
GRPO run: megatron DDP (bucketing kept on all pipeline stages) -> GRPOBucketGroup (per-tier
gradient and parameter sync) -> GRPODistributedOptimizer (per-tier optimizer work), driven by
one GRPOController per model replica.
"""

from __future__ import annotations

from megatron_grpo.hooks import RunHooks
from megatron_grpo.megatron.bucket_group import GRPOBucketGroup, install
from megatron_grpo.megatron.ddp import GRPODistributedDataParallel
from megatron_grpo.megatron.optimizer import (GRPODistributedOptimizer, get_grpo_optimizer,
                                              grpo_optimizers, load_optimizer_state, optimizer_state)


def grpo_hooks(cfg):
    """RunHooks for ``megatron_grpo.training.loop.run`` with GRPO enabled."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.controller import GRPOController

    state = {}

    def after_build(built):
        device = next(built.ddp_model[0].module.parameters()).device
        ctrl = GRPOController(cfg.grpo, built.ddp_model, device, ps.get_data_parallel_group())
        install(built.ddp_model, ctrl)
        for opt in grpo_optimizers(built.optimizer):
            opt.bind(ctrl)
        state["ctrl"], state["built"] = ctrl, built

    def rank_state():
        return {"controller": state["ctrl"].rank_state(),
                "optimizer": optimizer_state(state["built"].optimizer)}

    def load_rank_state(saved):
        state["ctrl"].load_rank_state(saved.get("controller", {}))
        load_optimizer_state(state["built"].optimizer, saved.get("optimizer", {}))

    return RunHooks(
        ddp_class=GRPODistributedDataParallel,
        bucket_size=cfg.grpo.bucket_elements,
        optimizer_factory=lambda opt_config, chunks: get_grpo_optimizer(opt_config, chunks, cfg.grpo),
        after_build=after_build,
        before_step=lambda iteration: state["ctrl"].begin_step(iteration),
        after_step=lambda iteration: state["ctrl"].end_step(),
        step_metrics=lambda iteration, wire, step_time: state["ctrl"].metrics(wire["by_tag"], step_time),
        checkpoint_state=lambda: state["ctrl"].common_state(),
        load_state=lambda saved: state["ctrl"].load_common_state(saved),
        rank_state=rank_state,
        load_rank_state=load_rank_state,
    )


__all__ = ["GRPOBucketGroup", "GRPODistributedDataParallel", "GRPODistributedOptimizer",
           "get_grpo_optimizer", "grpo_hooks", "install"]
