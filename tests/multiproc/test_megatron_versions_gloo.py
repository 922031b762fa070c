"""Two points where megatron-core 0.18 changed what happens around GRPO's overrides, on two real
gloo ranks with megatron's DDP and GRPO's distributed optimizer (real megatron-core 0.16.1,
with the 0.18 behaviour reproduced from its source; megatron/compat.py names both):

* ``grad_norm_skip_threshold`` (0.18, ChainedOptimizer.step): megatron skips the update after
  ``prepare_grads`` found the gradients finite, without calling ``step_with_ready_grads``.
  GRPO must then leave its error-feedback residuals as they were (they belong to an update Adam
  never took); before, the controller committed them.
* ``finish_grad_sync`` called twice in one iteration (0.18: a bucket group drains its
  predecessor under reduce_scatter_with_fp32_accumulation, then the end-of-step loop finishes
  every group): the second call must be a no-op; before, GRPO's override raised.
"""

import functools

from harness import megatron_rank, spawn_ranks

LAYERS, WIDTH, BUCKET = 3, 32, 1000  # a bucket group per layer


def _step_018(optimizer, threshold):
    """megatron-core 0.18.2's ChainedOptimizer.step, reduced to what decides the update:
    ``found_inf_flag = self.prepare_grads()`` ... ``grad_norm = self.get_grad_norm()`` ...
    ``if grad_norm > optimizer.config.grad_norm_skip_threshold: should_skip_update = True``
    ... ``update_successful = False if should_skip_update else self.step_with_ready_grads()``."""
    if optimizer.prepare_grads():
        return False
    norm = optimizer.get_grad_norm()
    if norm > threshold:
        return False
    return optimizer.step_with_ready_grads()


def _run(rank):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.megatron import get_grpo_optimizer, grpo_data_parallel_group, grpo_optimizers, install

    tf = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp = DistributedDataParallel(tf, DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=BUCKET,
        grad_reduce_in_fp32=True), module)
    optimizer = get_grpo_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                   clip_grad=0.0), [ddp])
    ctrl = GRPOController(GRPOConfig(enabled=True, compress="all", warmup_iters=100, compressor="int4"), [ddp],
                          torch.device("cpu"), grpo_data_parallel_group())
    install([ddp], ctrl)
    for opt in grpo_optimizers(optimizer):
        opt.bind(ctrl)
    ctrl.tiers = ["dynamic"] * len(ctrl.units)
    ctrl.tiered = True

    def residuals():
        return {str(k): ctrl.ef.residual(k).clone() for k in ctrl.ef.keys()}

    def params():
        return torch.cat([p.detach().view(-1).clone() for p in module.parameters()])

    out = {"second_finish": "no error", "applied": [], "skipped_steps": []}
    snapshots = []
    for step, threshold in enumerate((float("inf"), 0.0, float("inf"))):  # the middle one skipped
        ctrl.begin_step(step + 1)
        ddp.zero_grad_buffer()
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
        module(x).square().mean().backward()
        ddp.finish_grad_sync()
        if step in (0, 2):  # the first batch (megatron starts the sync in finish) and a later one
            group = ddp.bucket_groups[0]
            synced = [b.grad_data.clone() for b in group.buckets]
            try:  # 0.18's end-of-step loop after a successor's drain: a second finish
                group.finish_grad_sync()
                if not all(torch.equal(a, b.grad_data) for a, b in zip(synced, group.buckets)):
                    out["second_finish"] = f"step {step}: the gradient was reduced again"
            except Exception as exc:
                out["second_finish"] = f"step {step}: {type(exc).__name__}: {exc}"
        before = (residuals(), params())
        out["applied"].append(bool(_step_018(optimizer, threshold)))
        ctrl.end_step()
        out["skipped_steps"].append(ctrl.skipped_steps)
        snapshots.append((before, (residuals(), params())))
    (res_before, par_before), (res_after, par_after) = snapshots[1]
    out["residual_keys"] = len(res_before)
    out["skip_left_residuals"] = res_before.keys() == res_after.keys() and all(
        torch.equal(res_before[k], res_after[k]) for k in res_before)
    out["skip_left_params"] = torch.equal(par_before, par_after)
    (res_before, _), (res_after, _) = snapshots[2]
    out["applied_changed_residuals"] = any(not torch.equal(res_before[k], res_after[k]) for k in res_before)
    return out


def test_an_update_megatron_skips_after_the_finite_check_leaves_grpo_state_and_finish_is_once():
    for r in spawn_ranks(functools.partial(megatron_rank, body=_run), 2, timeout=240):
        assert "error" not in r, r["error"]
        assert r["second_finish"] == "no error"
        assert r["applied"] == [True, False, True]
        assert r["skipped_steps"] == [0, 1, 1]           # the controller saw the skip
        assert r["residual_keys"] == LAYERS
        assert r["skip_left_params"]                      # megatron did skip the update ...
        assert r["skip_left_residuals"]                   # ... and GRPO kept its residuals
        assert r["applied_changed_residuals"]             # an applied step does move them
