"""What the megatron glue refuses before it changes a model: settings GRPO cannot run under."""

from types import SimpleNamespace

import pytest

from megatron_grpo.megatron.bucket_group import GRPOBucketGroup, install


def test_overlap_param_gather_is_refused_before_any_bucket_group_changes():
    group = SimpleNamespace()
    ctrl = SimpleNamespace(units=[SimpleNamespace(group=group, index=0)])
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=True))
    with pytest.raises(ValueError, match=r"rank 0: GRPO does not support overlap_param_gather "
                                         r"\(DistributedDataParallelConfig, --overlap-param-gather\)"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup) and not hasattr(group, "grpo")


def test_partial_distributed_optimizer_is_refused_before_any_bucket_group_changes():
    group = SimpleNamespace()
    ctrl = SimpleNamespace(units=[SimpleNamespace(group=group, index=0)])
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=False,
                                                       num_distributed_optimizer_instances=2))
    with pytest.raises(ValueError, match=r"rank 0: GRPO does not support the partial distributed "
                                         r"optimizer \(DistributedDataParallelConfig\."
                                         r"num_distributed_optimizer_instances=2\) yet"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup) and not hasattr(group, "grpo")
