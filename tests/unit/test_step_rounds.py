"""main_job.py --step-rounds: the step-time ratio of runs made in turn, pair by pair, over the
iterations after GRPO's exact warm-up (bench/figures.py paired_step_ratios)."""

import pytest

from megatron_grpo.bench.figures import paired_step_ratios


def _run(times, tiered_from=None):
    return [{"iteration": i, "step_time_s": t, **({"grpo_tiered": i >= tiered_from} if tiered_from else {})}
            for i, t in enumerate(times, 1)]


def test_each_pair_is_compared_after_the_warm_up_and_the_median_pair_is_quoted():
    # Warm-up steps (1-3) are slow in the GRPO run and are left out of both runs; the machine
    # is twice as slow in the second pair, which a ratio of medians over all runs would mix in.
    pairs = [(_run([9, 9, 9, 1.0, 1.0, 1.0]), _run([20, 20, 20, 1.02, 1.02, 1.02], tiered_from=4)),
             (_run([9, 9, 9, 2.0, 2.0, 2.0]), _run([20, 20, 20, 1.9, 1.9, 1.9], tiered_from=4)),
             (_run([9, 9, 9, 1.0, 1.0, 1.0]), _run([20, 20, 20, 1.2, 1.2, 1.2], tiered_from=4))]
    out = paired_step_ratios(pairs)
    assert [round(r["ratio"], 3) for r in out["pairs"]] == [1.02, 0.95, 1.2]
    assert out["median_ratio"] == pytest.approx(1.02)
    assert out["spread"] == pytest.approx((0.95, 1.2))


def test_a_run_shorter_than_the_warm_up_is_refused():
    with pytest.raises(ValueError, match="no steps after iteration 3: run more iterations"):
        paired_step_ratios([(_run([1, 1, 1]), _run([1, 1, 1, 1], tiered_from=4))])
