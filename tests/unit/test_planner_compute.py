"""The planner's FLOP prediction for the sampled backward (megatron_grpo.planner.compute): the
count the runs report, from the shapes alone (tests/multiproc/test_sampled_backward.py checks
the exact step against a real run's count to the FLOP)."""

import pytest

from megatron_grpo.compute.flops import FlopCount, attention_flops
from megatron_grpo.planner.compute import exact_step_flops, linear_shapes, predict
from megatron_grpo.planner.plan import ModelSpec

MODEL = ModelSpec(num_layers=2, hidden=512, heads=8, vocab=258, seq_length=256, micro_batch_size=2)


def test_the_prediction_is_the_runs_count_for_the_same_rows():
    """Every layer below core at keep 0.4 (weight and data gradients): FlopCount fed the rows a
    run would keep gives the planner's numbers."""
    tokens, keep = 512, 0.4
    count = FlopCount()
    count.other = attention_flops(MODEL.num_layers, tokens, MODEL.seq_length, MODEL.hidden)
    kept = int(keep * tokens)
    for _, fan_in, fan_out in linear_shapes(MODEL):
        count.linear("dynamic", tokens, fan_in, fan_out, kept, kept)
    m = count.metrics()
    p = predict(MODEL, tokens, below_core_share=1.0, keep=kept / tokens, sample_dgrad=True)
    assert m["flops_exact_step"] == exact_step_flops(MODEL, tokens) == p["exact"]
    assert m["flops_step"] == pytest.approx(p["sampled"], rel=1e-12)


def test_core_costs_the_exact_step_and_the_forward_is_never_saved():
    assert predict(MODEL, 512, 0.0, 0.1, True)["ratio"] == 1.0
    floor = predict(MODEL, 512, 1.0, 0.0, True)  # nothing kept: forward and attention remain
    linear = sum(2 * i * o for _, i, o in linear_shapes(MODEL)) * 512
    assert floor["sampled"] == linear + attention_flops(2, 512, 256, 512)
    wgrad_only = predict(MODEL, 512, 0.85, 0.5, False)["ratio"]
    both = predict(MODEL, 512, 0.85, 0.5, True)["ratio"]
    assert both < wgrad_only < 1.0


def test_tensor_parallel_shapes_split_the_sliced_side():
    one, two = linear_shapes(MODEL), linear_shapes(MODEL, tp=2)
    assert [(i, o) for _, i, o in one][:4] == [(512, 1536), (512, 512), (512, 2048), (2048, 512)]
    assert [(i, o) for _, i, o in two][:4] == [(512, 768), (256, 512), (512, 1024), (1024, 512)]
    assert one[-1] == ("output_layer", 512, 384)
