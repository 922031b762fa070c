"""Predicted FLOPs per step with the sampled backward (--grpo-sampled-backward).

A linear layer's three GEMMs cost 2 x tokens x its weight elements each, so a tier's share of
the linear layers' FLOPs is its share of their weights. The prediction: every forward, the
core tier's weight and data gradients, the tiers below core's weight gradients at their keep
ratio and their data gradients at it too with --grpo-sample-dgrad below-core where no core
unit is below them in the backward, plus attention's two GEMMs, exact. The same count the runs
report (megatron_grpo.compute.flops), so ``exact_step_flops`` equals a run's
``flops_exact_step``, and ``predict_step`` a sampled step's count term by term (tier and part).

``predict`` is the share-based summary: it samples the data gradients of all the weights below
core, which holds only where core sits above them (the output layer's side); wherever core is
lower the run samples fewer and saves less. Measuring steps (every --grpo-sample-interval)
keep every row; ``predict`` is per sampled step, not per average step.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from megatron_grpo.compute.flops import FlopCount, attention_flops
from megatron_grpo.compute.sampler import draw_count
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


def predict_step(m: ModelSpec, tiers: Dict[str, str], keep: Dict[str, float], sample_dgrad: str,
                 micro_batches: int = 1, tp: int = 1) -> Dict[str, float]:
    """The counted FLOPs of one sampled step (not a measuring one) on one rank, by tier and part,
    as ``FlopCount.metrics`` reports them. ``tiers`` maps "embedding" and each name of
    ``linear_shapes`` to its unit's tier (the output layer of a tied model: the embedding's), with
    each layer's norms in its unit; ``keep`` each tier's keep ratio. Rows per call are a
    micro-batch's; each call keeps ceil(keep rows) (``sampler.draw_count``). A layer samples its
    data gradient where --grpo-sample-dgrad asks for its tier and no core unit came before it in
    the forward (megatron_grpo.compute.plan)."""
    count = FlopCount()
    rows = m.micro_batch_size * m.seq_length
    count.other = attention_flops(m.num_layers, rows * micro_batches, m.seq_length, m.hidden // tp)
    open_ = tiers["embedding"] != "core"
    for name, fan_in, fan_out in linear_shapes(m, tp):
        tier = tiers[name]
        ratio = 1.0 if tier == "core" else keep[tier]
        sampled = ratio < 1.0
        dgrad_asked = sample_dgrad == "below-core" or (sample_dgrad == "stable" and tier == "stable")
        wgrad_rows = draw_count(rows, ratio) if sampled else rows
        dgrad_rows = wgrad_rows if sampled and dgrad_asked and open_ else rows
        for _ in range(micro_batches):
            count.linear(tier, rows, fan_in, fan_out, wgrad_rows, dgrad_rows)
        open_ = open_ and tier != "core"
    return count.metrics()
