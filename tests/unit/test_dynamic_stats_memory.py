"""A monitoring step's compressed reduce-scatter reports D(q) to the health sums without a
bucket-sized decoded copy (on GPU that copy is 128 MB of fp32 per 128 MB
bucket, made on the side stream inside backward and kept in its pool).

The collective is run at dp = 8 with a stand-in for torch.distributed (the payload exchange
does not matter here: only what is allocated before it), and every allocation is recorded at
the aten level."""

import types

import pytest
import torch

from megatron_grpo.comm import dynamic
from megatron_grpo.comm.compress import build_compressor
from megatron_grpo.comm.error_feedback import ErrorFeedback
from megatron_grpo.grpo.health import HealthSums

from test_health_chunks import _AllocationRecorder  # noqa: E402  (tests/unit is on sys.path)

DP, SHARD = 8, 4096


def _fake_dist(monkeypatch):
    fake = types.SimpleNamespace(
        get_world_size=lambda group=None: DP, get_rank=lambda group=None: 0,
        all_to_all_single=lambda out, inp, group=None, async_op=False: (
            out.copy_(inp), types.SimpleNamespace(wait=lambda: None))[1])
    monkeypatch.setattr(dynamic, "dist", fake)


def _reduce_with_stats(name, monkeypatch, block):
    """Run one compressed reduce-scatter on a monitoring step. Returns the largest tensor
    allocated while decoding D(q) for the health sums, the largest D(q) piece handed to them,
    and the sums beside those of the whole bucket at once (the figures must not change)."""
    _fake_dist(monkeypatch)
    monkeypatch.setattr(dynamic, "STATS_BLOCK_ELEMENTS", block, raising=False)
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(DP * SHARD, generator=g)
    owed_copy = grad.clone()  # no residual yet: owed = grad
    sums = HealthSums(1, "cpu")
    compressor = build_compressor(name)
    decode, rec, pieces = compressor.decompress_rows, _AllocationRecorder(), []

    def recorded_decode(*args, **kwargs):
        with rec:
            return decode(*args, **kwargs)

    def stats(applied, owed):
        pieces.append(applied.numel())
        with rec:
            sums.add(0, applied, owed)

    compressor.decompress_rows = recorded_decode
    dynamic.CompressedReduceScatter(("u", 0), grad, torch.empty(SHARD), ErrorFeedback(),
                                    compressor, None, async_op=False, stats=stats)
    compressor.decompress_rows = decode
    send = compressor.compress_rows(owed_copy.view(DP, SHARD))
    whole = HealthSums(1, "cpu")
    whole.add(0, compressor.decompress_rows(send, SHARD).view(-1), owed_copy)
    return rec.largest_numel, max(pieces), sums, whole


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_monitoring_step_decodes_a_block_not_the_bucket(name, monkeypatch):
    largest, piece, sums, whole = _reduce_with_stats(name, monkeypatch, block=2 * SHARD)
    # Before: decompress_rows made one fp32 [dp, shard] tensor, the whole bucket (32768).
    assert largest <= 2 * SHARD, (largest, DP * SHARD)
    assert piece == 2 * SHARD, (piece, DP * SHARD)
    torch.testing.assert_close(sums.values, whole.values, rtol=1e-6, atol=0)  # fp32 partial sums: blocks sum in another order
    assert sums.values[0, 5].item() == DP * SHARD


def test_a_shard_larger_than_the_block_is_decoded_one_shard_at_a_time(monkeypatch):
    largest, piece, sums, whole = _reduce_with_stats("int4", monkeypatch, block=SHARD // 2)
    assert largest <= SHARD and piece == SHARD, (largest, piece)
    torch.testing.assert_close(sums.values, whole.values, rtol=1e-6, atol=0)  # fp32 partial sums: blocks sum in another order
