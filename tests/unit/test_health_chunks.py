"""HealthSums.add on a monitoring step: bounded chunks, fp32 per chunk, no host sync.

It runs on the side stream inside the backward hook, once per compressed bucket. On GPU an fp64
copy of a 128 MB bucket (plus bucket-sized products) is ~1 GB that stays cached in the side
stream's pool, and a device scalar built from a Python float is a blocking host-to-device copy
inside backward. On CPU the same facts are visible at the aten level: every op ``add`` runs is
recorded by a dispatch mode, with the storages it allocates and how long they stay alive.
"""

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_grpo.grpo import health
from megatron_grpo.grpo.health import FIELDS, HealthSums, health_figures

CHUNK = 4096
BUCKET = 16 * CHUNK + 37  # 16 chunks and a ragged tail
# Ops that read a device value on the host (a sync) or build a tensor from a Python number
# (torch.tensor(x, device=cuda): a blocking host-to-device copy).
SYNC_OR_HOST_SCALAR = {"aten._local_scalar_dense.default", "aten.item.default",
                       "aten.lift_fresh.default", "aten.lift_fresh_copy.default",
                       "aten.scalar_tensor.default"}


class _AllocationRecorder(TorchDispatchMode):
    """Every aten op run, and the peak bytes of the storages those ops freshly allocated that
    are alive at once (views and in-place/out= results allocate nothing and are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops, self.largest_numel, self.peak_bytes = [], 0, 0
        self._live = []  # (weakref to a fresh storage, its bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        outs = out if isinstance(out, (tuple, list)) else [out]
        for ret, t in zip(func._schema.returns, outs):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:  # a new storage
                self.largest_numel = max(self.largest_numel, t.numel())
                s = t.untyped_storage()
                self._live.append((weakref.ref(s), s.nbytes()))
        self._live = [(r, n) for r, n in self._live if r() is not None]
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self._live))
        return out


def _old_sums(applied, owed):
    """The figures as HealthSums computed them before chunking: fp64 over the whole bucket."""
    a, c = applied.double(), owed.double()
    return torch.stack([a.sum(), (a * a).sum(), c.sum(), (c * c).sum(), (a * c).sum(),
                        torch.tensor(float(a.numel()), dtype=torch.float64)])


def _pair(dtype, seed=0, noise=0.05):
    g = torch.Generator().manual_seed(seed)
    owed = (torch.randn(BUCKET, generator=g) + 0.3).to(dtype)  # a mean, so gvr is not trivial
    applied = (owed.float() + noise * torch.randn(BUCKET, generator=g)).to(dtype)
    return applied, owed


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(health, "HEALTH_CHUNK_ELEMENTS", CHUNK, raising=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_allocates_at_most_two_fp32_chunks_and_never_syncs(small_chunks, dtype):
    applied, owed = _pair(dtype)
    sums = HealthSums(3, "cpu")
    with _AllocationRecorder() as rec:
        sums.add(1, applied, owed)
    # bf16 is widened one chunk of a and one of c at a time; fp32 needs no copy at all.
    # 1 KiB of slack for the per-chunk partial sums (a handful of scalars).
    budget = 2 * CHUNK * 4 + 1024
    assert rec.largest_numel <= 2 * CHUNK, (rec.largest_numel, BUCKET)
    assert rec.peak_bytes <= budget, (rec.peak_bytes, budget)
    assert SYNC_OR_HOST_SCALAR.isdisjoint(rec.ops), sorted(SYNC_OR_HOST_SCALAR & set(rec.ops))
    assert sums.units == {1}
    assert sums.values[1, 5].item() == BUCKET and sums.values[[0, 2]].abs().sum().item() == 0.0


@pytest.mark.parametrize("noise", [0.05, 0.005])  # ~int4 and ~int8 relative errors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_figures_match_the_fp64_figures(small_chunks, dtype, noise):
    """fp32 partials, fp64 accumulation: the figures of the fp64 path to 1e-6, also where
    ||a-c|| is small (sum a*c in fp32 would cancel: ~2e-5 off at rel_error 0.05)."""
    applied, owed = _pair(dtype, seed=1, noise=noise)
    sums = HealthSums(2, "cpu")
    sums.add(0, applied, owed)
    ref = _old_sums(applied, owed)
    assert sums.values.dtype == torch.float64 and tuple(sums.values.shape) == (2, FIELDS)
    torch.testing.assert_close(sums.values[0], ref, rtol=1e-6, atol=1e-6)
    got = health_figures(sums.values, [0])
    want = health_figures(torch.stack([ref, torch.zeros(FIELDS, dtype=torch.float64)]), [0])
    for key in ("gvr", "rel_error", "cosine"):
        assert math.isclose(got[key], want[key], rel_tol=1e-6), (key, got[key], want[key])
    assert 0.5 * noise < got["rel_error"] < 2 * noise and got["cosine"] > 0.99  # healthy


def test_a_second_bucket_of_the_same_unit_adds_up(small_chunks):
    a1, c1 = _pair(torch.float32, seed=2)
    a2, c2 = _pair(torch.bfloat16, seed=3)
    sums = HealthSums(1, "cpu")
    sums.add(0, a1, c1)
    sums.add(0, a2[:CHUNK - 1], c2[:CHUNK - 1])  # shorter than one chunk
    ref = _old_sums(a1, c1) + _old_sums(a2[:CHUNK - 1], c2[:CHUNK - 1])
    torch.testing.assert_close(sums.values[0], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sign_flip_still_reads_bad(small_chunks, dtype):
    """A monitor must be able to say bad: a decode that flips every sign."""
    _, owed = _pair(dtype, seed=4)
    sums = HealthSums(1, "cpu")
    sums.add(0, -owed, owed)
    fig = health_figures(sums.values, [0])
    assert math.isclose(fig["cosine"], -1.0, abs_tol=1e-6)
    assert math.isclose(fig["rel_error"], 2.0, rel_tol=1e-6)


def test_applied_and_owed_of_different_lengths_are_refused(small_chunks):
    with pytest.raises(ValueError, match="applied.*owed"):
        HealthSums(1, "cpu").add(0, torch.zeros(10), torch.zeros(11))
