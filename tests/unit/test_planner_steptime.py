"""The planner's step-time model (megatron_grpo/planner/steptime.py): modelled, not measured.

One small case against numbers worked out by hand; the link-aware decision on the presets
(NVLink stays exact, 100 Gb/s Ethernet compresses, the eager codec never pays on NVLink); a
slower link never makes GRPO's ratio worse; the closed-form break-even is where the rule flips."""

import os

import pytest

from harness import load_script

from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.planner.steptime import (CLUSTERS, EAGER, FUSED, GPU, Cluster, Codec, Link,
                                            StepTimeConfig, break_even_gbs, format_bytes, pays,
                                            predict, step_from_stages)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Round numbers for the hand computation: effective HBM 1e12 B/s, 1 ms per launch.
HAND_GPU = GPU(peak_flops=1e15, mfu=0.5, hbm_bytes_per_s=2e12, hbm_efficiency=0.5, launch_s=1e-3)
HAND_CFG = StepTimeConfig(gpu=HAND_GPU, grad_bytes=2, param_bytes=2, pays=0.9, contention=1.0)
HAND_FUSED = Codec("fused", 10.0, 2)
HAND_EAGER = Codec("eager", 175.0, 300)
N = 400_000_000  # elements of each bucket and unit
# 1525.87890625 MB of fp32 = exactly 4e8 elements
HAND_GRPO = GRPOConfig(core_share=0.25, dynamic_share=0.75, stable_share=0.0,
                       bucket_mb=N * 4 / 2 ** 20)
NET = Link("net", 4, 1, 10.0)  # 4 ranks, one per node, 10 GB/s


def _spec(name):
    from megatron_grpo.training.memory_budget import spec_from_flags

    model, cluster, grpo, bucket, _ = spec_from_flags(
        ["--config", os.path.join(REPO, "launch", "configs", name)], 16, 8, 80.0, 400.0)
    return model, cluster.tp, cluster.pp, grpo, bucket


@pytest.fixture(scope="module")
def gpt_8b():
    return _spec("gpt_8b.yaml")


@pytest.fixture(scope="module")
def gpt_70b():
    return _spec("gpt_70b.yaml")


def test_a_small_case_equals_the_hand_computation():
    """Two buckets of 4e8 elements on 4 ranks over a 10 GB/s link, compute 10 s, the last
    micro-batch's backward 1 s and forward 0.5 s.

    megatron, per bucket and phase: 3/4 x 4e8 x 2 B / 1e10 = 0.06 s. Reduce-scatter: bucket 0
    ready at 0.5 s, done 0.56; bucket 1 ready at 1.0, done 1.06: 0.06 s past the backward. The
    gather after the step: 0.12 s. 10 + 0.06 + 0.12 = 10.18 s. With --overlap-param-gather the
    forward needs bucket 1 at 0 (there at 0.06) and bucket 0 at 0.25 (there at 0.12): 0.06 s
    stall, 10.12 s.

    GRPO fused, per unit and phase: codec 4e8 x 10 / 1e12 + 2 x 1 ms = 0.006 s; int8 wire
    3/4 x 4e8 x (1 + 4/256) / 1e10 = 0.03046875, int4 0.01546875. Both pay (int8: 2 x 0.03046875
    + 0.012 = 0.0729375 <= 0.9 x 0.12). Expected over the shares: wire 0.25 x 0.03046875 + 0.75 x
    0.01546875 = 0.01921875, codec 0.006. Reduce-scatter: unit 0 at 0.5, its codec inside the
    backward (0.006 charged), done 0.52521875; unit 1 at 1.0, done 1.02521875: 0.02521875 late,
    + 0.006 = 0.03121875. Gather: 2 x 0.02521875 = 0.0504375. 10.08165625 s.
    The eager codec: 4e8 x 175 / 1e12 + 0.3 = 0.37 s a phase, never pays: exact, 10.18 s."""
    stages = [([N, N], [N, N])]
    r = step_from_stages(10.0, 1.0, 0.5, stages, [NET], HAND_GRPO, HAND_CFG,
                         codecs=(HAND_EAGER, HAND_FUSED))
    assert r.megatron_s == pytest.approx(10.18, rel=1e-12)
    assert r.megatron_opg_s == pytest.approx(10.12, rel=1e-12)
    assert r.grpo_s["fused"] == pytest.approx(10.08165625, rel=1e-12)
    assert r.decisions["fused"] == {"net": {"int4": True, "int8": True}}
    assert not r.fell_back.get("fused")
    assert r.grpo_s["eager"] == pytest.approx(10.18, rel=1e-12)
    assert r.decisions["eager"] == {"net": {"int4": False, "int8": False}}
    assert r.ratio("fused") == pytest.approx(10.08165625 / 10.18, rel=1e-12)


def test_the_break_even_is_where_the_rule_flips():
    """int4 on the hand link: 3/4 x 4e8 x (0.9 x 4 - 2 x 0.515625) / (2 x 0.006) B/s."""
    be = break_even_gbs(N, NET, "int4", HAND_FUSED, HAND_CFG)
    assert be == pytest.approx(64.21875, rel=1e-12)
    below, above = Link("net", 4, 1, be * (1 - 1e-9)), Link("net", 4, 1, be * (1 + 1e-9))
    assert pays(N, below, "int4", HAND_FUSED, HAND_CFG)
    assert not pays(N, above, "int4", HAND_FUSED, HAND_CFG)
    # Across formats, codecs, rank counts, wire dtypes, unit sizes and links.
    for grad_bytes in (2, 4):
        cfg = StepTimeConfig(grad_bytes=grad_bytes)
        for codec in (EAGER, FUSED):
            for fmt in ("int8", "int4", "int2"):
                for ranks, divisor, n in ((2, 1, 1 << 22), (8, 1, 1 << 25), (16, 4, 1 << 25)):
                    be = break_even_gbs(n, Link("x", ranks, divisor, 1.0), fmt, codec, cfg)
                    for gbs in (1, 5, 11.5, 48, 100, 200, 360, 450, 900):
                        assert pays(n, Link("x", ranks, divisor, gbs), fmt, codec, cfg) == (gbs <= be)


def test_the_break_even_reduces_to_the_per_phase_formula():
    """No launches and no margin: (k-1)/k x (1 - r) b0 B_hbm_eff / h, b0 = 2 bytes (bf16), r the
    format's bytes over b0: 240-360 GB/s for a fused codec against bf16."""
    cfg = StepTimeConfig(gpu=GPU(launch_s=0.0), pays=1.0)
    link = Link("x", 8, 1, 1.0)
    for fmt in ("int8", "int4"):
        r = format_bytes(fmt, 256) / 2
        expected = 7 / 8 * (1 - r) * 2 * 3.35e12 * 0.7 / 10 / 1e9
        assert break_even_gbs(1 << 25, link, fmt, FUSED, cfg) == pytest.approx(expected, rel=1e-12)
    assert 230 < 8 / 7 * break_even_gbs(1 << 25, link, "int8", FUSED, cfg) < 240
    assert 340 < 8 / 7 * break_even_gbs(1 << 25, link, "int4", FUSED, cfg) < 360


def test_nvlink_stays_exact_and_ethernet_compresses_with_the_fused_codec(gpt_8b, gpt_70b):
    model, tp, pp, grpo, bucket = gpt_8b
    for gbs in (360.0, 450.0):
        node = predict(model, tp, pp, grpo, Cluster("node", 1, nvlink_gbs=gbs), bucket_size=bucket)
        assert node.decisions["fused"] == {"NVLink": {"int4": False, "int8": False}}
        assert node.grpo_s["fused"] == pytest.approx(node.megatron_s, rel=1e-12)
    eth = predict(model, tp, pp, grpo, CLUSTERS[2], bucket_size=bucket)
    assert eth.decisions["fused"] == {"NVLink": {"int4": False, "int8": False},
                                      "Eth": {"int4": True, "int8": True}}
    assert not eth.fell_back.get("fused") and eth.ratio("fused") < 0.97
    model, tp, pp, grpo, bucket = gpt_70b
    eth = predict(model, tp, pp, grpo, CLUSTERS[2], bucket_size=bucket)
    assert eth.decisions["fused"] == {"Eth": {"int4": True, "int8": True}}
    assert eth.ratio("fused") < 1.0
    # The 70B layout (TP 8 x PP 4) does not fit one node: no prediction, a reason.
    assert "needs a multiple of 32" in predict(model, tp, pp, grpo, CLUSTERS[0]).note


def test_the_eager_codec_never_pays_on_nvlink(gpt_8b):
    for grad_bytes in (2, 4):
        cfg = StepTimeConfig(grad_bytes=grad_bytes)
        for ranks in range(2, 9):
            for n in (1 << 20, 1 << 23, 1 << 25, 1 << 27):
                for gbs in (200.0, 360.0, 450.0, 900.0):
                    for fmt in ("int8", "int4", "int2"):
                        assert not pays(n, Link("NVLink", ranks, 1, gbs), fmt, EAGER, cfg)
    model, tp, pp, grpo, bucket = gpt_8b
    node = predict(model, tp, pp, grpo, CLUSTERS[0], bucket_size=bucket)
    assert node.decisions["eager"] == {"NVLink": {"int4": False, "int8": False}}


@pytest.mark.parametrize("preset", ["gpt_8b", "gpt_70b"])
def test_a_slower_link_never_worsens_grpos_ratio(preset, gpt_8b, gpt_70b):
    """From 1 TB/s down to 1 GB/s between nodes, GRPO / megatron never rises, and never exceeds 1
    (the A/B keeps the exact path where compressing would not shorten the step)."""
    model, tp, pp, grpo, bucket = gpt_8b if preset == "gpt_8b" else gpt_70b
    for grad_bytes in (2, 4):
        cfg = StepTimeConfig(grad_bytes=grad_bytes)
        prev = {"eager": 1.0 + 1e-9, "fused": 1.0 + 1e-9}
        for gbs in (1000, 400, 200, 100, 48, 20, 11.5, 5, 1):
            r = predict(model, tp, pp, grpo, Cluster("x", 16, network="net", network_gbs=gbs), cfg,
                        bucket)
            for codec in prev:
                assert r.ratio(codec) <= prev[codec] + 1e-9, (codec, gbs)
                prev[codec] = r.ratio(codec)
        assert prev["fused"] < prev["eager"] < 1.0  # at 1 GB/s both compress, fused saves more


def test_the_rule_is_the_runtimes():
    link_decision = pytest.importorskip("megatron_grpo.comm.link_decision")
    assert StepTimeConfig().pays == link_decision.PAYS


def test_docs_carry_the_printed_table(capsys):
    """launch/plan.py --step-time prints the table docs/planner.md carries (both wire dtypes)."""
    cli = load_script("launch/plan.py", "plan_cli")
    with open(os.path.join(REPO, "docs", "planner.md")) as fh:
        docs = fh.read()
    for flags in ([], ["--step-time-grad-dtype", "fp32"]):
        assert cli.main(["--step-time", *flags]) == 0
        text = capsys.readouterr().out.strip()
        assert text.startswith("Modelled, not measured")
        assert text.count("| GPT ") == 9 and "break-even busbw" in text
        assert text in docs, f"docs/planner.md is stale: paste `python launch/plan.py --step-time {' '.join(flags)}`"
