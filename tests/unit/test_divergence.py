"""The divergence guard's decisions (megatron_grpo.training.safety.divergence) on one gloo rank; the
2-rank runs that stop are tests/reliability/test_nonfinite.py."""

import math

import pytest
import torch

from megatron_grpo.training.arguments import ConfigError, parse_args
from megatron_grpo.training.safety.divergence import DivergenceGuard, nonfinite_weights_problem
from megatron_grpo.training.step import StepResult


def _guard(*flags, save=None):
    cfg = parse_args(["--data-path", "x", "--train-iters", "40", *flags])
    cfg.checkpoint.save = save
    return DivergenceGuard(cfg)


def _step(loss=2.0, grad=1.0, applied=True, own_finite=True):
    return StepResult(loss, grad if applied else None, applied, 0.0, own_finite)


def _decide(guard, iteration, result):
    return guard.problem(iteration, result, guard.local_flags(result), torch.device("cpu"))


def test_defaults_follow_megatron_and_are_documented():
    cfg = parse_args(["--data-path", "x"])
    assert cfg.training.check_for_nan_in_loss_and_grad is True
    assert cfg.training.max_consecutive_skipped_steps == 10
    with pytest.raises(ConfigError,
                       match=r"--max-consecutive-skipped-steps must be >= 0 \(0: never stop\), got -1"):
        parse_args(["--data-path", "x", "--max-consecutive-skipped-steps", "-1"])


def test_skipped_steps_stop_only_when_consecutive(gloo_group):
    guard = _guard("--max-consecutive-skipped-steps", "3")
    pattern = [True, False, False, True, False, True, True, True]  # skips at 2, 3 and 5: go on
    assert [_decide(guard, i + 1, _step(applied=a)) for i, a in enumerate(pattern)] == [None] * 8
    assert _decide(guard, 9, _step(applied=False)) is None
    assert _decide(guard, 10, _step(applied=False)) is None
    text = _decide(guard, 11, _step(applied=False))
    assert text.startswith("iteration 11 of 40: 3 consecutive steps skipped (iterations 9-11: a non-finite "
                           "gradient on some rank; the skip is agreed over all 1 ranks), so the weights have "
                           "not moved since iteration 8; the run stops (--max-consecutive-skipped-steps 3; "
                           "0 never stops). There is no checkpoint to resume from (no --save). Rerun with"), text
    never = _guard("--max-consecutive-skipped-steps", "0")
    assert all(_decide(never, i, _step(applied=False)) is None for i in range(1, 50))


def test_a_non_finite_loss_or_applied_gradient_stops_at_once(gloo_group, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    guard = _guard(save=str(tmp_path))
    text = _decide(guard, 7, _step(loss=math.nan, own_finite=False))
    assert text.startswith(f"iteration 7 of 40: the loss is nan on 1 of 1 rank(s) (first: rank 0); the run "
                           f"has diverged and stops (--check-for-nan-in-loss-and-grad, on by default as in "
                           f"Megatron-LM). No checkpoint is written for it: the latest complete checkpoint, "
                           f"iteration 5 in {tmp_path}, is kept. Resume from a checkpoint before the "
                           f"divergence with a lower --lr (now 0.001)"), text
    text = _decide(guard, 8, _step(grad=math.inf))
    assert text.startswith("iteration 8 of 40: the gradient norm is inf and the update was applied"), text
    # A skipped step's norm is not applied: that is the consecutive count's business.
    assert _decide(guard, 9, StepResult(2.0, math.nan, False, 0.0)) is None
    off = _guard("--no-check-for-nan-in-loss-and-grad")
    assert off.local_flags(_step(loss=math.nan, own_finite=False, grad=math.nan)) == [0, 0, 0]
    assert _decide(off, 7, _step(loss=math.nan, own_finite=False, grad=math.nan)) is None


class _Built:
    def __init__(self, *params):
        self.ddp_model = [torch.nn.ParameterList([torch.nn.Parameter(p) for p in params])]


def test_non_finite_weights_are_refused_by_count_and_rank(gloo_group, tmp_path):
    root = str(tmp_path)
    assert nonfinite_weights_problem(root, 10, _Built(torch.ones(3), torch.full((2,), 1e38))) is None
    text = nonfinite_weights_problem(root, 10, _Built(torch.tensor([1.0, math.nan, math.inf]), torch.ones(2)))
    assert text == (f"--save {root}: refusing to save iteration 10: the weights are non-finite (2 NaN/Inf "
                    f"values on rank(s) 0; this is rank 0), and a checkpoint of them could only resume a "
                    f"diverged run. Nothing was written; {root} holds no complete checkpoint.")
