"""The DDP, model and optimizer options Megatron users set: each carried or refused at install,
naming the option. The applied gradient under average_in_collective and the
context-parallel group are checked on two gloo ranks in tests/multiproc/test_ddp_options_gloo.py."""

from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.megatron.bucket_group import GRPOBucketGroup
from megatron_grpo.megatron.bucket_install import install
from megatron_grpo.megatron.optimizer import get_grpo_optimizer
from megatron_grpo.megatron.options import sum_scaling_factor


class _Group:
    """A bucket group as install() sees it (a plain class: install swaps its __class__)."""

    def __init__(self, buckets):
        self.buckets = buckets


def _ddp(grad_dtype=torch.float32, ddp=None, tf=None, dp_cp=None, ctrl_dp=2):
    """A DDP chunk and a controller as install() sees them (no process group needed)."""
    bucket = SimpleNamespace(grad_data=torch.zeros(8, dtype=grad_dtype))
    group = _Group([bucket])
    ddp_config = SimpleNamespace(overlap_param_gather=False, num_distributed_optimizer_instances=1,
                                 grad_reduce_in_fp32=grad_dtype == torch.float32, **(ddp or {}))
    chunk = SimpleNamespace(ddp_config=ddp_config, config=SimpleNamespace(**(tf or {})))
    if dp_cp is not None:
        chunk.dp_cp_group = SimpleNamespace(size=lambda: dp_cp)
    from megatron_grpo.grpo.config import GRPOConfig

    ctrl = SimpleNamespace(units=[SimpleNamespace(group=group, index=0)], dp_size=ctrl_dp,
                           config=GRPOConfig(enabled=True), powersgd=None)
    return chunk, ctrl, group


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradient_buffers_are_refused_at_install(dtype):
    # grad_reduce_in_fp32=False with bf16 params: ErrorFeedback.owed refused the buffer at the
    # first compressed step, after the warm-up. Now the run stops before it starts.
    chunk, ctrl, group = _ddp(grad_dtype=dtype)
    with pytest.raises(ValueError, match=r"rank 0: GRPO needs fp32 gradient buffers.*"
                                         r"grad_reduce_in_fp32=False.*--accumulate-allreduce-grads-in-fp32"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup) and not hasattr(group, "grpo")


def test_fp32_buffers_without_grad_reduce_in_fp32_are_accepted():
    # fp32 parameters give fp32 gradient buffers whatever the flag says.
    chunk, ctrl, group = _ddp()
    chunk.ddp_config.grad_reduce_in_fp32 = False
    install([chunk], ctrl)
    assert isinstance(group, GRPOBucketGroup) and group.grpo is ctrl


@pytest.mark.parametrize("ddp, tf, option", [
    ({"fp8_param_gather": True}, {}, "fp8_param_gather"),
    ({}, {"fp8_param": True}, "fp8_param"),
    ({"reuse_grad_buf_for_mxfp8_param_ag": True}, {}, "reuse_grad_buf_for_mxfp8_param_ag"),
])
def test_fp8_parameters_are_refused_at_install(ddp, tf, option):
    chunk, ctrl, group = _ddp(ddp=ddp, tf=tf)
    with pytest.raises(ValueError, match=rf"rank 0: GRPO does not support fp8 parameters \({option};.*"
                                         r"quantize_param_shard"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup)


def test_a_controller_on_the_group_without_context_parallel_ranks_is_refused():
    # megatron reduces over data-parallel x context-parallel ranks (4 here); a controller built
    # on the data-parallel group alone (2) shards replicated elements and sizes wrongly.
    chunk, ctrl, group = _ddp(tf={"context_parallel_size": 2}, dp_cp=4, ctrl_dp=2)
    with pytest.raises(ValueError, match=r"rank 0: the GRPO controller's data-parallel group has 2 "
                                         r"rank\(s\), but megatron's DDP reduces gradients over 4 .*"
                                         r"context_parallel_size=2.*with_context_parallel=True"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup)
    chunk, ctrl, group = _ddp(tf={"context_parallel_size": 2}, dp_cp=4, ctrl_dp=4)
    install([chunk], ctrl)
    assert isinstance(group, GRPOBucketGroup)


@pytest.mark.parametrize("option", ["use_precision_aware_optimizer", "reuse_grad_buf_for_mxfp8_param_ag"])
def test_precision_aware_optimizer_and_mxfp8_reuse_are_refused_before_megatron_builds(option):
    config = SimpleNamespace(use_distributed_optimizer=True, **{option: True})
    with pytest.raises(ValueError, match=rf"rank 0: GRPO does not support .*OptimizerConfig\.{option}"):
        get_grpo_optimizer(config, [])


@pytest.mark.parametrize("factor, average, dp, expect", [
    (1.0 / 8, False, 8, 1.0 / 8),   # megatron pre-scales by 1/dp and sums: GRPO does the same
    (1.0, True, 8, 1.0 / 8),        # megatron's AVG (a 1/dp pre-multiplication in NCCL)
    (1.0, True, 1, 1.0),
    (0.5, True, 4, 0.125),          # expert buckets: edp/dp before an AVG over edp ranks
])
def test_sum_scaling_factor(factor, average, dp, expect):
    assert sum_scaling_factor(factor, average, dp) == expect


def test_fp16_models_are_refused_at_install():
    # megatron's grad scaler would unscale param.grad, which GRPO leaves None on held and
    # offloaded shards (AttributeError), and residuals would carry a changing loss scale.
    chunk, ctrl, group = _ddp(tf={"fp16": True})
    with pytest.raises(ValueError, match=r"rank 0: GRPO does not support fp16 training with loss "
                                         r"scaling \(fp16 on TransformerConfig.*--bf16"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup)
    chunk, ctrl, group = _ddp(tf={"fp16": False, "bf16": True})
    install([chunk], ctrl)
    assert isinstance(group, GRPOBucketGroup)


@pytest.mark.parametrize("options, named", [
    ({"fp16": True}, "fp16"),
    ({"loss_scale": 1024.0}, "loss_scale"),             # a constant scaler, even with bf16
    ({"fp16": True, "loss_scale": 8.0}, "fp16, loss_scale"),
])
def test_fp16_and_loss_scale_are_refused_before_megatron_builds(options, named):
    config = SimpleNamespace(use_distributed_optimizer=True, bf16=False, **options)
    with pytest.raises(ValueError, match=rf"rank 0: GRPO does not support fp16 training with loss "
                                         rf"scaling \({named} on OptimizerConfig.*--bf16"):
        get_grpo_optimizer(config, [])


def test_bf16_without_a_loss_scale_reaches_megatron():
    # The refusal is not a blanket one: bf16 with loss_scale None passes the option checks
    # and fails later only for the empty model this test gives.
    config = SimpleNamespace(use_distributed_optimizer=True, bf16=True, fp16=False, loss_scale=None)
    with pytest.raises(Exception) as err:
        get_grpo_optimizer(config, [])
    assert "GRPO does not support" not in str(err.value)
