"""The delayed stable tier and the gradients megatron's finalize_model_grads rewrites in place
after the data-parallel sync (sequence-parallel and qk layernorms all-reduced over TP, the tied
embedding over PP stages). A held unit's gradient is read at the end of the step, after that
all-reduce; its update then syncs the sum, which finalize all-reduces again. Before the fix
those elements counted once per model-parallel copy (x TP).

Two TP ranks in lockstep, each with the real GRPOBucketGroup hold / merge paths and real
DelayedAccumulators; finalize is the in-place sum over the two ranks it is in megatron."""

from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.comm.accumulators import DelayedAccumulators
from megatron_grpo.megatron.bucket_group import GRPOBucketGroup

SIZES = (6, 4, 6)     # a TP-split weight, a sequence-parallel layernorm weight, another weight
LATE = 1              # index of the layernorm in SIZES
FACTOR = 0.5          # megatron's gradient_scaling_factor (1/dp)
INTERVAL = 3          # held, held, update


class _Ctrl:
    """The controller's side of a hold and a merge: real accumulators, no streams."""

    def __init__(self):
        self.accum = DelayedAccumulators()
        self.config = SimpleNamespace(stable_delayed=True)

    def hold(self, key, grad, *local):
        self.accum.hold(key, grad, *local)

    def use_accumulator(self, key):
        return self.accum.take(key)


def _rank():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    grad = torch.zeros(sum(SIZES))
    start = 0
    for p in params:
        p.main_grad = grad[start:start + p.numel()]
        start += p.numel()
    bucket = SimpleNamespace(grad_data=grad, params_list=params, gradient_scaling_factor=FACTOR)
    group = GRPOBucketGroup.__new__(GRPOBucketGroup)
    group.__dict__.update(buckets=[bucket], grpo=_Ctrl(), grpo_unit=0,
                          ddp_config=SimpleNamespace(average_in_collective=False),
                          grpo_late_params={params[LATE]})
    return group, params


def _local(step, rank):
    return torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(10 * step + rank))


def _finalize(ranks):
    """megatron's _allreduce_non_tensor_model_parallel_grads: an in-place sum over TP ranks."""
    views = [params[LATE].main_grad for _, params in ranks]
    total = sum(v.clone() for v in views)
    for v in views:
        v.copy_(total)


@pytest.mark.parametrize("late", [True, False])
def test_an_update_applies_each_local_gradient_once(late):
    """late=False: the glue told of no late elements, the old behaviour; the check must say
    bad there (x2 on the layernorm)."""
    ranks = [_rank(), _rank()]
    if not late:  # without the late set the old behaviour is back: the test must then fail
        for group, _ in ranks:
            group.grpo_late_params = set()
    for step in range(1, INTERVAL + 1):
        for r, (group, params) in enumerate(ranks):
            group.buckets[0].grad_data.copy_(_local(step, r))
            if step < INTERVAL:
                group._hold_stable_gradient()
            else:
                group._merge_stable_accumulator()
                group.buckets[0].grad_data.mul_(FACTOR)  # megatron's start_grad_sync scales
        _finalize(ranks)
        for group, _ in ranks:
            group.grpo.accum.commit()
    # What an exact run would apply to the layernorm: the mean over the steps of the TP sum.
    lo = sum(SIZES[:LATE])
    hi = lo + SIZES[LATE]
    want = FACTOR * sum(_local(s, r)[lo:hi] for s in range(1, INTERVAL + 1) for r in (0, 1)) / INTERVAL
    for group, _ in ranks:
        got = group.buckets[0].grad_data[lo:hi]
        if late:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert not torch.allclose(got, want, rtol=1e-2, atol=1e-3)
    # The TP-split weights are local (not all-reduced): their mean of local gradients.
    want_w = FACTOR * sum(_local(s, 0)[:lo] for s in range(1, INTERVAL + 1)) / INTERVAL
    assert torch.allclose(ranks[0][0].buckets[0].grad_data[:lo], want_w, rtol=1e-5, atol=1e-6)


def test_the_late_elements_are_found_from_the_main_grad_views():
    group, params = _rank()
    index = group._late_index(0, group.buckets[0])
    assert index.tolist() == [6, 7, 8, 9]
    group.grpo_late_params = set()
    group.__dict__.pop("_grpo_late_index")
    assert group._late_index(0, group.buckets[0]) is None
