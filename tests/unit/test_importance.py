"""ImportanceTracker: sum(|g||w|) per parameter, EMA, per-bucket scores, agreement hooks."""

import pytest
import torch

from megatron_grpo.grpo.importance import ImportanceTracker


def t(values):
    return torch.tensor(values, dtype=torch.float32)


def test_sum_abs_grad_times_abs_weight_per_parameter():
    tracker = ImportanceTracker(1, [2], decay=0.9)
    grads = [t([[1.0, -2.0], [3.0, 0.5]]), t([-1.0, -1.0, 1.0])]
    weights = [t([[-1.0, 2.0], [0.5, 4.0]]), t([2.0, -3.0, 0.25])]
    tracker.observe(0, grads, weights)
    tracker.commit()
    # 1*1 + 2*2 + 3*0.5 + 0.5*4 = 8.5 ;  1*2 + 1*3 + 1*0.25 = 5.25
    assert tracker.scores_tensor().tolist() == [8.5, 5.25]
    assert tracker.observations == 1


def test_bf16_weights_with_fp32_grads_and_mismatched_shapes():
    tracker = ImportanceTracker(1, [1], decay=0.5)
    grad = t([1.0, -2.0, 4.0, 0.5])                       # flat main_grad view
    weight = t([[2.0, 1.0], [-0.5, 8.0]]).to(torch.bfloat16)
    tracker.observe(0, [grad], [weight])
    tracker.commit()
    assert tracker.scores_tensor().tolist() == [2.0 + 2.0 + 2.0 + 4.0]


def scalar_bucket(value):
    """One parameter whose sum(|g||w|) is exactly ``value``."""
    return [t([value])], [t([1.0])]


def test_ema_first_observation_initialises_then_decays():
    tracker = ImportanceTracker(1, [1], decay=0.75)
    for value, expected in ((8.0, 8.0), (4.0, 7.0), (0.0, 5.25), (5.25, 5.25)):
        tracker.observe(0, *scalar_bucket(value))
        tracker.commit()
        assert tracker.scores_tensor().tolist() == [expected]
    assert tracker.observations == 4
    assert tracker.bucket_observations == [4]


def test_unobserved_bucket_keeps_score_and_is_initialised_on_its_first_observation():
    tracker = ImportanceTracker(2, [1, 1], decay=0.5)
    tracker.observe(0, *scalar_bucket(2.0))
    tracker.observe(1, *scalar_bucket(6.0))
    tracker.commit()
    tracker.observe(0, *scalar_bucket(4.0))
    tracker.commit()
    assert tracker.scores_tensor().tolist() == [3.0, 6.0]
    assert tracker.bucket_observations == [2, 1]

    late = ImportanceTracker(2, [1, 1], decay=0.5)
    late.observe(0, *scalar_bucket(2.0))
    late.commit()
    late.observe(1, *scalar_bucket(6.0))   # first observation of bucket 1: no decay toward 0
    late.commit()
    assert late.scores_tensor().tolist() == [2.0, 6.0]


def test_commit_without_observation_changes_nothing():
    tracker = ImportanceTracker(1, [1], decay=0.5)
    tracker.commit()
    assert tracker.observations == 0
    assert tracker.scores_tensor().tolist() == [0.0]


def test_observing_twice_before_commit_keeps_the_later_measurement():
    tracker = ImportanceTracker(1, [1], decay=0.5)
    tracker.observe(0, *scalar_bucket(10.0))
    tracker.observe(0, *scalar_bucket(2.0))
    tracker.commit()
    assert tracker.scores_tensor().tolist() == [2.0]


def test_non_finite_measurement_leaves_score_and_does_not_start_the_ema():
    tracker = ImportanceTracker(1, [2], decay=0.5)
    tracker.observe(0, [t([float("nan")]), t([float("inf")])], [t([1.0]), t([1.0])])
    tracker.commit()
    assert tracker.scores_tensor().tolist() == [0.0, 0.0]
    tracker.observe(0, [t([4.0]), t([2.0])], [t([1.0]), t([1.0])])
    tracker.commit()
    assert tracker.scores_tensor().tolist() == [4.0, 2.0]   # initialised directly, not 2.0/1.0
    tracker.observe(0, [t([float("inf")]), t([6.0])], [t([1.0]), t([1.0])])
    tracker.commit()
    assert tracker.scores_tensor().tolist() == [4.0, 4.0]


def test_discard_drops_pending_measurements():
    tracker = ImportanceTracker(1, [1], decay=0.5)
    tracker.observe(0, *scalar_bucket(2.0))
    tracker.commit()
    tracker.observe(0, *scalar_bucket(100.0))
    tracker.discard()
    tracker.commit()
    assert tracker.scores_tensor().tolist() == [2.0]
    assert tracker.observations == 1


def filled_tracker():
    """Buckets holding 2, 1, 0 and 3 parameters with known scores."""
    tracker = ImportanceTracker(4, [2, 1, 0, 3], decay=0.9)
    tracker.set_scores(t([1.0, 2.0, 5.0, 0.5, 0.25, 0.25]))
    return tracker


def test_bucket_scores_and_density_exact():
    tracker = filled_tracker()
    assert tracker.offsets == [0, 2, 3, 3, 6]
    assert tracker.bucket_scores().tolist() == [3.0, 5.0, 0.0, 1.0]
    assert tracker.bucket_density([6, 10, 0, 4]).tolist() == [0.5, 0.5, 0.0, 0.25]


def test_set_scores_round_trip_and_in_place_all_reduce():
    tracker = filled_tracker()
    other = t([3.0, 0.0, 1.0, 0.5, 0.75, 0.25])
    averaged = (tracker.scores_tensor().clone() + other) / 2
    tracker.set_scores(averaged)
    assert tracker.scores_tensor().tolist() == [2.0, 1.0, 3.0, 0.5, 0.5, 0.25]
    assert tracker.scores_tensor() is not averaged          # copied, not aliased
    tracker.scores_tensor().mul_(2)                          # what an in-place all_reduce does
    assert tracker.bucket_scores().tolist() == [6.0, 6.0, 0.0, 2.5]
    tracker.set_scores(tracker.scores_tensor())              # same tensor back: a no-op
    assert tracker.bucket_scores().tolist() == [6.0, 6.0, 0.0, 2.5]


def test_state_dict_round_trip():
    tracker = ImportanceTracker(2, [1, 1], decay=0.5)
    tracker.observe(0, *scalar_bucket(2.0))
    tracker.commit()
    state = tracker.state_dict()
    restored = ImportanceTracker(2, [1, 1], decay=0.5)
    restored.load_state_dict(state)
    assert restored.scores_tensor().tolist() == [2.0, 0.0]
    assert restored.observations == 1 and restored.bucket_observations == [1, 0]
    restored.observe(0, *scalar_bucket(4.0))
    restored.observe(1, *scalar_bucket(8.0))
    restored.commit()
    assert restored.scores_tensor().tolist() == [3.0, 8.0]    # bucket 1 starts its EMA fresh
    with pytest.raises(ValueError, match="param_counts"):
        ImportanceTracker(2, [2, 1], decay=0.5).load_state_dict(state)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_buckets=2, param_counts=[1], decay=0.5), "param_counts"),
    (dict(num_buckets=1, param_counts=[-1], decay=0.5), "param_counts"),
    (dict(num_buckets=1, param_counts=[1], decay=1.0), "decay"),
    (dict(num_buckets=-1, param_counts=[], decay=0.5), "num_buckets"),
])
def test_constructor_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImportanceTracker(**kwargs)


def test_observe_and_set_scores_errors_name_the_argument():
    tracker = ImportanceTracker(2, [1, 2], decay=0.5)
    with pytest.raises(ValueError, match="bucket"):
        tracker.observe(2, *scalar_bucket(1.0))
    with pytest.raises(ValueError, match="grads"):
        tracker.observe(1, *scalar_bucket(1.0))
    with pytest.raises(ValueError, match="weights"):
        tracker.observe(0, [t([1.0])], [])
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        tracker.observe(0, [t([1.0, 2.0])], [t([1.0])])
    with pytest.raises(ValueError, match="tensor"):
        tracker.set_scores(t([1.0, 2.0]))
    with pytest.raises(ValueError, match="bucket_numels"):
        tracker.bucket_density([1])


@pytest.mark.parametrize("score, expected", [("grad-weight", 1 * 2 + 3 * 0.5), ("grad", 1 + 3),
                                             ("fisher", 1 + 9)])
def test_importance_score_variants(score, expected):
    tracker = ImportanceTracker(1, [1], decay=0.5, score=score)
    tracker.observe(0, [torch.tensor([1.0, -3.0])], [torch.tensor([2.0, -0.5])])
    tracker.commit()
    assert tracker.bucket_scores().tolist() == [expected]


def test_unknown_importance_score_is_refused():
    with pytest.raises(ValueError, match="score must be one of grad-weight, grad, fisher"):
        ImportanceTracker(1, [1], decay=0.5, score="hessian")
