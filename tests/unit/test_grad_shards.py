"""Gradient memory, the parts that need no training run: the norm standing in for a gradient
shard the memory tier holds away is exact (megatron/grad_shards.py), a placed shard is read
only through the tier, and the first batch's syncs start as their units are ready
(GRPOBucketGroup.register_grad_ready)."""

import pytest
import torch

from megatron_grpo.megatron.grad_storage import BucketGrads


def test_a_norm_stands_in_for_its_tensor_exactly():
    # megatron's CPU norm takes torch.norm of each gradient, then of those norms: a
    # one-element tensor holding a gradient's norm must give that norm back bit for bit.
    torch.manual_seed(0)
    for scale in (1e-30, 1e-12, 1e-3, 1.0, 1e3, 1e15):
        grads = [torch.randn(int(n)) * scale for n in torch.randint(1, 5000, (50,))]
        norms = [torch.norm(g) for g in grads]
        assert all(torch.equal(torch.norm(n.reshape(1)), n) for n in norms)
        whole = torch.norm(torch.tensor([torch.norm(g) for g in grads]))
        stood = torch.norm(torch.tensor([torch.norm(n.reshape(1)) for n in norms]))
        assert torch.equal(whole, stood)


class _Bucket:
    def __init__(self, numel: int):
        self.grad_data = torch.arange(numel, dtype=torch.float32)
        self.params_list = []


class _Range:
    def __init__(self, start, end):
        self.start, self.end, self.size = start, end, end - start


def test_a_placed_shard_is_read_only_through_the_tier():
    grads = BucketGrads(_Bucket(8), rank=1, size=2, late=[])
    into = torch.empty(4)
    grads.release(into=into)
    assert grads.shard is into and into.tolist() == [4, 5, 6, 7]
    dropped = []
    grads.on_drop = lambda: dropped.append(True)
    assert grads.placed() and grads.shard_bytes() == 16
    # Resident with its write in flight: still the tier's (it may read the file back into it).
    assert grads.param_grad(None, _Range(0, 2), _Range(5, 7)).tolist() == [5, 6]
    with pytest.raises(RuntimeError, match="per-token loss"):
        grads.scale(0.5)  # a scale after the sync would be lost to a read-back
    into.untyped_storage().resize_(0)  # away
    assert grads.shard_bytes() == 0 and grads.resident_bytes() == 0
    with pytest.raises(RuntimeError, match="read while it is on host memory or SSD"):
        grads.param_grad(None, _Range(0, 2), _Range(5, 7))
    grads.drop()
    assert dropped == [True] and grads.on_drop is None and not grads.placed()


class _Ctrl:
    class config:
        first_batch_overlap = True

    class _Unit:
        name = "decoder.layers.0 (+3 more)"

    units = [_Unit()]


def _first_batch_group():
    from types import SimpleNamespace

    from megatron_grpo.megatron.bucket_group import GRPOBucketGroup

    group = GRPOBucketGroup.__new__(GRPOBucketGroup)  # the state register_grad_ready reads
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    group.__dict__.update(
        ddp_config=SimpleNamespace(overlap_grad_reduce=True), is_last_microbatch=True,
        is_first_batch=True, params=[a, b], param_to_bucket={a: 0, b: 0},
        per_param_grad_ready_counts={}, golden_per_param_grad_ready_counts={},
        grpo=_Ctrl(), grpo_unit=0, grpo_storage=object())
    started = []
    group.start_grad_sync = lambda force_all_reduce=False: started.append(force_all_reduce)
    return group, a, b, started


def test_first_batch_sync_starts_when_every_gradient_is_ready_and_a_late_hook_is_an_error():
    group, a, b, started = _first_batch_group()
    group.register_grad_ready(a)
    assert started == []  # megatron's own first batch would wait for the end of backward
    group.register_grad_ready(b)
    assert started == [False]
    with pytest.raises(RuntimeError, match=r"unit 0 \(decoder.layers.0 \(\+3 more\)\) ran 2 times .*"
                                           r"--no-grpo-first-batch-overlap"):
        group.register_grad_ready(a)
    # Off: megatron's behaviour (nothing starts before finish_grad_sync).
    group, a, b, started = _first_batch_group()
    group.grpo.config = type("C", (), {"first_batch_overlap": False})
    group.register_grad_ready(a)
    group.register_grad_ready(b)
    assert started == []
