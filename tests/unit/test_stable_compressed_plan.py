"""--grpo-stable-mode compressed without training: which units a step compresses with which
compressor, what the planners predict, and the flag's errors. (The training runs that check
counted bytes, identical copies, the monitor and resume are tests/multiproc/test_stable_compressed.py.)"""

from types import SimpleNamespace

import pytest

from megatron_grpo.comm.compress import Int4Compressor, Int8Compressor
from megatron_grpo.comm.compress_int2 import Int2Compressor
from megatron_grpo.grpo.config import GRPOConfig, GRPOConfigError
from megatron_grpo.grpo.controller.core import GRPOController
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec, plan
from megatron_grpo.planner.internode import internode

TIERS = dict(dynamic_share=0.65, stable_share=0.2, max_dynamic_share=0.7)
MODEL = ModelSpec(num_layers=32, hidden=4096, heads=32, ffn_hidden=14336, flash_attention=True)


def _decisions(tiered=True, fallback=False, compressed=True, dp=2):
    tiers = ["core", "dynamic", "stable"]
    ctrl = SimpleNamespace(dp_size=dp, tiers=tiers, tiered=tiered, core_exact=False,
                           units=[SimpleNamespace(pinned=None) for _ in tiers],
                           compressor=Int4Compressor(256), core_compressor=Int8Compressor(256),
                           stable_compressor=Int2Compressor(256) if compressed else None,
                           stable_fallback=fallback,
                           links=SimpleNamespace(compresses=lambda fmt: True))  # --grpo-compress all
    ctrl._core_compressed = lambda: GRPOController._core_compressed(ctrl)
    ctrl.unit_periodic = lambda i: False  # one instance: no local updates
    return [type(GRPOController.unit_compressor(ctrl, i)).__name__ for i in range(3)]


def test_stable_units_get_the_stable_compressor():
    assert _decisions() == ["Int8Compressor", "Int4Compressor", "Int2Compressor"]
    # Delayed or frozen stable units sync exactly (megatron's own) on their update steps.
    assert _decisions(compressed=False) == ["Int8Compressor", "Int4Compressor", "NoneType"]
    # After remediation found int2 bad, the dynamic tier's compressor.
    assert _decisions(fallback=True) == ["Int8Compressor", "Int4Compressor", "Int4Compressor"]
    assert _decisions(tiered=False) == ["NoneType", "Int4Compressor", "NoneType"]
    assert _decisions(dp=1) == ["NoneType"] * 3


def test_the_flag_names_its_choices():
    GRPOConfig(enabled=True, stable_mode="compressed", stable_compressor="int4").validate()
    with pytest.raises(GRPOConfigError, match=r"--grpo-stable-compressor must be one of int2, int4, "
                                              r"int8, got 'topk'"):
        GRPOConfig(enabled=True, stable_compressor="topk").validate()
    with pytest.raises(GRPOConfigError, match=r"--grpo-stable-mode must be one of frozen, delayed, "
                                              r"compressed, local, got 'int2'"):
        GRPOConfig(enabled=True, stable_mode="int2").validate()


def test_planner_stable_bytes_every_step_and_residuals():
    c = ClusterSpec(nodes=2, gpus_per_node=8, tp=2)
    delayed = plan(MODEL, c, GRPOConfig(enabled=True, stable_mode="delayed", **TIERS))
    int2 = plan(MODEL, c, GRPOConfig(enabled=True, stable_mode="compressed", **TIERS))
    int4 = plan(MODEL, c, GRPOConfig(enabled=True, stable_mode="compressed", stable_compressor="int4",
                                     **TIERS))
    # Exact bf16 sync: 4 + 2 bytes per element, every 10 steps; int2 every step: 2 x (1/4 + 4/256).
    d, s2 = delayed.grpo_traffic, int2.grpo_traffic
    assert (d.stable_interval, s2.stable_interval) == (10, 1)
    assert s2.stable_update == pytest.approx(d.stable_update * 2 * (0.25 + 4 / 256) / 6, rel=1e-3)
    assert s2.stable_average == s2.stable_update
    assert int4.grpo_traffic.stable_update == pytest.approx(s2.stable_update * (0.5 + 4 / 256)
                                                           / (0.25 + 4 / 256), rel=1e-3)
    assert (s2.core, s2.dynamic) == (d.core, d.dynamic)
    # Stable keeps error-feedback residuals and no delayed accumulator.
    assert int2.grpo_memory.error_feedback == pytest.approx(
        delayed.grpo_memory.error_feedback * (0.15 + 0.65 + 0.2) / (0.15 + 0.65), rel=1e-6)
    assert delayed.grpo_memory.delayed_accumulators > 0 and int2.grpo_memory.delayed_accumulators == 0


def test_planner_offload_keeps_a_stable_tier_synced_every_step_resident():
    # Without streaming only the stable tier's state moves, between its updates; a compressed
    # stable tier updates every step, so nothing is away between updates.
    from megatron_grpo.offload.config import OffloadConfig

    c = ClusterSpec(nodes=1, gpus_per_node=8)
    off = OffloadConfig(target="cpu", stream=False)
    delayed = plan(MODEL, c, GRPOConfig(enabled=True, **TIERS), offload=off)
    int2 = plan(MODEL, c, GRPOConfig(enabled=True, stable_mode="compressed", **TIERS), offload=off)
    assert delayed.grpo_memory.offloaded_between_updates > 0
    assert int2.grpo_memory.offloaded_between_updates == 0


def test_internode_planner_stable_every_step():
    c = ClusterSpec(nodes=2, gpus_per_node=8, instances=2)
    delayed = internode(MODEL, c, GRPOConfig(enabled=True, **TIERS))
    int2 = internode(MODEL, c, GRPOConfig(enabled=True, stable_mode="compressed", **TIERS))
    assert (delayed.stable_interval, int2.stable_interval) == (10, 1)
    # Exact fp32 ring all-reduce between 2 instances: 4 bytes per element of the shard; int2
    # sends 2 (I - 1) payloads of half a shard each: 2 x (1/4 + 4/256) / 2.
    assert int2.hier_stable_update == pytest.approx(delayed.hier_stable_update * (0.25 + 4 / 256) / 4,
                                                    rel=1e-3)
