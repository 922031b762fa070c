"""The sampled backward's estimator (megatron_grpo.compute.sampler) and the autograd function
that carries it inside megatron's linear layers (megatron_grpo.megatron.sampled_linear), on one
process: the probabilities, the variance budget, unbiasedness of the weight and data gradients
(and that the check catches a biased estimator), core left to megatron's function bit for bit,
gradient-accumulation fusion's dummy-gradient protocol, and the FLOP count."""

import dataclasses
import math

import pytest
import torch

from megatron_grpo.compute import sampler as S
from megatron_grpo.compute.flops import FlopCount
from megatron_grpo.compute.plan import SampledBackward
from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.megatron import sampled_linear as SL


def _leverage(seed=0, n=400):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(n, generator=g) ** 4  # heavy-tailed, as token leverage is
    a[:7] = 0.0  # rows with no gradient (masked tokens, or dropped by a sampled layer above)
    return a


def _bisect_probabilities(a, keep):
    """The reference: p = min(1, c a) with c found by plain bisection on the expected count."""
    lo, hi = 0.0, 1e9
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(torch.clamp(mid * a, max=1.0).sum()) < keep * a.numel():
            lo = mid
        else:
            hi = mid
    return torch.clamp(hi * a, max=1.0)


@pytest.mark.parametrize("keep", [0.05, 0.2, 0.5, 0.9])
def test_probabilities_are_the_optimal_ones_for_the_expected_count(keep):
    a = _leverage()
    p = S.probabilities(a, keep)
    assert float(p.sum()) == pytest.approx(keep * a.numel(), rel=1e-5)
    assert float(p.max()) <= 1.0 and bool((p[a == 0] == 0).all())
    assert torch.allclose(p, _bisect_probabilities(a, keep), atol=1e-5)


def test_keep_for_budget_is_the_smallest_ratio_within_the_budget():
    a = _leverage(1)
    total = float(a.pow(2).sum())
    for budget in (0.05, 0.25, 1.0):
        keep = S.keep_for_budget(a, budget)
        assert S.added_variance(a, S.probabilities(a, keep)) <= budget * total * (1 + 1e-4)
        assert S.added_variance(a, S.probabilities(a, 0.97 * keep)) > budget * total
    # A looser budget never needs more rows.
    assert S.keep_for_budget(a, 1.0) < S.keep_for_budget(a, 0.25) < S.keep_for_budget(a, 0.05)
    assert S.keep_for_budget(torch.zeros(10), 0.25) == 0.0


def test_a_row_with_leverage_and_no_chance_is_refused():
    with pytest.raises(ValueError, match="biased"):
        S.added_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]))


class _Plan(SampledBackward):
    """A one-unit plan, tiered, unit 0 in ``tier`` at ``keep`` (no process group)."""

    def __init__(self, tier="dynamic", keep=0.3, dgrad="none", policy="importance", budget=0.25):
        cfg = GRPOConfig(enabled=True, sampled_backward=True, sample_dgrad=dgrad,
                         sample_policy=policy, sample_variance_budget=budget, sample_min_keep=keep,
                         sample_max_keep=keep, sample_interval=10**6)  # no measuring (exact) step
        super().__init__(cfg, 1, slice(0, 1), seed=7, dp_rank=0)
        self.wanted = [keep]
        self.end_recording()  # a forward of nothing: no unit below the layer
        self.begin_step(1, [tier], tiered=True)


def _layer(seed=0, rows=(24, 2), fan_in=16, fan_out=12):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, fan_in, generator=g) * torch.rand(*rows, 1, generator=g) ** 3)
    w = torch.randn(fan_out, fan_in, generator=g)
    dy = torch.randn(*rows, fan_out, generator=g) * torch.rand(*rows, 1, generator=g) ** 3
    return x, w, dy


def _sampled_grads(plan, x, w, dy, bias=None):
    site = SL.Site(plan, 0, column=True, tp_group=None)
    site.position = 0  # the first use of the forward: nothing below it
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = SL._SampledLinear.apply(xi, wi, bias, False, False, False, None, site)
    out.backward(dy)
    return xi.grad, wi.grad


def _unbiased(samples, exact, variance):
    """||mean - exact||^2 has expectation variance / M for an unbiased estimator: allow 4x."""
    mean = torch.stack(samples).double().mean(0)
    return float((mean - exact.double()).pow(2).sum()) <= 4 * variance / len(samples)


def test_the_sampled_weight_gradient_is_unbiased_and_its_variance_is_the_formula():
    x, w, dy = _layer()
    exact = dy.reshape(-1, 12).t() @ x.reshape(-1, 16)
    plan = _Plan(keep=0.3)
    a = (S.row_norms_sq(dy.reshape(-1, 12)) * S.row_norms_sq(x.reshape(-1, 16))).sqrt()
    variance = S.added_variance(a, S.probabilities(a, 0.3))
    samples = []
    for k in range(1, 3001):
        plan.begin_step(k, ["dynamic"], tiered=True)  # a new seed each draw
        samples.append(_sampled_grads(plan, x, w, dy)[1])
    assert _unbiased(samples, exact, variance)
    spread = torch.stack(samples).double() - exact.double()
    assert float(spread.pow(2).sum(dim=(1, 2)).mean()) == pytest.approx(variance, rel=0.1)
    # The check says "bad" on a biased estimator: the same rows without the 1/p weights.
    biased = [s * 0.3 for s in samples]
    assert not _unbiased(biased, exact, variance)


def test_the_sampled_data_gradient_is_unbiased():
    x, w, dy = _layer(1)
    exact = dy @ w
    plan = _Plan(keep=0.4, dgrad="below-core")
    d = S.row_norms_sq(dy.reshape(-1, 12)).sqrt()
    rows = (dy.reshape(-1, 12) @ w).pow(2).sum(1)
    p = S.probabilities(d, 0.4)
    variance = float(((1 / p - 1) * rows).sum())
    samples = []
    for k in range(1, 3001):
        plan.begin_step(k, ["dynamic"], tiered=True)
        samples.append(_sampled_grads(plan, x, w, dy)[0])
    assert _unbiased(samples, exact, variance)
    assert not _unbiased([s * 0.4 for s in samples], exact, variance)


def test_uniform_policy_keeps_every_row_with_the_same_chance():
    a = _leverage()
    p = S.uniform_probabilities(a, 0.25)
    assert bool((p == 0.25).all())


def test_core_goes_to_megatrons_function_untouched():
    """A core unit's call is megatron's own function with the same arguments: its gradients are
    megatron's bit for bit, and the sampled function never runs."""
    x, w, dy = _layer(2)
    calls = []

    def megatron_impl(input, weight, bias=None, **kw):
        calls.append(sorted(kw))
        return torch.nn.functional.linear(input, weight, bias)

    weight = torch.nn.Parameter(w.clone())
    for tier, sampled in (("core", False), ("dynamic", True)):
        plan = _Plan(tier=tier, keep=0.3)
        impl = SL._wrap(megatron_impl, {}, {id(weight): 0}, plan, True, None)
        xi = x.clone().requires_grad_()
        weight.grad = None
        impl(input=xi, weight=weight, bias=None, gradient_accumulation_fusion=False,
             allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
             wgrad_deferral_limit=None, tp_group=None).backward(dy)
        exact = dy.reshape(-1, 12).t() @ x.reshape(-1, 16)
        if sampled:
            assert len(calls) == 1 and not torch.equal(weight.grad, exact)
        else:
            assert len(calls) == 1 and torch.equal(weight.grad, exact)
            assert torch.equal(xi.grad, dy @ w)
    # 0.19's GTP re-materialisation shards the weight: such a call runs exact.
    plan = _Plan(tier="dynamic")
    impl = SL._wrap(megatron_impl, {}, {id(weight): 0}, plan, True, None)
    impl(input=x, weight=weight, gtp_remat_size=2)
    assert len(calls) == 2


def test_fused_wgrad_adds_to_main_grad_and_returns_megatrons_dummy():
    """Gradient-accumulation fusion: the sampled gradient goes into main_grad, a dummy gradient
    is returned and grad_added_to_main_grad set (DDP's hook then skips the add), as megatron's
    own backward does; zero_out_wgrad gives zeros."""
    x, w, dy = _layer(3)
    plan = _Plan(keep=1.0)  # every non-zero row, weight 1: the exact sum
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.full((12, 16), 0.5)
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = True
    site = SL.Site(plan, 0, column=True, tp_group=None)
    SL._SampledLinear.apply(x, weight, None, True, False, False, None, site).backward(dy)
    exact = dy.reshape(-1, 12).t() @ x.reshape(-1, 16)
    assert torch.allclose(weight.main_grad, exact + 0.5, atol=1e-5)
    assert weight.grad_added_to_main_grad is True
    assert torch.equal(weight.grad, torch.zeros(12, 16))


def test_flops_count_the_rows_each_part_computed():
    x, w, dy = _layer(4)
    plan = _Plan(keep=0.3, dgrad="below-core")
    plan.flops.other = 1000
    _sampled_grads(plan, x, w, dy)
    m = plan.metrics()
    per_row = 2 * 16 * 12
    assert m["flops_dynamic_fwd"] == 48 * per_row
    assert 0 < m["flops_dynamic_wgrad"] < 48 * per_row and m["flops_dynamic_wgrad"] % per_row == 0
    assert 0 < m["flops_dynamic_dgrad"] < 48 * per_row
    assert m["flops_exact_step"] == 3 * 48 * per_row + 1000
    assert m["flops_ratio"] == pytest.approx(m["flops_step"] / m["flops_exact_step"])
    assert m["sample_keep_dynamic"] == pytest.approx(0.3)


def test_keep_ratios_follow_the_measured_budget_within_floor_and_ceiling():
    cfg = GRPOConfig(enabled=True, sampled_backward=True, sample_min_keep=0.2, sample_max_keep=0.9,
                     sample_interval=5)
    plan = SampledBackward(cfg, 3, slice(0, 3), seed=1, dp_rank=0)
    plan.begin_step(5, ["core", "core", "core"], tiered=False)
    assert not plan.measuring and plan.ratios == [1.0, 1.0, 1.0]  # nothing samples, nothing measured
    plan.begin_step(5, ["dynamic", "dynamic", "dynamic"], tiered=True)
    # A measuring step keeps every row (its exact gradients score importance below core).
    assert plan.measuring and plan.ratios == [1.0, 1.0, 1.0]
    assert plan.estimated_units() == frozenset()
    for unit, want in enumerate((0.5, 0.05, 0.99)):
        plan.record(unit, want, 100)
    plan.end_step(lambda t: t)  # one rank: the sum is its own
    plan.begin_step(6, ["core", "dynamic", "stable"], tiered=True)
    assert not plan.measuring
    assert plan.ratios == [1.0, 0.2, 0.9]  # core exact; floor; ceiling
    assert plan.estimated_units() == frozenset({1, 2})  # importance skips them this step
    plan.begin_step(10, ["dynamic", "dynamic", "stable"], tiered=True)
    plan.record(0, 0.3, 50)
    plan.record(0, 0.6, 150)
    plan.end_step(lambda t: t)
    plan.begin_step(11, ["dynamic", "dynamic", "stable"], tiered=True)
    assert plan.ratios[0] == pytest.approx(0.5 * 0.5 + 0.5 * (0.3 * 50 + 0.6 * 150) / 200)
    saved = plan.state_dict()
    other = SampledBackward(cfg, 3, slice(0, 3), seed=1, dp_rank=0)
    other.load_state_dict(saved)
    other.begin_step(11, ["dynamic", "dynamic", "stable"], tiered=True)
    assert other.ratios == plan.ratios
    # Without --grpo-sampled-backward no step measures: no collective is paid for it.
    off = SampledBackward(dataclasses.replace(cfg, sampled_backward=False), 3, slice(0, 3), 1, 0)
    off.begin_step(10, ["dynamic", "dynamic", "stable"], tiered=True)
    assert not off.measuring
    with pytest.raises(ValueError, match="--grpo-bucket-mb"):
        SampledBackward(cfg, 4, slice(0, 4), 1, 0).load_state_dict(saved)


def test_generators_repeat_per_iteration_and_call_and_differ_across_data_parallel_ranks():
    cfg = GRPOConfig(enabled=True, sampled_backward=True)
    draws = {}
    for dp in (0, 1):
        for _ in range(2):  # the same rank twice: a resumed run draws what the first did
            plan = SampledBackward(cfg, 1, slice(0, 1), seed=3, dp_rank=dp)
            plan.begin_step(12, ["dynamic"], tiered=True)
            draws.setdefault(dp, []).append([torch.rand(4, generator=plan.generator(torch.device("cpu")))
                                             for _ in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(*draws[0]))
    assert not torch.equal(draws[0][0][0], draws[0][0][1])  # calls differ
    assert not torch.equal(draws[0][0][0], draws[1][0][0])  # dp ranks differ


def test_sample_flags_are_validated():
    from megatron_grpo.grpo.config import GRPOConfigError

    for kw, flag in (({"sample_dgrad": "all"}, "--grpo-sample-dgrad"),
                     ({"sample_policy": "random"}, "--grpo-sample-policy"),
                     ({"sample_interval": 0}, "--grpo-sample-interval"),
                     ({"sample_variance_budget": 0.0}, "--grpo-sample-variance-budget")):
        with pytest.raises(GRPOConfigError, match=flag):
            GRPOConfig(**kw).validate()
    with pytest.raises(GRPOConfigError, match="min-keep"):
        GRPOConfig(sample_min_keep=0.5, sample_max_keep=0.4).validate()
    assert math.isclose(FlopCount().metrics()["flops_ratio"], 1.0)


def test_te_layers_are_refused_naming_the_layer_and_the_way_out():
    from megatron_grpo.grpo.config import ConfigError

    class TELayerNormColumnParallelLinear(torch.nn.Module):  # the name is what install reads
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 2))

    model = torch.nn.Module()
    model.add_module("linear_qkv", TELayerNormColumnParallelLinear())
    chunk = type("Chunk", (), {"module": model})()
    with pytest.raises(ConfigError, match="linear_qkv is TELayerNormColumnParallelLinear.*"
                                          "--transformer-impl local"):
        SL.install([chunk], [], _Plan())
    off = _Plan()
    off.config.sampled_backward = False  # FLOPs counting only: nothing to refuse, nothing wrapped
    assert SL.install([chunk], [], off) == 0


_HOST_SYNCS = ("_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "equal")
"""aten ops that make the host wait for the device (a value or a data-dependent shape)."""


def _host_syncs_in(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in _HOST_SYNCS:
                seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return seen


def test_a_sampled_backward_never_waits_on_the_device():
    """Per layer and micro-batch, the draw, the reweighting, the measurement and the digest stay
    on the device: on a GPU an item(), nonzero or a shape that depends on the draw stalls the
    host behind the backward's kernels, layer after layer. The counter says "bad" on an op that
    syncs, and counts none in a whole sampled backward, weight and data gradients, measuring."""
    assert _host_syncs_in(lambda: (torch.nonzero(torch.ones(3)), float(torch.ones(())))) \
        == ["nonzero", "_local_scalar_dense"]
    x, w, dy = _layer(5)
    plan = _Plan(keep=0.3, dgrad="below-core")
    plan.begin_step(2, ["dynamic"], tiered=True)
    plan.measuring = True
    assert _host_syncs_in(lambda: _sampled_grads(plan, x, w, dy)) == []
    assert float(plan._sums[0, 1]) == 48  # the measurement was taken (all 48 rows live)
    plan.end_step(lambda t: t)  # one sync per measuring step, after the step: allowed


def test_importance_ranks_sampled_units_as_the_exact_run_does():
    """Importance scores sum |g| |w|, and an unbiased estimate's |g_hat| is larger than |g| on
    average: scored from estimates, a sampled unit looks more important than it is, the very
    score that decides who is sampled. Unit A (exact) and unit B (sampled at keep 0.2) see the
    same batches; B's weight is 0.95 A's, so its true score is 0.95 A's on every step. Over 16
    independent runs of 50 steps, the mean final score: scored from its estimates B outranks A
    (the check says "bad"); scored as the plan says (estimated steps skipped, measuring steps
    keep every row) B's score is the exact run's in expectation and the ranking is the exact
    run's. (One run's EMA is noisy either way: a few exact observations decide it.)"""
    from megatron_grpo.grpo.importance import ImportanceTracker

    cfg = GRPOConfig(enabled=True, sampled_backward=True, sample_min_keep=0.2, sample_max_keep=0.2,
                     sample_interval=5)
    finals = {k: torch.zeros(2, dtype=torch.float64) for k in ("exact", "estimates", "plan")}
    runs = 16
    for run in range(runs):
        plan = SampledBackward(cfg, 1, slice(0, 1), seed=run, dp_rank=0)
        plan.wanted = [0.2]
        plan.end_recording()
        trackers = {k: ImportanceTracker(2, [1, 1], decay=0.9) for k in finals}
        for k in range(1, 51):
            x, w, dy = _layer(1000 * run + k)
            exact = dy.reshape(-1, 12).t() @ x.reshape(-1, 16)
            wa, wb = w, 0.95 * w
            plan.begin_step(k, ["dynamic"], tiered=True)
            sampled = _sampled_grads(plan, x, wb, dy)[1]
            observed = {"exact": exact, "plan": None if 0 in plan.estimated_units() else sampled}
            if plan.measuring:  # every fifth step keeps every row: B's exact gradient there
                assert torch.allclose(sampled, exact, rtol=1e-4, atol=1e-4)
                plan.ratios = [0.2]  # what scoring estimates on every step would have seen
                observed["estimates"] = _sampled_grads(plan, x, wb, dy)[1]
            else:
                observed["estimates"] = sampled
            for name, tracker in trackers.items():
                tracker.observe(0, [exact], [wa])
                if observed[name] is not None:
                    tracker.observe(1, [observed[name]], [wb])
                tracker.commit()
        for name, tracker in trackers.items():
            finals[name] += tracker.bucket_scores().cpu() / runs
    score = {name: v.tolist() for name, v in finals.items()}
    assert score["exact"][1] == pytest.approx(0.95 * score["exact"][0], rel=1e-5)
    assert score["estimates"][1] > 1.03 * score["estimates"][0]  # inflated past the more important unit
    assert score["plan"][1] < score["plan"][0]  # the exact run's ranking
    assert score["plan"][1] == pytest.approx(score["exact"][1], rel=0.03)
