"""TierPlanner quotas, rounding, hysteresis, guard and remediation; GVRMonitor; GVR."""

import math
import random

import pytest
import torch

from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.grpo.tiers import (
    TIERS,
    GVRMonitor,
    TierPlan,
    TierPlanner,
    describe_moves,
    gradient_variance_ratio,
    relative_error,
)


def planner(core=0.15, dynamic=0.65, stable=0.20, hysteresis=0.1, max_dynamic=0.70):
    return TierPlanner(core, dynamic, stable, hysteresis, max_dynamic)


def members(plan, tier):
    return [b for b, t in enumerate(plan.tiers) if t == tier]


# ---------------------------------------------------------------------- quotas and rounding
def test_twenty_equal_buckets_split_3_13_4_by_density():
    density = [float((b * 7) % 20 + 1) for b in range(20)]   # 1..20, shuffled over indices
    plan = planner().plan(density, [100] * 20)
    assert TIERS == ("core", "dynamic", "stable")
    assert sorted(members(plan, "core")) == sorted(density.index(v) for v in (20.0, 19.0, 18.0))
    assert sorted(members(plan, "stable")) == sorted(density.index(v) for v in (1.0, 2.0, 3.0, 4.0))
    assert len(members(plan, "dynamic")) == 13
    assert plan.shares == {"core": 0.15, "dynamic": 0.65, "stable": 0.20}
    assert plan.moved == [] and plan.reason == "initial plan"


def test_unequal_sizes_take_a_bucket_only_if_it_brings_the_count_closer():
    # core quota 150: 100 (|50| < |150|) and 80 (|30| < |50|) taken, 50 (|80| > |30|) stops it;
    # stable quota 200: 200 taken (exact), the next 200 would overshoot by as much -> stops.
    plan = planner().plan([6, 5, 4, 3, 2, 1], [100, 80, 50, 370, 200, 200])
    assert plan.tiers == ["core", "core", "dynamic", "dynamic", "dynamic", "stable"]
    assert plan.shares == {"core": 0.18, "dynamic": 0.62, "stable": 0.2}


def test_half_way_bucket_is_not_taken_and_oversized_bucket_leaves_tier_empty():
    # 0.15 * 1000 = 150: after 100, another 100 lands 50 over = as far as 50 under -> not taken.
    plan = planner().plan([10 - b for b in range(10)], [100] * 10)
    assert members(plan, "core") == [0]
    assert members(plan, "stable") == [8, 9]
    # The densest bucket (400) is more than twice the core quota: core stays empty.
    plan = planner(max_dynamic=1.0).plan([5, 4, 3, 2, 1], [400, 100, 100, 100, 300])
    assert plan.tiers == ["dynamic", "dynamic", "dynamic", "dynamic", "stable"]


def test_ties_are_broken_by_bucket_index_and_plans_are_reproducible():
    plan = planner().plan([1.0] * 20, [100] * 20)
    assert members(plan, "core") == [0, 1, 2]
    assert members(plan, "stable") == [16, 17, 18, 19]
    # A tie across the core boundary: among the three 3.0s the lowest indices win.
    density = [1.0, 3.0, 5.0, 3.0, 3.0, 1.0] + [2.0] * 14
    first = planner().plan(density, [100] * 20)
    assert members(first, "core") == [1, 2, 3]
    second = TierPlanner(0.15, 0.65, 0.20, 0.1, 0.70).plan(list(density), [100] * 20)
    assert second == first


# ---------------------------------------------------------------------- dynamic guard
def test_guard_moves_densest_dynamic_buckets_to_core():
    # core gets 150; stable's only candidate (650) is > 2 * 200 so stable is empty;
    # dynamic would hold 850 > 650: the two densest dynamic buckets go to core.
    p = planner(max_dynamic=0.65)
    plan = p.plan([4, 3, 2, 1], [150, 100, 100, 650])
    assert plan.tiers == ["core", "core", "core", "dynamic"]
    assert plan.shares == {"core": 0.35, "dynamic": 0.65, "stable": 0.0}
    assert "dynamic guard (0.65) moved 2 bucket(s) to core: [1, 2]" in plan.reason
    # Within the guard nothing moves.
    plan = planner(max_dynamic=0.85).plan([4, 3, 2, 1], [150, 100, 100, 650])
    assert plan.tiers == ["core", "dynamic", "dynamic", "dynamic"]
    assert "guard" not in plan.reason


# ---------------------------------------------------------------------- hysteresis
def replan_n(p, density, numels, times=10):
    plan = p.plan(density, numels)
    for _ in range(times):
        again = p.plan(density, numels, current=plan.tiers)
        assert again.moved == []
        assert again.tiers == plan.tiers
        plan = again
    return plan


@pytest.mark.parametrize("hysteresis", [0.0, 0.1])
def test_constant_scores_never_move_a_bucket(hysteresis):
    rng = random.Random(7)
    density = [float(rng.choice([0.0, 0.5, 1.0, 2.0, 3.0])) for _ in range(40)]  # many ties
    replan_n(planner(hysteresis=hysteresis), density, [100] * 40)
    numels = [rng.randint(1, 300) for _ in range(40)]
    replan_n(planner(hysteresis=hysteresis), density, numels)
    replan_n(planner(hysteresis=hysteresis, max_dynamic=0.65), [4, 3, 2, 1], [150, 100, 100, 650])


def five_bucket_plan():
    p = planner(core=0.2, dynamic=0.6, stable=0.2, hysteresis=0.1)
    first = p.plan([10.0, 9.0, 5.0, 4.0, 1.0], [100] * 5)
    assert first.tiers == ["core", "dynamic", "dynamic", "dynamic", "stable"]
    return p, first


def test_perturbation_within_hysteresis_moves_nothing():
    p, first = five_bucket_plan()
    # Bucket 1 now beats the core incumbent, but 10.0 < 9.5 * 1.1; bucket 4 rose above
    # bucket 3's old value neighbourhood but 1.05 / 1.1 < 4.0.
    plan = p.plan([9.5, 10.0, 5.0, 4.0, 1.05], [100] * 5, current=first.tiers)
    assert plan.moved == []
    assert plan.tiers == first.tiers
    assert plan.reason == "re-tier"
    # Without hysteresis the same scores do swap core.
    plain = planner(core=0.2, dynamic=0.6, stable=0.2, hysteresis=0.0)
    assert plain.plan([9.5, 10.0, 5.0, 4.0, 1.05], [100] * 5, current=first.tiers).moved == [
        (0, "core", "dynamic"), (1, "dynamic", "core")]


def test_large_perturbation_swaps_and_the_result_is_stable():
    p, first = five_bucket_plan()
    density = [5.0, 10.0, 6.0, 4.0, 1.0]
    plan = p.plan(density, [100] * 5, current=first.tiers)
    assert plan.moved == [(0, "core", "dynamic"), (1, "dynamic", "core")]
    assert plan.tiers == ["dynamic", "core", "dynamic", "dynamic", "stable"]
    assert p.plan(density, [100] * 5, current=plan.tiers).moved == []

    density = [10.0, 9.0, 5.0, 1.0, 4.5]   # bucket 4 now denser than bucket 3 by > 1.1x
    plan = p.plan(density, [100] * 5, current=first.tiers)
    assert plan.moved == [(3, "dynamic", "stable"), (4, "stable", "dynamic")]
    assert describe_moves(plan, [f"layer {b}" for b in range(5)]) == [
        "layer 3: dynamic -> stable", "layer 4: stable -> dynamic"]


def test_stable_bucket_can_jump_straight_to_core():
    p, first = five_bucket_plan()
    plan = p.plan([1.0, 9.0, 5.0, 4.0, 20.0], [100] * 5, current=first.tiers)
    assert plan.moved == [(0, "core", "stable"), (4, "stable", "core")]


def test_unequal_sizes_re_plan_settles_to_a_fixed_point():
    # Quota 30 of 100: one 20-bucket (20 + 20/2 < 30) or one 40-bucket (0 + 20 < 30) fits.
    p = TierPlanner(0.3, 0.5, 0.2, 0.1, 0.7)
    sizes = [40, 40, 20]
    first = p.plan([4.0, 1.0, 9.0], sizes)
    assert first.tiers == ["core", "dynamic", "core"]        # bucket 0 by the guard (80 > 70)
    # One pass would give core {1, 2} (2 filled, 1 by the guard); with 1 then incumbent, the
    # 40-bucket ranks first and fills the quota alone. The planner returns that settled state.
    plan = p.plan([1.0, 4.0, 4.0], sizes, current=first.tiers)
    assert plan.tiers == ["dynamic", "core", "dynamic"]
    assert "guard" not in plan.reason
    assert p.plan([1.0, 4.0, 4.0], sizes, current=plan.tiers).moved == []


# ---------------------------------------------------------------------- promote
def test_promote_moves_dynamic_buckets_to_core():
    p, first = five_bucket_plan()
    plan = p.promote(first.tiers, [2, 0, 3, 2], reason="GVR 1.6 out of range")
    assert plan.tiers == ["core", "dynamic", "core", "core", "stable"]
    assert plan.moved == [(2, "dynamic", "core"), (3, "dynamic", "core")]
    assert plan.shares == {"core": 0.6, "dynamic": 0.2, "stable": 0.2}
    assert plan.reason == "GVR 1.6 out of range"
    assert isinstance(plan, TierPlan)
    other = p.promote(first.tiers, [1], reason="x", numels=[100, 300, 100, 100, 400])
    assert other.shares == {"core": 0.4, "dynamic": 0.2, "stable": 0.4}


def test_promote_errors_name_the_argument():
    p, first = five_bucket_plan()
    with pytest.raises(ValueError, match="bucket_ids entry 4 is a stable bucket"):
        p.promote(first.tiers, [4], reason="x")
    with pytest.raises(ValueError, match="bucket_ids entry 5 is out of range"):
        p.promote(first.tiers, [5], reason="x")
    with pytest.raises(ValueError, match="numels"):
        planner().promote(["dynamic"], [0], reason="x")


@pytest.mark.parametrize("args, match", [
    ((0.2, 0.65, 0.20, 0.1, 0.70), "must be 1"),
    ((-0.1, 0.9, 0.2, 0.1, 0.95), "core_share"),
    ((0.15, 0.65, 0.20, 1.0, 0.70), "hysteresis"),
    ((0.10, 0.75, 0.15, 0.1, 0.70), "max_dynamic_share"),
])
def test_planner_errors_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        TierPlanner(*args)


def test_plan_errors_name_the_argument():
    p = planner()
    with pytest.raises(ValueError, match=r"density\[1\]"):
        p.plan([1.0, float("nan")], [1, 1])
    with pytest.raises(ValueError, match="numels"):
        p.plan([1.0, 2.0], [1])
    with pytest.raises(ValueError, match=r"current\[0\]"):
        p.plan([1.0], [1], current=["fast"])


def test_from_config_and_tensor_inputs():
    p = TierPlanner.from_config(GRPOConfig())
    assert (p.core_share, p.dynamic_share, p.stable_share, p.hysteresis, p.max_dynamic_share) == (
        0.15, 0.85, 0.0, 0.1, 0.85)
    p = TierPlanner.from_config(GRPOConfig(dynamic_share=0.65, stable_share=0.2, max_dynamic_share=0.7))
    density = torch.arange(20, 0, -1, dtype=torch.float64)
    plan = p.plan(density, torch.full((20,), 100))
    assert members(plan, "core") == [0, 1, 2]
    m = GVRMonitor.from_config(GRPOConfig())
    assert (m.gvr_min, m.gvr_max, m.window, m.promote_share) == (0.7, 1.2, 3, 0.25)


# ---------------------------------------------------------------------- GVR monitor
def test_monitor_triggers_exactly_on_the_kth_consecutive_out_of_range_check():
    m = GVRMonitor(0.7, 1.2, window=3, promote_share=0.25)
    assert [m.update(g) for g in (1.5, 0.5, 1.3)] == [False, False, True]
    assert m.consecutive == 0                                   # reset after triggering
    assert [m.update(g) for g in (2.0, 2.0, 2.0)] == [False, False, True]


def test_monitor_does_not_trigger_when_interrupted():
    m = GVRMonitor(0.7, 1.2, window=3, promote_share=0.25)
    results = [m.update(g) for g in (1.5, 1.5, 1.0, 1.5, 1.5, 0.7, 0.3, 1.2, 9.0)]
    assert results == [False] * 9                               # 0.7 and 1.2 are in range
    assert m.consecutive == 1
    assert [m.update(g) for g in (float("nan"), float("inf"))] == [False, True]


def test_select_worst_picks_ceil_share_by_error():
    m = GVRMonitor(0.7, 1.2, window=3, promote_share=0.25)
    ids, errors = [2, 5, 7, 9, 11], [0.1, 0.5, 0.3, 0.5, 0.05]
    assert m.select_worst(ids, errors) == [5, 9]                # ceil(1.25) = 2, tie by id
    assert m.select_worst([], []) == []
    assert m.select_worst([4], [0.0]) == [4]                    # ceil(0.25) = 1
    assert m.select_worst([1, 2, 3], [0.1, float("nan"), 0.2]) == [2]
    tight = GVRMonitor(0.7, 1.2, window=3, promote_share=0.7)
    assert len(tight.select_worst(list(range(10)), [float(i) for i in range(10)])) == 7
    with pytest.raises(ValueError, match="per_bucket_error"):
        m.select_worst([1, 2], [0.1])


@pytest.mark.parametrize("args, match", [
    ((1.2, 0.7, 3, 0.25), "gvr_min"), ((0.7, 1.2, 0, 0.25), "window"),
    ((0.7, 1.2, 3, 0.0), "promote_share")])
def test_monitor_errors_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        GVRMonitor(*args)


def test_gradient_variance_ratio_exact():
    exact = torch.tensor([1.0, 2.0, 3.0, 4.0])                  # population variance 1.25
    assert gradient_variance_ratio(exact * 2, exact) == 4.0
    assert gradient_variance_ratio(exact + 10, exact) == 1.0    # a shift is not spread
    assert gradient_variance_ratio(torch.tensor([1.0, 1.0, 4.0, 4.0]), exact) == 1.8
    assert gradient_variance_ratio(torch.zeros(2, 2), exact.view(2, 2)) == 0.0
    assert gradient_variance_ratio(torch.ones(3), torch.ones(3)) == 1.0
    assert gradient_variance_ratio(torch.tensor([0.0, 1.0]), torch.ones(2)) == math.inf
    with pytest.raises(ValueError, match="applied"):
        gradient_variance_ratio(torch.ones(3), torch.ones(4))


def test_relative_error_exact():
    exact = torch.tensor([3.0, 4.0])
    assert relative_error(torch.tensor([3.0, 1.0]), exact) == 0.6
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0


def test_no_stable_buckets_skip_the_stable_fill():
    planner = TierPlanner(0.2, 0.6, 0.2, 0.1, 0.8)
    density = [5.0, 4.0, 3.0, 2.0, 1.0]
    free = planner.plan(density, [10] * 5)
    assert free.tiers == ["core", "dynamic", "dynamic", "dynamic", "stable"]
    # Bucket 4 (least dense) holds an embedding table: the next least dense one goes stable.
    kept = planner.plan(density, [10] * 5, no_stable=[False, False, False, False, True])
    assert kept.tiers == ["core", "dynamic", "dynamic", "stable", "dynamic"]
    with pytest.raises(ValueError, match="no_stable"):
        planner.plan(density, [10] * 5, no_stable=[True])


def test_monitor_check_counts_unhealthy_checks_in_a_row():
    m = GVRMonitor(0.7, 1.2, window=2, promote_share=0.25)
    assert [m.check(h) for h in (False, True, False, False, False, False)] == \
        [False, False, False, True, False, True]


def test_tier_policies_rank_as_their_definitions_say():
    from megatron_grpo.grpo.tiers import policy_density

    density = [5.0, 1.0, 3.0, 0.0, 4.0, 2.0, 6.0, 0.5, 7.0, 8.0]
    sizes = [10] * 10
    planner = TierPlanner(0.2, 0.6, 0.2, hysteresis=0.1, max_dynamic_share=0.7)
    imp = planner.plan(policy_density("importance", density, 5), sizes).tiers
    inv = planner.plan(policy_density("inverse", density, 5), sizes).tiers
    # importance: the two densest (8, 7) are core, the two least dense (0, 0.5) stable;
    # inverse: exactly the other way round.
    assert [i for i, t in enumerate(imp) if t == "core"] == [8, 9]
    assert [i for i, t in enumerate(imp) if t == "stable"] == [3, 7]
    assert [i for i, t in enumerate(inv) if t == "core"] == [3, 7]
    assert [i for i, t in enumerate(inv) if t == "stable"] == [8, 9]
    # random: the same draw for the same iteration (every rank agrees without talking), a new
    # one at another re-tier, and the same shares as the other policies.
    r1, r1_again, r2 = (policy_density("random", density, k) for k in (100, 100, 600))
    assert r1 == r1_again and r1 != r2
    tiers = planner.plan(r1, sizes).tiers
    assert sorted(tiers) == sorted(imp)
    with pytest.raises(ValueError, match="tier policy must be"):
        policy_density("best", density, 1)
