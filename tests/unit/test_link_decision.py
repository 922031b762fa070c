"""--grpo-compress (megatron_grpo.comm.link_decision): the rule per mode, the threshold, the
start-up line and metrics, and the step-time A/B that can overturn a decision to compress
(tested on a case where compressing is slower: the A/B must say so)."""

import pytest

from megatron_grpo.comm.link_decision import PAYS, LinkDecision, ProbeResult, StepTimeAB
from megatron_grpo.grpo.config import GRPOConfig, GRPOConfigError


def _probe(exact=1.0, int4=0.5, int8=0.95):
    p = ProbeResult(numel=1 << 20, exact_s=exact, exact_bytes=8 << 20)
    p.compressed_s = {"int4": int4, "int8": int8}
    p.codec_s = {"int4": 0.2, "int8": 0.25}
    return p


def test_auto_compresses_a_format_only_where_it_takes_at_most_pays_of_the_exact_time():
    d = LinkDecision("auto", "data-parallel group", spans_nodes=False)
    d.decide(["int4", "int8"], _probe(int4=PAYS * 1.0, int8=PAYS * 1.0 + 1e-9))
    assert d.compress == {"int4": True, "int8": False}
    assert d.compresses("int4") and not d.compresses("int8") and d.any_compressed()
    # No probe (one rank, nothing to send): nothing is compressed.
    none = LinkDecision("auto", "data-parallel group", False)
    none.decide(["int4"], None)
    assert none.compress == {"int4": False}


@pytest.mark.parametrize("mode, spans, expect", [
    ("all", False, True), ("all", True, True), ("none", True, False), ("none", False, False),
    ("inter-node", True, True), ("inter-node", False, False)])
def test_the_fixed_modes_ignore_the_measurement(mode, spans, expect):
    d = LinkDecision(mode, "data-parallel group", spans)
    d.decide(["int4", "int8"], _probe(int4=10.0, int8=0.01))  # the probe would say otherwise
    assert d.compress == {"int4": expect, "int8": expect}
    assert d.confirmed  # nothing for an A/B to confirm


def test_the_start_line_and_metrics_name_the_rates_and_the_verdict():
    d = LinkDecision("auto", "data-parallel group", False)
    d.decide(["int4", "int8"], _probe())
    line = d.line()
    assert line.startswith("data-parallel group (intra-node): int4 [--grpo-compress auto]: link 0.00839 GB/s")
    assert "int4 codec 0.021 GB/s (compressed 0.50x the exact time)" in line
    assert "int8 codec 0.0168 GB/s (compressed 0.95x the exact time)" in line
    m = d.metrics()
    assert m["grpo_compress_int4"] == 1.0 and m["grpo_compress_int8"] == 0.0
    assert m["grpo_probe_int4_vs_exact"] == 0.5 and m["grpo_link_gbps"] == pytest.approx(0.0083886, rel=1e-4)


def test_the_ab_overturns_a_decision_to_compress_that_makes_steps_slower():
    """The probe said int4 pays; the step times say otherwise (codec work exposed in the step):
    the A/B's second half runs exact, and its median wins."""
    ab = StepTimeAB(steps=3)
    ab.start = 10
    assert [ab.phase(k) for k in (9, 10, 12, 13, 15, 16)] == [None, "compressed", "compressed", "exact", "exact", None]
    for k, t in zip(range(10, 16), [1.3, 1.2, 1.25, 1.0, 1.05, 0.98]):
        assert ab.verdict("cpu") is None  # not before both halves are in
        ab.record(k, t)
    assert ab.verdict("cpu") is False and ab.medians == [1.25, 1.0]
    assert ab.verdict("cpu") is None  # decided once
    d = LinkDecision("auto", "data-parallel group", False)
    d.decide(["int4"], _probe())
    d.fall_back()
    assert d.compress == {"int4": False} and d.confirmed


def test_the_ab_keeps_compression_that_makes_steps_faster():
    ab = StepTimeAB(steps=2)
    ab.start = 1
    for k, t in zip(range(1, 5), [0.5, 0.6, 1.0, 1.1]):
        ab.record(k, t)
    assert ab.verdict("cpu") is True


def test_the_flag_is_validated():
    with pytest.raises(GRPOConfigError, match="--grpo-compress must be one of auto, all, inter-node, none"):
        GRPOConfig(compress="sometimes").validate()
    with pytest.raises(GRPOConfigError, match="--grpo-compress-ab-steps must be an integer >= 0"):
        GRPOConfig(compress_ab_steps=-1).validate()
    assert GRPOConfig().compress == "auto"
