"""--grpo-grad-accumulation host (megatron/grad_accum.py) and --grpo-offload-core: the sum a
unit's storage gets back is megatron's own, bit for bit, and the settings refuse what cannot
work with the flag to change."""

from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.grpo.config import GRPOConfig, GRPOConfigError
from megatron_grpo.megatron.grad_accum import HostAccumulator, check_installable
from megatron_grpo.megatron.grad_storage import EMPTY, FULL, BucketGrads
from megatron_grpo.offload.config import OffloadConfig, OffloadConfigError


def _bucket(n=1000):
    grad = torch.zeros(n)
    grad.untyped_storage().resize_(0)
    return SimpleNamespace(grad_data=grad, params_list=[])


def test_park_and_fold_give_megatrons_sum_bit_for_bit_and_free_the_storage():
    torch.manual_seed(0)
    micro = [torch.randn(1000) * 10 ** float(k) for k in (-3, 0, 2, -1)]
    expected = torch.zeros(1000)
    for g in micro:  # megatron: every micro-batch added into the one storage
        expected.add_(g)
    grads, acc = BucketGrads(_bucket(), 0, 1, []), HostAccumulator()
    for k, g in enumerate(micro):
        grads.ensure()
        assert grads.state == FULL and torch.count_nonzero(grads.grad) == 0  # zeroed anew
        grads.grad.add_(g)
        if k < len(micro) - 1:
            acc.park(grads)
            assert grads.state == EMPTY and grads.grad.untyped_storage().nbytes() == 0
    acc.fold(grads)
    assert torch.equal(grads.grad, expected)
    assert (acc.parks, acc.folds, acc.parked_bytes) == (3, 1, 3 * 4000)
    assert acc.host_bytes() == 4000
    acc.fold(grads)  # nothing held any more: a second fold adds nothing
    assert torch.equal(grads.grad, expected)
    acc.clear()
    assert acc.parks == acc.folds == 0


def test_a_park_of_an_empty_unit_is_a_no_op_and_clear_forgets_an_aborted_step():
    grads, acc = BucketGrads(_bucket(10), 0, 1, []), HostAccumulator()
    acc.park(grads)
    assert acc.parks == 0 and acc.host_bytes() == 0
    grads.ensure()
    grads.grad.fill_(1.0)
    acc.park(grads)
    acc.clear()  # zero_grad_buffer of the next step: the parked sum is not owed to it
    grads.ensure()
    grads.grad.fill_(2.0)
    acc.fold(grads)
    assert torch.equal(grads.grad, torch.full((10,), 2.0))


def test_settings_refuse_what_cannot_work():
    with pytest.raises(GRPOConfigError, match="--grpo-grad-accumulation must be one of device, host"):
        GRPOConfig(enabled=True, grad_accumulation="cpu").validate()
    with pytest.raises(GRPOConfigError, match="--grpo-release-grads must be on with --grpo-grad-accumulation host"):
        GRPOConfig(enabled=True, grad_accumulation="host", release_grads=False).validate()
    with pytest.raises(OffloadConfigError, match="--grpo-offload-core .* without --grpo-offload-stream"):
        OffloadConfig(target="cpu", core=True, stream=False).validate(planned=True)
    host = GRPOConfig(enabled=True, grad_accumulation="host")
    with pytest.raises(ValueError, match="rank 3: --grpo-grad-accumulation host needs gradient release"):
        check_installable(None, SimpleNamespace(overlap_grad_reduce=True), host, 3)
    with pytest.raises(ValueError, match="needs --overlap-grad-reduce"):
        check_installable(object(), SimpleNamespace(overlap_grad_reduce=False), host, 0)
    check_installable(None, SimpleNamespace(overlap_grad_reduce=False), GRPOConfig(enabled=True), 0)


def test_the_device_copy_is_waited_for_before_the_storage_is_freed():
    """The CUDA path on a stream double that defers the copy stream's work until an event
    after it is waited for: a park that freed the storage before its copy ran would land
    zeros (or freed memory) on the host; the sum must still be exact."""
    from copy_stream_double import FakeCuda, factory

    cuda = FakeCuda()
    acc = HostAccumulator(copy_stream=factory(cuda)("cpu"))
    grads = BucketGrads(_bucket(64), 0, 1, [])
    total = torch.zeros(64)
    for k in range(3):
        grads.ensure()
        g = torch.arange(64, dtype=torch.float32) * (k + 1)
        grads.grad.add_(g)
        total.add_(g)
        if k < 2:
            acc.park(grads)
            assert grads.grad.untyped_storage().nbytes() == 0
            assert not cuda.streams[0].pending_storages()  # nothing queued reads it any more
    acc.fold(grads)
    assert torch.equal(grads.grad, total)
    assert [what for _, what, _ in cuda.log].count("event_synchronize") >= 2
