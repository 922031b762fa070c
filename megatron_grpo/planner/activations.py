"""Activation memory of megatron-core's GPTModel for the planner (megatron_grpo.planner.plan).

GPT-2-style layers follow Korthikanti et al. 2022, eq. 2, generalised to e-byte activations,
f != 4h, flash attention and megatron's fp32 softmax. The Llama-style terms were measured on
megatron's local spec (CPU, torch ops) with tests/multiproc/planner_probe.py, one option at a
time, storage by storage (what autograd saves for backward, 2026-12-01):

* RMSNorm (torch's, unfused) saves its input upcast to fp32, the fp32 normalised input and an
  fp32 rstd per row: 8 sbh + 4 sb per norm, where LayerNorm saves its e-byte input and two
  stats. Transformer-engine's fused norm is assumed to save input + rstd (not measured: no GPU).
* SwiGLU keeps fc1's 2f-wide output, SiLU's output, the gate product's other factor and the
  product (fc2's input): 5 sbf e bytes, against GeLU's 2 sbf e.
* Grouped-query attention on the local spec copies Q and expands K and V to every head before
  the batched matmuls, so Q, K, V keep 3 sbh e bytes whatever the group count; with flash
  attention they are kept unexpanded, sb (h + 2 g d) e (not measured).
* RoPE keeps cos and sin for q and k (4 s d e per layer; the products do not keep their
  inputs, since cos/sin need no gradient) and, with MHA on the local spec, the rotated q and k
  as new storages (2 sbh e); with GQA the copies above already are the rotated tensors. No
  position ids are kept by the embedding.
* No linear biases changes nothing kept.

Activation recompute (measured the same way; what a forward keeps, exactly):

* full, uniform N: each chunk of N layers keeps only its input (s b h e), and with RoPE the
  fp32 rotary table (4 s d) once; block N: the first N layers of the stage keep only their
  input, the others everything.
* selective: the core attention is recomputed, so the softmax output, the probabilities and
  the attention-dropout tensors are not kept (4 bytes of int32 scalars per layer are).
* Backward then recomputes one chunk (full: N layers' worth; selective: one layer's scores)
  for one micro-batch at a time: added once to the peak (from the formulas, not measured).
"""

from __future__ import annotations


def _norm_bytes(model, sbh: int, sb: int) -> int:
    """What one norm keeps: its input and its statistics."""
    e = model.param_bytes
    if not model.rmsnorm:
        return sbh * e + 8 * sb  # e-byte input; fp32 mean and rstd
    if model.flash_attention:  # transformer-engine's fused RMSNorm (assumed, not measured)
        return sbh * e + 4 * sb
    return 8 * sbh + 4 * sb


def _scores_bytes(model, tp: int) -> int:
    """What a layer's core attention keeps beside Q, K and V (the part selective recompute
    drops)."""
    s, b, a, e = model.seq_length, model.micro_batch_size, model.heads, model.param_bytes
    scores = a * s * s * b // tp
    if model.flash_attention:
        return 4 * a * s * b // tp  # fp32 log-sum-exp per row, kept instead of the scores
    # Softmax output (fp32 under softmax_in_fp32) is kept for the softmax backward; the bf16
    # probabilities cast from it are kept again by the probabilities x V matmul.
    total = scores * (4 + e if model.bf16 and model.softmax_in_fp32 else e)
    if model.dropout:
        total += scores * (1 + e)  # attention-dropout mask and its output (bmm input)
    return total


def layer_activation_bytes(model, tp: int) -> int:
    """Bytes one transformer layer keeps for backward, per micro-batch (no recompute)."""
    return sum(layer_activation_parts(model, tp).values())


def layer_activation_parts(model, tp: int) -> dict:
    """``layer_activation_bytes`` by the backward step that frees them: "fc2" (linear_fc2's
    input, the MLP's dropout mask), "act" (the activation's other inputs), "fc1" (linear_fc1's
    input), "ln2" (pre-MLP norm), "proj" (linear_proj's input, the attention's dropout mask),
    "attention" (Q, K, V, the scores, rotary tables, linear_qkv's input) and "ln1" (input
    norm)."""
    s, b, h, a, f = model.seq_length, model.micro_batch_size, model.hidden, model.heads, model.ffn
    e = model.param_bytes
    d, g = h // a, model.groups
    sbh, sbf, sb = s * b * h, s * b * f, s * b
    sp = _sp(model, tp)
    # Replicated over TP unless sequence-parallel: both norms (input and stats) and their
    # outputs (QKV's and fc1's input; megatron keeps the sequence shard and gathers it again).
    norm = _norm_bytes(model, sbh, sb) // sp
    attention = sbh * e // sp
    # Split over TP: Q, K, V and the attention context (linear_proj's input).
    qkv = sb * (h + 2 * g * d) if model.flash_attention else 3 * sbh
    if model.rope:
        if model.flash_attention:
            qkv += sb * (h + g * d)  # rotated q and k (assumed, not measured)
        elif g == a:
            qkv += 2 * sbh  # rotated q and k: new storages beside the fused QKV output
        attention += 4 * s * d * e  # cos and sin, for q and for k
    attention += (qkv + sbh) * e // tp + _scores_bytes(model, tp)
    # Split over TP: the MLP (GeLU: its input and fc2's input; SwiGLU: see the module notes).
    fc2 = sbf * e // tp
    act = (5 if model.swiglu else 2) * sbf * e // tp - fc2
    context = sbh * e // tp
    attention -= context
    if model.dropout:  # one-byte masks of the two hidden dropouts, freed by bias-dropout-add
        fc2, context = fc2 + sbh // sp, context + sbh // sp
    return {"fc2": fc2, "act": act, "fc1": sbh * e // sp, "ln2": norm, "proj": context,
            "attention": attention, "ln1": norm}


def _sp(model, tp: int) -> int:
    """What sequence parallelism divides the TP-replicated activations by (1 without it)."""
    return tp if model.sequence_parallel and tp > 1 else 1


def _stage_parts(model, cluster, stage: int):
    """(kept per micro-batch, recompute's working set, per-step constant) of ``stage``."""
    s, b, h = model.seq_length, model.micro_batch_size, model.hidden
    tp, pp = cluster.tp, cluster.pp
    per_mb, working = _layers_kept(model, model.num_layers // pp, tp)
    sp = _sp(model, tp)
    if stage == 0:
        per_mb += (1 if model.rope else 2) * 8 * s * b  # token (and position) ids, int64
        if model.dropout:
            per_mb += s * b * h // sp  # embedding dropout mask
    if stage == pp - 1:
        e = model.param_bytes
        # Final norm (input, stats) and its output (the output layer's input), and the
        # cross-entropy's fp32 softmax of the logits over this TP rank's vocabulary slice.
        per_mb += (_norm_bytes(model, s * b * h, s * b) + s * b * h * e) // sp
        per_mb += 4 * s * b * model.padded_vocab(tp) // tp
        per_mb += 9 * s * b  # labels-side target mask (bool) and int64 target ids
    constant = 0 if model.flash_attention else s * s  # the bool causal mask, one per step
    return per_mb, working, constant


def stage_activation_bytes(model, cluster, stage: int) -> int:
    """Activations held on one GPU of ``stage`` at the peak of a 1F1B step: pp - stage
    micro-batches in flight (assumes at least pp micro-batches per step; 1 without pipelining),
    plus what backward's recompute rebuilds for one of them."""
    per_mb, working, constant = _stage_parts(model, cluster, stage)
    return (cluster.pp - stage) * per_mb + working + constant


def backward_freed_bytes(model, cluster, stage: int) -> dict:
    """What the backward of one micro-batch on ``stage`` frees, by part (the planner's
    gradient-release timeline, megatron_grpo/planner/grads.py): "head" (last stage: the final
    norm, the output layer's input, the logits' fp32 softmax, the labels), one layer's parts
    (``layer_activation_parts``; with recompute its kept bytes, the stage's average, as "ln1")
    and "embedding" (first stage: the ids)."""
    s, b, h, e = model.seq_length, model.micro_batch_size, model.hidden, model.param_bytes
    layers = model.num_layers // cluster.pp
    kept, _ = _layers_kept(model, layers, cluster.tp)
    # Without recompute a layer's tensors go part by part; with it a layer keeps its input.
    parts = (layer_activation_parts(model, cluster.tp) if model.recompute_granularity is None
             else {"ln1": kept / layers if layers else 0})
    head = embedding = 0
    if stage == 0:
        embedding = (1 if model.rope else 2) * 8 * s * b + (s * b * h if model.dropout else 0)
    sp = _sp(model, cluster.tp)
    if stage == 0 and model.dropout:
        embedding -= s * b * h - s * b * h // sp
    if stage == cluster.pp - 1:
        head = ((_norm_bytes(model, s * b * h, s * b) + s * b * h * e) // sp
                + 4 * s * b * model.padded_vocab(cluster.tp) // cluster.tp + 9 * s * b)
    return {"head": head, "embedding": embedding, **parts}


def last_backward_activation_bytes(model, cluster, stage: int) -> int:
    """Activations held on ``stage`` when a step's last backward begins: one micro-batch's
    (1F1B's cool-down has finished the others) and recompute's working set; the gradient syncs
    all happen in this backward."""
    per_mb, working, constant = _stage_parts(model, cluster, stage)
    return per_mb + working + constant


def stage_kept_bytes(model, cluster, stage: int) -> int:
    """What one forward of one micro-batch keeps on ``stage``: the measurable part (no other
    micro-batch in flight, no recompute working set)."""
    per_mb, _, constant = _stage_parts(model, cluster, stage)
    return per_mb + constant


def _layers_kept(model, layers: int, tp: int):
    """(bytes the stage's layers keep per micro-batch, bytes backward's recompute adds once)."""
    full = layer_activation_bytes(model, tp)
    how, n = model.recompute_granularity, model.recompute_num_layers or 0
    if how is None:
        return layers * full, 0
    if how == "selective":
        scores = _scores_bytes(model, tp)
        return layers * (full - scores + 4), scores
    s, b, h, e = model.seq_length, model.micro_batch_size, model.hidden, model.param_bytes
    rope_table = 4 * s * (h // model.heads) if model.rope else 0
    chunk_input = s * b * h * e // _sp(model, tp)  # what a recomputed chunk keeps
    if model.recompute_method == "uniform":
        chunks = -(-layers // n)
        return chunks * chunk_input + rope_table, min(n, layers) * full
    recomputed = min(n, layers)  # block
    kept = recomputed * chunk_input + (layers - recomputed) * full + (rope_table if recomputed else 0)
    return kept, full if recomputed else 0
