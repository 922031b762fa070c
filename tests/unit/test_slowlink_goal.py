"""The slow-link benchmark judges each link against its own goal: a limited link against
--goal (0.45), the unlimited one against --goal-unlimited (1.03: GRPO must not cost time).
It once judged the unlimited link against 0.45 and printed MISSED for a 0.92x step."""

from types import SimpleNamespace

from megatron_grpo.bench.slowlink_run import goal_for, print_row


def _row(rate, ratio):
    return {"rate": rate, "ratios": {"grpo": ratio}, "ratio_mean": ratio, "ratio_median": ratio}


def test_each_link_is_judged_against_its_own_goal(capsys):
    args = SimpleNamespace(goal=0.45, goal_unlimited=1.03)
    assert goal_for("none", args) == 1.03 and goal_for("200mbit", args) == 0.45
    print_row(_row("none", 0.924), goal_for("none", args))
    assert "(goal <= 1.03: met)" in capsys.readouterr().out
    print_row(_row("none", 1.05), goal_for("none", args))
    assert "(goal <= 1.03: MISSED)" in capsys.readouterr().out
    print_row(_row("200mbit", 0.634), goal_for("200mbit", args))
    assert "(goal <= 0.45: MISSED)" in capsys.readouterr().out
