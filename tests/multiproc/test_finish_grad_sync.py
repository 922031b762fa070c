"""GRPO's ``finish_grad_sync`` keeps megatron's contract, checked against megatron's own bucket
group on two gloo ranks (GRPO on, every unit core and exact, so GRPO's sync is megatron's).

megatron's rule (0.18/0.19 ``_ParamAndGradBucketGroup.finish_grad_sync``; 0.16/0.17 have no
flag at all): without ``overlap_grad_reduce`` every call dispatches and waits; with it, the
'finished this iteration' flag is set only once the wait has returned. A flag set on entry
broke both: a second finish without overlap left the buffer unreduced where megatron reduces
it again, and the finish after one that raised returned without waiting, so the next
iteration's sync failed ("Should not have multiple communication calls outstanding at once").

Every rank runs the same calls whatever it finds and records what happened (values, the
exception's type); the asserts are made here, in the test process, so a rank that disagrees
cannot leave the other waiting in a collective. The gloo group has a short timeout as well:
a collective one rank skips fails the run instead of hanging it.
"""

import functools
import itertools

import pytest

from harness import megatron_rank, spawn_ranks

LAYERS, WIDTH = 4, 24  # one bucket group (bucket_size=None), as megatron's test_grad_sync
CASES = list(itertools.product((False, True), repeat=3))  # distopt, overlap, average_in_collective
IMPLS = ("megatron", "grpo")


def _cases(rank):
    return {"cases": {case: {impl: _run_case(rank, impl, *case) for impl in IMPLS} for case in CASES}}


def _build(impl, distopt, overlap, average):
    """A megatron DDP model with one bucket group: megatron's own class, or GRPO installed."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    tf = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    ddp = DistributedDataParallel(tf, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distopt, overlap_grad_reduce=overlap,
        bucket_size=None, average_in_collective=average), module)
    if impl == "grpo":
        from megatron_grpo.grpo.config import GRPOConfig
        from megatron_grpo.grpo.controller.core import GRPOController
        from megatron_grpo.megatron import grpo_data_parallel_group, install
        from megatron_grpo.megatron.bucket_group import GRPOBucketGroup

        ctrl = GRPOController(GRPOConfig(enabled=True, warmup_iters=100, core_compressor="none"),
                              [ddp], torch.device("cpu"), grpo_data_parallel_group())
        install([ddp], ctrl)
        ctrl.tiers = ["core"] * len(ctrl.units)
        ctrl.begin_step(0)
        assert all(isinstance(g, GRPOBucketGroup) for g in ddp.bucket_groups)
    assert len(ddp.buffers) == 1 and len(ddp.bucket_groups) == 1
    return ddp, ddp.buffers[0], ddp.bucket_groups[0], list(module.parameters())


def _call(fn, *args):
    """None, or the type of what ``fn`` raised (recorded, never re-raised: see the docstring)."""
    try:
        fn(*args)
        return None
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return type(exc).__name__


def _values(buffer):
    """The buffer's values as plain floats (tensors sent between processes would need the
    sender alive to be read)."""
    return buffer.grad_data.tolist()


def _fill(buffer, rank, seed, add=False):
    """Per-rank gradients, the same for both classes: multiples of 1/8, so every sum is exact."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    values = torch.randint(-64, 64, buffer.grad_data.shape, generator=g).float() / 8
    buffer.grad_data.add_(values) if add else buffer.grad_data.copy_(values)


def _leave_first_batch(group, params):
    """As megatron's test does: every parameter ready once (overlap only), then reset, so the
    group has its golden counts and is past the first batch."""
    for p in params:
        _call(group.register_grad_ready, p)
    group.reset()


def _run_case(rank, impl, distopt, overlap, average):
    ddp, buffer, group, params = _build(impl, distopt, overlap, average)
    record = {"grad_sync": _grad_sync(ddp, buffer, group, params)}
    ddp, buffer, group, params = _build(impl, distopt, overlap, average)
    if overlap:
        record["after_raise"] = _finish_after_a_finish_that_raised(rank, buffer, group, params)
    else:
        record["twice"] = _finish_twice(rank, buffer, group)
    return record


def _grad_sync(ddp, buffer, group, params):
    """megatron's test_grad_sync, for one bucket group: the buffer is all ones; each parameter is
    marked ready in turn and the group finished after each. With overlap the finishes before the
    last parameter raise (no call issued) and leave the buffer; without, each one syncs at once
    (and the buffer is refilled). Per parameter: what register_grad_ready and the finish raised,
    grad_data[0], the buffer."""
    buffer.grad_data.fill_(1.0)
    _leave_first_batch(group, params)
    steps = []
    for p in params:
        ready = _call(group.register_grad_ready, p)
        finish = _call(group.finish_grad_sync)
        steps.append((ready, finish, float(buffer.grad_data[0]), _values(buffer)))
        if not ddp.ddp_config.overlap_grad_reduce:
            buffer.grad_data.fill_(1.0)
    return steps


def _finish_twice(rank, buffer, group):
    """Overlap off, no reset between: finish, finish again, then finish once more after more
    gradient was accumulated (another micro-batch's backward). megatron syncs at every call (the
    plain second finish changes only a reduce-scatter's buffer: an all-reduce gives it back)."""
    _fill(buffer, rank, seed=1)
    outcomes, values = [], []
    for more in (False, False, True):
        if more:
            _fill(buffer, rank, seed=4, add=True)
        outcomes.append(_call(group.finish_grad_sync))
        values.append(_values(buffer))
    return outcomes, values


def _finish_after_a_finish_that_raised(rank, buffer, group, params):
    """Overlap on, past the first batch: a finish before the last gradient is ready raises (no
    call issued); the sync then starts, and the next finish must wait for it; the iteration after
    a reset must start its own sync without finding one outstanding."""
    _leave_first_batch(group, params)
    _fill(buffer, rank, seed=2)
    for p in params[:-1]:
        group.register_grad_ready(p)
    early = _call(group.finish_grad_sync)
    group.register_grad_ready(params[-1])  # every gradient ready: the sync starts
    finish = _call(group.finish_grad_sync)
    synced = (_values(buffer), group.grad_reduce_handle is None)
    group.reset()  # the next iteration (zero_grad_buffer)
    _fill(buffer, rank, seed=3)
    ready = [_call(group.register_grad_ready, p) for p in params]
    again = _call(group.finish_grad_sync)
    return early, finish, synced, ready, again, _values(buffer), group.grad_reduce_handle is None


@pytest.fixture(scope="module")
def ranks():
    results = spawn_ranks(functools.partial(megatron_rank, body=_cases, timeout_s=60), 2, timeout=300)
    for r in results:
        assert "error" not in r, r["error"]
    return sorted(results, key=lambda r: r["rank"])


def _diff(grpo, megatron, where=""):
    """Where GRPO's record first differs from megatron's (values exactly), or None."""
    if isinstance(grpo, (list, tuple)) and isinstance(megatron, (list, tuple)) and len(grpo) == len(megatron):
        for i, (a, b) in enumerate(zip(grpo, megatron)):
            found = _diff(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    return None if grpo == megatron else f"at {where}: GRPO {grpo!r}, megatron {megatron!r}"


def _assert_same(grpo, megatron, *context):
    """GRPO's record equals megatron's; a short message rather than two whole buffers."""
    found = _diff(grpo, megatron)
    assert found is None, (*context, found)


def _id(case):
    distopt, overlap, average = case
    return f"distopt={distopt}-overlap={overlap}-average={average}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_megatrons_grad_sync_sequence_gives_megatrons_results(ranks, case):
    """megatron's test_grad_sync (one instance) against GRPO's class: which finishes raise and
    grad_data[0] after each, as megatron's test expects them, and the whole buffer bit for bit
    as megatron's own class leaves it."""
    distopt, overlap, average = case
    for r in ranks:
        steps = {impl: r["cases"][case][impl]["grad_sync"] for impl in IMPLS}
        # With the distributed optimizer and a summing collective, grad_data[0] outside rank 0's
        # shard stays scaled by 1/DP only; elsewhere the collective leaves 1.
        reduced = 0.5 if distopt and not average and r["rank"] != 0 else 1.0
        last = len(steps["grpo"]) - 1
        for i, (ready, finish, first, _) in enumerate(steps["grpo"]):
            assert ready == (None if overlap else "AssertionError"), (r["rank"], i)
            early = overlap and i < last  # no call issued yet: megatron's finish asserts
            assert finish == ("AssertionError" if early else None), (r["rank"], i)
            assert first == (1.0 if early else reduced), (r["rank"], i)
        _assert_same(steps["grpo"], steps["megatron"], r["rank"])


@pytest.mark.parametrize("case", [c for c in CASES if not c[1]], ids=_id)
def test_a_second_finish_without_overlap_syncs_again_as_megatrons(ranks, case):
    for r in ranks:
        megatron, grpo = (r["cases"][case][impl]["twice"] for impl in IMPLS)
        assert grpo[0] == [None, None, None], grpo[0]
        for i, name in enumerate(("first finish", "second finish", "finish after more gradient")):
            _assert_same(grpo[1][i], megatron[1][i], r["rank"], name)


@pytest.mark.parametrize("case", [c for c in CASES if c[1]], ids=_id)
def test_the_finish_after_one_that_raised_still_waits_as_megatrons(ranks, case):
    for r in ranks:
        megatron, grpo = (r["cases"][case][impl]["after_raise"] for impl in IMPLS)
        early, finish, (synced, handle_cleared), ready, again, buffer, cleared = grpo
        assert early == "AssertionError"      # no call issued yet
        assert finish is None and handle_cleared, "the finish after it did not wait"
        assert ready == [None] * len(ready), f"rank {r['rank']}: the next iteration's sync: {ready}"
        assert again is None and cleared
        _assert_same(grpo, megatron, r["rank"])
