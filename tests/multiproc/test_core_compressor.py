"""--grpo-core-compressor int8: the core tier compressed with error feedback of its own, on 2-4
gloo ranks and real text. What holds for the dynamic tier must hold for core too (every copy the
same bytes, counted bytes = analytic, residuals kept and resumed), with TP and PP too. Which
units are compressed (not the warm-up, not a unit pinned to core) is tests/unit/test_core_compressor_choice.py."""

import pytest

from harness import (GRPO_SMALL, SMALL_MODEL, assert_copies_agree, probe_with_metrics, read_metrics,
                     run_probe, stop_and_resume, train_and_read)

CORE8 = ["--grpo-core-compressor", "int8"]


@pytest.fixture(scope="module")
def core8_probe(stdlib_data, tmp_path_factory):
    return probe_with_metrics(tmp_path_factory.mktemp("core8"), 2,
                              [*SMALL_MODEL, *GRPO_SMALL, *CORE8, "--data-path", stdlib_data,
                               "--train-iters", "20", "--eval-interval", "20"])


def test_copies_identical_and_core_bytes_int8(core8_probe):
    probe, metrics = core8_probe
    r0, r1 = probe["ranks"]
    for a, b in zip(r0, r1):
        assert a["tiers"] == b["tiers"]
        # Core units now receive quantised parameter updates too: both copies stay identical.
        assert a["digest"] == b["digest"], f"model copies differ after iteration {a['iteration']}"
    for rec, m in zip(r0, metrics):
        for tier in ("core", "dynamic", "stable"):
            assert m[f"wire_bytes_{tier}"] == rec["expected"][tier], (rec["iteration"], tier)
    # Before the first tiering (iteration 9) every unit is core and exact: megatron's own sync.
    warm = metrics[0]["wire_bytes_core"]
    assert [m["wire_bytes_core"] for m in metrics[:8]] == [warm] * 8
    tiered = [m for m in metrics if set(m["grpo_tier_map"]) != {"c"}]
    assert [m["iteration"] for m in tiered] == list(range(9, 21))
    assert all("c" in m["grpo_tier_map"] for m in tiered)
    for m in tiered:
        # int8 with one fp32 scale per 256 values: (1 + 4/256)/4 = 0.254 of the exact bytes, a
        # little more here (0.30) where this test's 10k-element units pad their shards' last chunk.
        exact = m["grpo_share_core"] * warm
        assert 0.2 * exact < m["wire_bytes_core"] < 0.35 * exact, m["iteration"]


def test_core_units_keep_error_feedback(core8_probe):
    probe, _ = core8_probe
    core_residuals = 0
    for rank in probe["ranks"]:
        for rec in rank:
            tiers = rec["tiers_after"]
            assert all(tiers[u] in ("core", "dynamic") for u in rec["ef_units"]), rec["iteration"]
            # A unit leaving a compressed tier for core takes its residual in the same step's
            # sync; only stable units wait with one (for their next update).
            assert all(tiers[u] == "stable" for u in rec["carry_units"]), rec["iteration"]
            core_residuals += sum(tiers[u] == "core" for u in rec["ef_units"])
            if rec["iteration"] <= 8:
                assert rec["ef_units"] == [], rec["iteration"]  # the exact warm-up keeps none
    assert core_residuals > 0


def test_core_health_is_measured_and_healthy_int8_left_alone(core8_probe):
    # The monitor watches the compressed core tier as it does dynamic: int8 holds back ~1 % of
    # what was owed, far below the limit, so no remediation and core stays compressed.
    _, metrics = core8_probe
    checks = [m for m in metrics if "grpo_rel_error_core" in m]
    assert [m["iteration"] for m in checks] == [12, 16, 20]
    for m in checks:
        assert 0.0 < m["grpo_rel_error_core"] < 0.05 and m["grpo_cosine_core"] > 0.99, m["iteration"]
        assert "grpo_rel_error_dynamic" in m
    assert not any(m["grpo_core_exact"] for m in metrics)
    assert [e["iteration"] for m in metrics for e in m.get("grpo_retier", [])] == [9, 17]  # tiering, re-tier


def test_broken_core_compressor_is_caught_and_core_goes_exact(stdlib_data, tmp_path):
    # A core compressor decoding every value with the wrong sign (int8 otherwise) reads a
    # relative error ~2 and a cosine ~-1 at the checks of 12 and 16; the second bad check in a
    # row sends core exact from iteration 17 on. The dynamic tier (plain int4) is left alone.
    probe, m = probe_with_metrics(tmp_path, 2, [
        *SMALL_MODEL, *GRPO_SMALL, *CORE8, "--data-path", stdlib_data, "--train-iters", "20",
        "--eval-interval", "20", "--eval-iters", "0", "--grpo-gvr-window", "2",
        "--grpo-retier-interval", "100", "--probe-signflip-core-compressor"])
    checks = [r for r in m if "grpo_rel_error_core" in r]
    assert [r["iteration"] for r in checks] == [12, 16]  # not at 20: core is exact by then
    for r in checks:
        assert 1.8 < r["grpo_rel_error_core"] < 2.2 and r["grpo_cosine_core"] < -0.95
        assert r["grpo_rel_error_dynamic"] < 0.3  # int4, healthy
    assert [r["iteration"] for r in m if "grpo_rel_error_dynamic" in r] == [12, 16, 20]
    events = [e for r in m for e in r.get("grpo_retier", [])]
    assert [e["iteration"] for e in events] == [9, 17]
    assert events[1]["reason"].startswith("remediation: core relative compression error ")
    assert events[1]["reason"].endswith("for 2 checks: core synced exactly from here on")
    assert [r["grpo_core_exact"] for r in m] == [False] * 15 + [True] * 5
    assert m[15]["grpo_tier_map"] == m[16]["grpo_tier_map"]  # nothing moved
    r0, r1 = probe["ranks"]
    for a, b, r in zip(r0, r1, m):
        assert a["digest"] == b["digest"], a["iteration"]  # copies agree, before and after
        for tier in ("core", "dynamic", "stable"):
            assert r[f"wire_bytes_{tier}"] == a["expected"][tier], (a["iteration"], tier)
    # From 17 core travels exactly (fp32 reduce-scatter + all-gather, as in the warm-up) and
    # keeps no residual; its owed residuals went with that first exact sync.
    share = m[16]["grpo_share_core"]
    assert m[16]["wire_bytes_core"] == pytest.approx(share * m[0]["wire_bytes_core"], rel=1e-6)
    for rank in probe["ranks"]:
        for rec in rank[16:]:
            assert all(rec["tiers_after"][u] == "dynamic" for u in rec["ef_units"]), rec["iteration"]
            assert all(rec["tiers_after"][u] == "stable" for u in rec["carry_units"]), rec["iteration"]
        assert any(rec["tiers_after"][u] == "core" for rec in rank[9:15] for u in rec["ef_units"])


def test_resume_with_core_residuals_is_bit_identical(stdlib_data, tmp_path):
    common = [*SMALL_MODEL, *GRPO_SMALL, *CORE8, "--data-path", stdlib_data, "--train-iters", "16",
              "--eval-interval", "16"]
    full = train_and_read(tmp_path, "full", 2, common)
    resumed, _ = stop_and_resume(tmp_path, 2, common, full, save_at=10)
    assert [r["iteration"] for r in resumed] == list(range(11, 17))
    assert full[-1]["wire_bytes_core"] > 0 and resumed[-1]["wire_bytes_core"] == full[-1]["wire_bytes_core"]


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]])
def test_core_int8_with_tp_and_pp(stdlib_data, tmp_path, layout):
    metrics = tmp_path / "m.jsonl"
    probe = run_probe(tmp_path, 4, [*SMALL_MODEL, *GRPO_SMALL, *CORE8, *layout,
                                    "--data-path", stdlib_data, "--train-iters", "10",
                                    "--eval-iters", "0", "--eval-interval", "10",
                                    "--metrics-file", str(metrics)])
    # With TP, layernorms and row-parallel biases: the same bytes on both tensor-parallel ranks.
    assert_copies_agree(probe, "c", tp_replicated="--tensor-model-parallel-size" in layout)
    # Metrics are the counts of the rank holding the loss: last stage, TP rank 0, first replica.
    last = max(rank[0]["pp"] for rank in probe["ranks"])
    writer = next(rank for rank in probe["ranks"] if rank[0]["pp"] == last and rank[0]["tp"] == 0)
    for rec, m in zip(writer, read_metrics(metrics)):
        for tier in ("core", "dynamic", "stable"):
            assert m[f"wire_bytes_{tier}"] == rec["expected"][tier], (rec["iteration"], tier)
