"""The compute bench's figures from records (megatron_grpo.bench.compute): wall-clock to a
validation loss, robust to a few slowed steps, and "never" for a run that does not reach it."""

import pytest

from megatron_grpo.bench import compute as C


def _records(n, step, vals, spike_at=None):
    out = []
    for i in range(1, n + 1):
        r = {"iteration": i, "step_time_s": 10.0 if i == spike_at else step}
        if i in vals:
            r["val_loss"] = vals[i]
        out.append(r)
    return out


def test_time_to_interpolates_between_evaluations_and_says_never():
    curve = C.wallclock_curve(_records(100, 0.5, {50: 3.0, 100: 2.0}))
    assert curve == [[25.0, 3.0], [50.0, 2.0]]
    assert C.time_to(curve, 2.5) == pytest.approx(37.5)
    assert C.time_to(curve, 3.5) == 25.0  # the first evaluation is already below
    assert C.time_to(curve, 1.9) is None  # never reached


def test_a_slowed_step_does_not_decide_the_race_but_a_slower_phase_does():
    calm = C.wallclock_curve(_records(100, 0.5, {100: 2.0}))
    spiked = C.wallclock_curve(_records(100, 0.5, {100: 2.0}, spike_at=30))
    assert spiked == calm
    slower = _records(100, 0.5, {100: 2.0})
    for r in slower[50:]:
        r["step_time_s"] = 0.7  # e.g. GRPO's tiered steps after an exact warm-up
    assert C.wallclock_curve(slower)[-1][0] == pytest.approx(50 * 0.5 + 50 * 0.7)


def test_the_planners_flops_for_a_runs_tier_map_and_keep_ratio():
    def run(dgrad):  # the run's counted data-gradient FLOPs below core
        return [{"iteration": i, "sample_keep_dynamic": 0.5, "flops_core_fwd": 1.0,
                 "flops_dynamic_fwd": 3.0, "flops_dynamic_dgrad": dgrad} for i in range(1, 11)]
    from megatron_grpo.planner.compute import predict
    from megatron_grpo.planner.plan import ModelSpec

    model = ModelSpec(num_layers=2, hidden=512, heads=8, vocab=258, seq_length=256, micro_batch_size=2)
    both, weights = C.predicted_flops(run(1.5), 2), C.predicted_flops(run(3.0), 2)
    assert both == predict(model, 512, below_core_share=0.75, keep=0.5, sample_dgrad=True)["ratio"]
    # Weight gradients only: the data gradients stay exact, so the prediction is higher.
    assert weights == predict(model, 512, below_core_share=0.75, keep=0.5, sample_dgrad=False)["ratio"]
    assert 0.5 < both < weights < 1.0
    assert C.predicted_flops(run(3.0), 20) is None  # no steady record
