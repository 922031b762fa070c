"""Core stays exact under --grpo-sample-dgrad below-core, on a real megatron-core GPTModel.

A layer's data gradient is the input of the backward of everything below it in the forward, so
a sampled one there makes every gradient below noisy. The rule (megatron_grpo.compute.plan):
data gradients are sampled only above no core unit. One rank, a 3-layer GPT (untied output
layer), units made by hand: the embedding, each transformer layer, the final norm with the
output layer. The same batch runs exact (before tiering) and sampled (keep 0.3, weight and data
gradients); core's gradients must be the exact run's bit for bit.
"""

import functools

import pytest

from harness import megatron_rank, spawn_ranks


def _cases(rank):
    return {"cases": {name: _case(tiers) for name, tiers in CASES.items()}}


CASES = {
    # Layer 0 core: everything above it (layers 1, 2, the output layer) is dynamic, and none of
    # their data gradients may be sampled: each flows into layer 0's backward.
    "core_low": ["dynamic", "core", "dynamic", "dynamic", "dynamic"],
    # Layer 2 core: layers 0 and 1 have only dynamic units below them and sample their data
    # gradients (the embedding's gradient is then sampled); the output layer's must not.
    "core_high": ["dynamic", "dynamic", "dynamic", "core", "dynamic"],
}
UNITS = ["embedding", "decoder.layers.0.", "decoder.layers.1.", "decoder.layers.2.", "output"]


def _unit_of(name):
    for i, prefix in enumerate(UNITS):
        if name.startswith(prefix):
            return i
    return len(UNITS) - 1  # decoder.final_layernorm goes with the output layer


def _case(tiers):
    from types import SimpleNamespace

    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.compute.flops import attention_flops
    from megatron_grpo.compute.plan import SampledBackward
    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.megatron import sampled_linear

    torch.manual_seed(3)
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16, share_embeddings_and_output_weights=False)
    named = dict(model.named_parameters())
    units = [SimpleNamespace(index=i, params=[p for n, p in named.items() if _unit_of(n) == i])
             for i in range(len(UNITS))]
    cfg = GRPOConfig(enabled=True, sampled_backward=True, sample_dgrad="below-core",
                     sample_min_keep=0.3, sample_max_keep=0.3)
    plan = SampledBackward(cfg, len(UNITS), slice(0, len(UNITS)), seed=11, dp_rank=0)
    plan.wanted = [0.3] * len(UNITS)
    plan.flops.other = attention_flops(3, 4 * 16, 16, 32)
    wrapped = sampled_linear.install([SimpleNamespace(module=model)], units, plan)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (4, 16), generator=g)
    positions = torch.arange(16).unsqueeze(0).expand(4, 16)
    upstream = torch.randn(4, 16, 64, generator=g)

    def grads(iteration, tiered):
        plan.begin_step(iteration, tiers, tiered)
        model.zero_grad(set_to_none=True)
        (model(tokens, positions, None) * upstream).sum().backward()
        return {n: p.grad.clone() for n, p in named.items()}

    exact = grads(1, tiered=False)  # also the first forward: the order is recorded here
    sampled = grads(2, tiered=True)
    same = {n: bool(torch.equal(exact[n], sampled[n])) for n in named}
    return {"wrapped": wrapped, "order": list(plan.forward_order),
            "unit": {n: _unit_of(n) for n in named}, "same": same, "flops": plan.flops.metrics()}


@pytest.fixture(scope="module")
def out():
    [result] = spawn_ranks(functools.partial(megatron_rank, body=_cases, world_size=1, seed=3), 1,
                           timeout=180)
    assert "error" not in result, result.get("error")
    return result


def test_core_gradients_are_bit_identical_with_sampled_data_gradients(out):
    for name, tiers in CASES.items():
        case = out["cases"][name]
        assert case["wrapped"] == 3 * 4 + 1  # qkv, proj, fc1, fc2 per layer and the output layer
        assert case["order"][0] == 0 and case["order"][-1] == len(UNITS) - 1  # embedding .. output
        core = [n for n, u in case["unit"].items() if tiers[u] == "core"]
        assert core and all(case["same"][n] for n in core), \
            (name, [n for n in core if not case["same"][n]])
        # Sampling did run: a dynamic unit's weight gradient differs from the exact one.
        assert not case["same"]["output_layer.weight"], name
    # Where nothing core is below, data gradients are still sampled (the rule is not "never"):
    # with layers 0 and 1 above only dynamic units, the embedding's gradient is sampled.
    assert not out["cases"]["core_high"]["same"]["embedding.word_embeddings.weight"]


def test_the_planner_predicts_the_counted_flops_term_by_term(out):
    """The sampled step of each case, counted by the run's layers (FlopCount), against the
    planner's prediction from the shapes and the tier map alone: every tier and part equal, data
    gradients sampled only above no core (in "core_low" none, in "core_high" layers 0 and 1)."""
    from megatron_grpo.planner.compute import predict_step
    from megatron_grpo.planner.plan import ModelSpec

    spec = ModelSpec(num_layers=3, hidden=32, heads=4, vocab=64, seq_length=16, micro_batch_size=4,
                     make_vocab_size_divisible_by=64)
    for name, tiers in CASES.items():
        by_layer = {"embedding": tiers[0], "output_layer": tiers[4]}
        for i in range(3):
            for part in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
                by_layer[f"layers.{i}.{part}"] = tiers[i + 1]
        predicted = predict_step(spec, by_layer, {"dynamic": 0.3, "stable": 0.3}, "below-core")
        assert predicted == out["cases"][name]["flops"], name
    counted = {n: out["cases"][n]["flops"] for n in CASES}
    # No data gradient below core_low's layer 0 is sampled; in core_high two layers' are.
    assert counted["core_low"]["flops_dynamic_dgrad"] == counted["core_low"]["flops_dynamic_fwd"]
    assert counted["core_high"]["flops_dynamic_dgrad"] < counted["core_high"]["flops_dynamic_fwd"]
