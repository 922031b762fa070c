"""The periodic tiers' configuration, schedule and planner figures (no process group)."""

import pytest

from megatron_grpo.grpo.config import GRPOConfig, GRPOConfigError
from megatron_grpo.grpo.outer_schedule import OuterSchedule
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec
from megatron_grpo.planner.internode import internode
from megatron_grpo.training.arguments import ConfigError, parse_args

DATA = ["--data-path", "x"]


def test_preset_source_sets_the_per_tier_periods():
    cfg = GRPOConfig(enabled=True, internode_preset="source")
    cfg.apply_preset()
    cfg.validate()
    assert (cfg.sync_interval("core"), cfg.sync_interval("dynamic"), cfg.sync_interval("stable")) == (100, 50, 200)
    assert (cfg.core_compressor, cfg.compressor, cfg.stable_mode, cfg.retier_interval) == ("none", "int4", "local", 200)
    assert (cfg.core_share, cfg.dynamic_share, cfg.stable_share) == (0.15, 0.65, 0.2)
    assert cfg.periodic
    plain = GRPOConfig(enabled=True)
    plain.apply_preset()
    assert not plain.periodic and plain.sync_interval("dynamic") == 1


@pytest.mark.parametrize("field,value,message", [
    ("dynamic_sync_interval", 0, "--grpo-dynamic-sync-interval must be an integer >= 1"),
    ("core_sync_interval", True, "--grpo-core-sync-interval must be an integer >= 1"),
    ("outer_lr", 0.0, "--grpo-outer-lr must be in (0, 2]"),
    ("outer_momentum", 1.0, "--grpo-outer-momentum must be in [0, 1)"),
    ("internode_preset", "diloco", "--grpo-internode-preset must be one of none, source"),
])
def test_bad_values_name_the_flag(field, value, message):
    with pytest.raises(GRPOConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        GRPOConfig(enabled=True, **{field: value}).validate()


def test_topk_cannot_carry_deltas():
    with pytest.raises(GRPOConfigError, match="--grpo-compressor must be int4 or int8 with --grpo-dynamic-sync-interval"):
        GRPOConfig(enabled=True, compressor="topk", dynamic_sync_interval=4).validate()


def test_periodic_tiers_need_instances_and_refuse_offload():
    with pytest.raises(ConfigError, match="--grpo-dynamic-sync-interval 50 train tiers locally .* set "
                                          "--num-distributed-optimizer-instances N > 1"):
        parse_args([*DATA, "--grpo", "--grpo-dynamic-sync-interval", "50"], world_size=4)
    with pytest.raises(ConfigError, match="--grpo-internode-preset source train tiers locally"):
        parse_args([*DATA, "--grpo", "--grpo-internode-preset", "source"], world_size=4)
    with pytest.raises(ConfigError, match="--grpo-offload cpu with --grpo-stable-mode local"):
        parse_args([*DATA, "--grpo", "--grpo-stable-mode", "local", "--grpo-stable-share", "0.2",
                    "--grpo-dynamic-share", "0.65", "--num-distributed-optimizer-instances", "2",
                    "--grpo-offload", "cpu"], world_size=4)
    cfg = parse_args([*DATA, "--grpo", "--grpo-internode-preset", "source",
                      "--num-distributed-optimizer-instances", "0"], world_size=4)
    assert cfg.grpo.dynamic_sync_interval == 50


def _schedule(**kw):
    cfg = GRPOConfig(enabled=True, stable_share=0.2, dynamic_share=0.65, **kw)
    return OuterSchedule(cfg, instances=2)


def test_schedule_counts_from_the_first_tiering_and_syncs_all_before_a_retier():
    s = _schedule(dynamic_sync_interval=4, stable_mode="local", stable_interval=8)
    assert s.local_tiers == {"dynamic", "stable"}
    synced = {}
    for k in range(1, 30):
        s.plan(k, tiered=k > 6, sync_all=(k == 22))
        if s.pending:
            synced[k] = ("".join(t[0] for t in sorted(s.pending)), s.exact)
        s.applied()
    assert synced == {10: ("d", False), 14: ("ds", False), 18: ("d", False), 22: ("ds", True),
                      26: ("d", False)}


def test_a_skipped_step_keeps_its_sync_pending():
    s = _schedule(dynamic_sync_interval=2)
    s.plan(1, tiered=True, sync_all=False)   # origin 0
    s.plan(2, tiered=True, sync_all=True)
    assert s.due("dynamic") and s.exact
    # Step 2 skipped (no applied()): step 3 still owes the exact sync.
    s.plan(3, tiered=True, sync_all=False)
    assert s.due("dynamic") and s.exact
    assert s.applied() == ["dynamic"] and not s.pending and not s.exact
    state = _schedule(dynamic_sync_interval=2)
    state.load_state_dict(s.state_dict())
    assert state.state_dict() == s.state_dict() == {"origin": 0, "pending": [], "exact": False}


def test_one_instance_has_no_periodic_tier():
    s = OuterSchedule(GRPOConfig(enabled=True, dynamic_sync_interval=4), instances=1)
    assert not s.active
    s.plan(10, tiered=True, sync_all=True)
    assert not s.pending


def test_planner_periodic_bytes():
    m = ModelSpec(num_layers=32, hidden=4096, heads=32, ffn_hidden=14336, flash_attention=True)
    c = ClusterSpec(nodes=2, gpus_per_node=8, instances=2)
    per_step = internode(m, c, GRPOConfig(enabled=True))
    periodic = internode(m, c, GRPOConfig(enabled=True, dynamic_sync_interval=50, retier_interval=500))
    # One dynamic sync is the per-step mode's payload; averaged over 50 steps, plus the exact
    # sync before each re-tier (every 500), which replaces one regular sync.
    assert periodic.hier_dynamic == per_step.hier_dynamic
    expected = periodic.hier_dynamic / 50 + (periodic.exact["dynamic"] - periodic.hier_dynamic) / 500
    assert periodic.per_step("dynamic") == pytest.approx(expected)
    assert periodic.per_step("core") == per_step.per_step("core")
    # GPT 8B-like on 2 nodes: per-step mode 0.148x megatron hierarchical; with the dynamic tier
    # synced every 50 steps the int8 core (every step) is most of what remains: 0.042x.
    assert per_step.ratio == pytest.approx(0.148, abs=0.001)
    assert periodic.ratio == pytest.approx(0.042, abs=0.001)
    assert periodic.per_step("core") > 10 * periodic.per_step("dynamic")
    # The exact sync is megatron's all-reduce of the same shards: 4 bytes per element.
    assert periodic.exact["dynamic"] == pytest.approx(0.85 * per_step.hier_baseline, rel=0.02)
    cfg = GRPOConfig(enabled=True, internode_preset="source")
    cfg.apply_preset()
    source = internode(m, c, cfg)
    assert (source.core_interval, source.dynamic_interval, source.stable_interval) == (100, 50, 200)
    # 200 is a multiple of every period: the exact syncs replace regular ones.
    assert source.per_step("stable") == pytest.approx(source.exact["stable"] / 200)
