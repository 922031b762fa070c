"""What the megatron glue refuses before it changes a model: settings GRPO cannot run under."""

from types import SimpleNamespace

import pytest

from megatron_grpo.megatron.bucket_group import GRPOBucketGroup
from megatron_grpo.megatron.bucket_install import install


def test_overlap_param_gather_is_refused_before_any_bucket_group_changes():
    group = SimpleNamespace()
    ctrl = SimpleNamespace(units=[SimpleNamespace(group=group, index=0)])
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=True))
    with pytest.raises(ValueError, match=r"rank 0: GRPO does not support overlap_param_gather "
                                         r"\(DistributedDataParallelConfig, --overlap-param-gather\)"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup) and not hasattr(group, "grpo")


@pytest.mark.parametrize("ctrl_extra, message", [
    ({"replicated": {}, "powersgd": object()},
     r"rank 0: --grpo-compressor powersgd does not support --num-distributed-optimizer-instances 2"),
])
def test_partial_distributed_optimizer_refuses_what_it_does_not_carry(ctrl_extra, message):
    # The hierarchy is built for the quantisers; PowerSGD's factors would reach the
    # wrong ranks between instances.
    group = SimpleNamespace()
    ctrl = SimpleNamespace(units=[SimpleNamespace(group=group, index=0)], **ctrl_extra)
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=False,
                                                       num_distributed_optimizer_instances=2))
    with pytest.raises(ValueError, match=message):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup) and not hasattr(group, "grpo")


def test_periodic_tiers_with_one_instance_are_refused_at_install():
    # --num-distributed-optimizer-instances 0 resolves to 1 on a single node: the periodic tiers
    # would have nothing to sync across, so the run stops before any bucket group changes.
    from megatron_grpo.grpo.config import GRPOConfig

    group = SimpleNamespace()
    ctrl = SimpleNamespace(units=[SimpleNamespace(group=group, index=0)], dp_size=2,
                           config=GRPOConfig(enabled=True, dynamic_sync_interval=50))
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=False,
                                                       num_distributed_optimizer_instances=1))
    with pytest.raises(ValueError, match=r"rank 0: GRPO's periodic tiers .* this run has one"):
        install([chunk], ctrl)
    assert not isinstance(group, GRPOBucketGroup) and not hasattr(group, "grpo")
