"""--grpo-core-compressor: which units a step compresses, and what the planner predicts for it.
(The runs that check counted bytes, identical copies and resume are in
tests/multiproc/test_core_compressor.py.)"""

from types import SimpleNamespace

import pytest

from megatron_grpo.comm.compress import Int4Compressor, Int8Compressor
from megatron_grpo.grpo.config import GRPOConfig, GRPOConfigError
from megatron_grpo.grpo.controller.core import GRPOController
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec, plan


def _ctrl(tiers, dp=2, tiered=True, core="int8", pinned=(), core_exact=False, pays=("int8", "int4", "int2")):
    units = [SimpleNamespace(pinned="core" if i in pinned else None) for i in range(len(tiers))]
    ctrl = SimpleNamespace(dp_size=dp, tiers=list(tiers), tiered=tiered, units=units,
                           compressor=Int4Compressor(256), core_exact=core_exact,
                           core_compressor=Int8Compressor(256) if core else None,
                           stable_compressor=None, stable_fallback=False,
                           links=SimpleNamespace(compresses=lambda fmt: fmt in pays))  # --grpo-compress
    ctrl._core_compressed = lambda: GRPOController._core_compressed(ctrl)
    ctrl.unit_periodic = lambda i: False  # one instance: no local updates
    return ctrl


def _decisions(ctrl):
    return [type(GRPOController.unit_compressor(ctrl, i)).__name__ for i in range(len(ctrl.tiers))]


def test_each_unit_gets_its_tiers_compressor():
    tiers = ["core", "dynamic", "stable", "core"]
    assert _decisions(_ctrl(tiers)) == ["Int8Compressor", "Int4Compressor", "NoneType", "Int8Compressor"]
    # Without the flag core is exact (megatron's own sync), as before.
    assert _decisions(_ctrl(tiers, core=None)) == ["NoneType", "Int4Compressor", "NoneType", "NoneType"]
    # The warm-up (all core, before the first tiering) is the baseline's exact sync.
    assert _decisions(_ctrl(["core"] * 3, tiered=False)) == ["NoneType"] * 3
    # A unit pinned to core (copies on two pipeline stages) stays exact.
    assert _decisions(_ctrl(tiers, pinned=(3,))) == ["Int8Compressor", "Int4Compressor", "NoneType", "NoneType"]
    # One data-parallel rank has nothing to send: nothing is compressed.
    assert _decisions(_ctrl(tiers, dp=1)) == ["NoneType"] * 4
    # Once remediation found the compressed core bad, core syncs exactly; dynamic is unchanged.
    assert _decisions(_ctrl(tiers, core_exact=True)) == ["NoneType", "Int4Compressor", "NoneType", "NoneType"]
    # A format that does not pay on this run's links (--grpo-compress auto's probe) syncs exactly.
    assert _decisions(_ctrl(tiers, pays=("int4",))) == ["NoneType", "Int4Compressor", "NoneType", "NoneType"]
    assert _decisions(_ctrl(tiers, pays=())) == ["NoneType"] * 4


def test_the_flag_names_its_choices():
    GRPOConfig(enabled=True, core_compressor="int4").validate()
    with pytest.raises(GRPOConfigError, match=r"--grpo-core-compressor must be one of none, int8, int4, got 'topk'"):
        GRPOConfig(enabled=True, core_compressor="topk").validate()


def test_planner_core_bytes_and_residuals():
    m = ModelSpec(num_layers=32, hidden=4096, heads=32, ffn_hidden=14336, flash_attention=True)
    c = ClusterSpec(nodes=2, gpus_per_node=8, tp=2)
    tiers = dict(dynamic_share=0.65, stable_share=0.2, max_dynamic_share=0.7)
    exact = plan(m, c, GRPOConfig(enabled=True, core_compressor="none", **tiers))
    core8 = plan(m, c, GRPOConfig(enabled=True, core_compressor="int8", **tiers))
    # bf16 exact sync sends 4 + 2 bytes per element; int8 sends 2 x (1 + 4/256).
    assert core8.grpo_traffic.core == pytest.approx(exact.grpo_traffic.core * 2 * (1 + 4 / 256) / 6, rel=1e-3)
    assert core8.grpo_traffic.dynamic == exact.grpo_traffic.dynamic
    assert core8.grpo_traffic.stable_update == exact.grpo_traffic.stable_update
    # Core now keeps error-feedback residuals (fp32, one per element of its shard's buckets).
    ratio = core8.grpo_memory.error_feedback / exact.grpo_memory.error_feedback
    assert ratio == pytest.approx((0.15 + 0.65) / 0.65, rel=1e-6)
