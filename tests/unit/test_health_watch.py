"""HealthWatch: per-tier verdicts of the monitoring steps, and their checkpoint state."""

import math

import torch

from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.grpo.health import FIELDS, HealthWatch
from megatron_grpo.grpo.tiers import GVRMonitor


def _watch(window=2):
    cfg = GRPOConfig(enabled=True, gvr_window=window)
    return HealthWatch(lambda: GVRMonitor.from_config(cfg), cfg.max_compression_error)


def _sums(rows):
    """Per-unit sums for (applied, owed) vectors."""
    out = torch.zeros(len(rows), FIELDS, dtype=torch.float64)
    for i, (a, c) in enumerate(rows):
        a, c = torch.tensor(a, dtype=torch.float64), torch.tensor(c, dtype=torch.float64)
        out[i] = torch.stack([a.sum(), (a * a).sum(), c.sum(), (c * c).sum(), (a * c).sum(),
                              torch.tensor(float(a.numel()), dtype=torch.float64)])
    return out


GOOD = ([1.0, 2.0], [1.0, 2.1])
FLIPPED = ([-1.0, -2.0], [1.0, 2.0])  # relative error 2, cosine -1


def test_each_tier_is_judged_by_its_own_monitor():
    w = _watch(window=2)
    units = {"dynamic": [0], "core": [1]}
    sums = _sums([GOOD, FLIPPED])
    assert w.judge(sums, units) == {}  # the first bad core check of two
    assert w.measured == {"dynamic", "core"}
    assert math.isclose(w.last["core"]["rel_error"], 2.0) and math.isclose(w.last["core"]["cosine"], -1.0)
    bad = w.judge(sums, units)
    assert list(bad) == ["core"] and math.isclose(bad["core"]["rel_error"], 2.0)
    # After a trigger the count starts again; the dynamic monitor never moved.
    assert w.monitors["dynamic"].consecutive == 0 and w.monitors["core"].consecutive == 0
    w.new_step()
    assert w.measured == set()
    assert w.judge(_sums([FLIPPED, GOOD]), {"dynamic": [0]}) == {}
    assert w.measured == {"dynamic"} and w.monitors["dynamic"].consecutive == 1


def test_nan_is_bad_and_an_unmeasured_tier_is_not_judged():
    w = _watch(window=1)
    nan = _sums([([math.nan], [1.0]), GOOD])
    assert list(w.judge(nan, {"dynamic": [0], "core": [1]})) == ["dynamic"]
    w.new_step()
    assert w.judge(torch.zeros(2, FIELDS, dtype=torch.float64), {"core": [0, 1]}) == {}
    assert w.measured == set()  # nothing was sent through core this step: no figures


def test_state_round_trip_and_checkpoints_from_before_the_core_monitor():
    w = _watch(window=3)
    w.judge(_sums([FLIPPED, FLIPPED]), {"dynamic": [0], "core": [1]})
    state = w.state_dict()
    again = _watch(window=3)
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert again.monitors["core"].consecutive == 1 and again.last["core"]["rel_error"] == 2.0
    old = {"monitor": state["monitor"], "last_health": state["last_health"]}  # pre-core keys
    older = _watch(window=3)
    older.load_state_dict(old)
    assert older.monitors["dynamic"].consecutive == 1 and older.monitors["core"].consecutive == 0
    assert set(older.last) == {"dynamic"}
