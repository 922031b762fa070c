"""megatron-core's own peers, by hand: the bf16 reduce-scatter's bytes (comm/analytic.py) and
the memory options beside GRPO's largest model (planner/peers.py, launch/plan.py
--largest-model). Pure arithmetic: no process group, no model built."""

import dataclasses
import os

import pytest

from harness import load_script

from megatron_grpo.comm.analytic import baseline_step_bytes, fp32_accumulation_step_bytes
from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.planner.capacity import rank_peak_bytes
from megatron_grpo.planner.peers import (cpu_offload_memory, fsdp_memory, fsdp_step_bytes,
                                         peer_memory)
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec, plan, stage_activation_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tests/unit/test_planner.py's SMALL (tests/harness.py SMALL_MODEL), bf16, on 2 ranks.
SMALL = ModelSpec(num_layers=2, hidden=96, heads=4, vocab=258, seq_length=64, micro_batch_size=2)
TWO_RANKS = ClusterSpec(nodes=1, gpus_per_node=2)
GRPO = GRPOConfig(enabled=True, bucket_mb=0.04)
# SMALL's parameters on one rank, by hand: a layer is two LayerNorms (4 x 96), linear_proj
# 96 x 96 + 96, linear_qkv 288 x 96 + 288, fc1 384 x 96 + 384, fc2 96 x 384 + 96; outside the
# layers the word embedding and output layer (vocabulary 258 padded to 384, x 96 each), the
# position table 64 x 96 and the final LayerNorm.
LAYER = 4 * 96 + (96 * 96 + 96) + (288 * 96 + 288) + (384 * 96 + 384) + (96 * 384 + 96)
OUTSIDE = 2 * 384 * 96 + 64 * 96 + 2 * 96
WHOLE = OUTSIDE + 2 * LAYER


def test_megatrons_bf16_reduce_scatter_sends_half_the_fp32_gradient_bytes():
    # An all-to-all of each bucket in bf16: a rank keeps its own 1/dp and sends the rest.
    assert fp32_accumulation_step_bytes([256, 384], dp=4) == (3 * 64 * 2 + 3 * 96 * 2,) * 2
    assert fp32_accumulation_step_bytes([256, 384], dp=4, param_bytes=4) == (960, 1920)
    fp32_grads, _ = baseline_step_bytes([256, 384], 4, grad_bytes=4, param_bytes=2)
    assert fp32_grads == 2 * 960
    assert fp32_accumulation_step_bytes([256], dp=1) == (0, 0)


def test_cpu_offload_keeps_the_baselines_buffers_and_activations_on_the_device():
    assert (LAYER, OUTSIDE, WHOLE) == (111840, 80064, 303744)
    m = cpu_offload_memory(SMALL, TWO_RANKS, GRPO, 0, bucket_size=20000)
    padded = 304384  # the baseline's buckets (tests/unit/test_planner.py)
    assert (m.params, m.grads) == (2 * padded, 4 * padded)
    assert m.master_params == m.optimizer_moments == m.gathered == 0
    assert m.activations == stage_activation_bytes(SMALL, TWO_RANKS, 0) == 1437824
    assert m.host == (4 + 8) * WHOLE // 2  # masters and moments of this rank's half
    assert m.total == 6 * padded + 1437824
    base = plan(SMALL, TWO_RANKS, GRPO, bucket_size=20000).baseline_memory
    assert m.total == base.total - base.master_params - base.optimizer_moments


def test_fsdp_shards_every_state_and_holds_what_is_gathered():
    m = fsdp_memory(SMALL, TWO_RANKS, 0)
    shard = WHOLE // 2
    assert (m.params, m.grads, m.master_params, m.optimizer_moments) == \
        (2 * shard, 4 * shard, 4 * shard, 8 * shard) == (303744, 607488, 607488, 1214976)
    # Non-unit parameters whole, the layer computing and the one prefetched; the fp32
    # gradients of the non-unit parameters and of one layer.
    assert m.gathered == 2 * (OUTSIDE + 2 * LAYER) + 4 * (OUTSIDE + LAYER) == 1375104
    assert m.total == 303744 + 607488 + 607488 + 1214976 + 1375104 + 1437824
    fp32 = fsdp_memory(dataclasses.replace(SMALL, bf16=False), TWO_RANKS, 0)
    assert fp32.master_params == 0 and fp32.params == 4 * shard
    # Each micro-batch: parameters gathered twice (bf16) and fp32 gradients reduce-scattered.
    assert fsdp_step_bytes(SMALL, TWO_RANKS) == 1 * shard * (2 + 2 + 4) == 1214976
    four = dataclasses.replace(SMALL, global_batch_size=8)  # 8 / (2 x 2): 2 micro-batches
    assert fsdp_step_bytes(four, TWO_RANKS) == 2 * 1214976


def test_peers_size_their_busiest_stage_and_the_search_reads_them():
    m = dataclasses.replace(SMALL, num_layers=4)
    pp = ClusterSpec(nodes=1, gpus_per_node=4, pp=2)
    for which, one in (("megatron-fsdp", lambda st: fsdp_memory(m, pp, st)),
                       ("megatron-cpu-offload", lambda st: cpu_offload_memory(m, pp, GRPO, st))):
        stages = [one(0), one(1)]
        busiest = peer_memory(m, pp, GRPO, which)
        assert busiest == max(stages, key=lambda x: x.total) and busiest.stage == 0  # 2 in flight
        assert rank_peak_bytes(m, pp, GRPO, which, reserve_bytes=7) == busiest.total + 7
    with pytest.raises(ValueError, match="which must be one of megatron-cpu-offload, megatron-fsdp"):
        peer_memory(m, pp, GRPO, "zero-3")


def test_largest_model_on_gpt_8b_fsdp_then_cpu_offload_then_grpo_then_the_baseline(capsys):
    """launch/plan.py --largest-model, gpt_8b on one node of 8 x 80 GB (TP 2 x DP 4), GRPO with
    its memory tier: docs/results.md, "Largest model per GPU"."""
    cli = load_script("launch/plan.py", "plan_cli")
    assert cli.main(["--config", os.path.join(REPO, "launch", "configs", "gpt_8b.yaml"), "--nodes",
                     "1", "--largest-model", "--grpo", "--grpo-offload", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "  baseline     50 layers    11.956 B parameters" in out
    assert "  grpo         60 layers    14.137 B parameters" in out
    assert "  optimizer_cpu_offload    65 layers    15.228 B parameters" in out
    assert "  Megatron-FSDP            73 layers    16.973 B parameters" in out
    assert "1.27x the baseline" in out and "1.42x the baseline" in out
    assert "predicted (formulas: megatron_grpo/planner/peers.py; not checked against a run)" in out


def test_the_plan_states_grpos_bytes_against_megatrons_bf16_reduce_scatter_too():
    from megatron_grpo.planner.format import format_plan

    p = plan(SMALL, TWO_RANKS, GRPO, bucket_size=20000)
    # 304,384 padded elements; dp 2: half of them leave, 2 bytes each, gradients and parameters.
    assert sum(fp32_accumulation_step_bytes(p.baseline_buckets, 2)) == 2 * 304384 // 2 * 2
    assert (f"  megatron with bf16 gradients (reduce_scatter_with_fp32_accumulation, analytic): "
            f"0.61; GRPO ratio against it {p.grpo_bytes / 608768:.3f}") in format_plan(p)
    fp32 = plan(dataclasses.replace(SMALL, bf16=False), TWO_RANKS, GRPO, bucket_size=20000)
    assert "reduce_scatter_with_fp32_accumulation" not in format_plan(fp32)  # it needs bf16
