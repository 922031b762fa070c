"""Gradient shards through the memory tier (megatron/grad_shards.py), the parts that need no
training run: the norm stand-in is exact, and a placed shard is read only through the tier."""

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
