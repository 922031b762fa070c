"""Predicted FLOPs per step with the sampled backward (--grpo-sampled-backward).

A linear layer's three GEMMs cost 2 x tokens x its weight elements each, so a tier's share of
the linear layers' FLOPs is its share of their weights. The prediction: every forward, the
core tier's weight and data gradients, the tiers below core's weight gradients at their keep
ratio and their data gradients at it too with --grpo-sample-dgrad below-core (the zero rows
that sampled data gradients pass to the layers below are not counted: a lower bound on the
saving), plus attention's two GEMMs, exact. The same count the runs report
(megatron_grpo.compute.flops), so ``exact_step_flops`` equals a run's ``flops_exact_step``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from megatron_grpo.compute.flops import attention_flops
from megatron_grpo.planner.plan import ModelSpec


def linear_shapes(m: ModelSpec, tp: int = 1) -> List[Tuple[str, int, int]]:
    """(name, fan-in, fan-out) of every linear layer on one tensor-parallel rank, as
    megatron-core's local GPT spec builds them (no pipeline split)."""
    head = m.hidden // m.heads
    qkv = (m.hidden + 2 * m.groups * head) // tp
    fc1 = (2 if m.swiglu else 1) * m.ffn // tp
    out = []
    for i in range(m.num_layers):
        out += [(f"layers.{i}.linear_qkv", m.hidden, qkv), (f"layers.{i}.linear_proj", m.hidden // tp, m.hidden),
                (f"layers.{i}.linear_fc1", m.hidden, fc1), (f"layers.{i}.linear_fc2", m.ffn // tp, m.hidden)]
    out.append(("output_layer", m.hidden, m.padded_vocab(tp) // tp))
    return out


def exact_step_flops(m: ModelSpec, tokens: int, tp: int = 1) -> int:
    """FLOPs of one exact step on one rank over ``tokens`` token rows (all its micro-batches)."""
    linear = sum(2 * fi * fo for _, fi, fo in linear_shapes(m, tp)) * tokens
    return 3 * linear + attention_flops(m.num_layers, tokens, m.seq_length, m.hidden // tp)


def predict(m: ModelSpec, tokens: int, below_core_share: float, keep: float,
            sample_dgrad: bool, tp: int = 1) -> Dict[str, float]:
    """Predicted FLOPs of a sampled step: ``below_core_share`` of the linear weights in tiers
    below core at keep ratio ``keep``. Returns exact, sampled and their ratio."""
    linear = sum(2 * fi * fo for _, fi, fo in linear_shapes(m, tp)) * tokens
    other = attention_flops(m.num_layers, tokens, m.seq_length, m.hidden // tp)
    below, core = below_core_share * linear, (1 - below_core_share) * linear
    sampled = linear + core * 2 + below * keep + below * (keep if sample_dgrad else 1.0) + other
    exact = 3 * linear + other
    return {"exact": float(exact), "sampled": float(sampled), "ratio": sampled / exact}
