"""How megatron-core's GPTModel tensors map onto Hugging Face GPT-2 and Llama, both ways.

The traps (each one gives a model that loads and computes wrong logits):

* QKV: megatron keeps one ``linear_qkv`` whose rows are grouped per key/value group,
  ``[q heads of group 0, k 0, v 0, q heads of group 1, k 1, v 1, ...]`` (the global tensor,
  whatever the TP size); HF wants all q rows, then all k, then all v (GPT-2: one c_attn,
  Llama: q_proj / k_proj / v_proj). Under GQA a plain three-way split is wrong.
* SwiGLU: ``linear_fc1`` is [gate; up] (megatron applies silu to the first half).
* RoPE: megatron's default (``rotary_interleaved=False``) rotates halves like HF Llama, so q/k
  rows are NOT permuted (a checkpoint from Meta's interleaved layout would need it).
* The vocabulary is padded to a multiple of 128 x TP in megatron; HF gets the tokenizer's rows.
* GPT-2's Conv1D stores weights [in, out]: transposed against megatron's Linear [out, in].
* Norms: megatron's local and transformer-engine specs store the pre-attention / pre-MLP norm
  as ``linear_qkv.layer_norm_*`` / ``linear_fc1.layer_norm_*`` (checkpoint keys are the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

L = "decoder.layers."
QKV, PROJ = L + "self_attention.linear_qkv.", L + "self_attention.linear_proj."
FC1, FC2 = L + "mlp.linear_fc1.", L + "mlp.linear_fc2."
EMB, POS = "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"
FINAL, OUT = "decoder.final_layernorm.", "output_layer.weight"
LAYERNORM_EPS = 1e-5  # megatron TransformerConfig.layernorm_epsilon (training/model.py keeps it)


class ConversionError(ValueError):
    """The model cannot be converted as asked; the message says which setting and what to do."""


@dataclass
class Shape:
    """The model settings a conversion needs, from a checkpoint's model record or an HF config."""

    family: str
    """gpt2 (LayerNorm, learned positions, GeLU, biases) or llama (RMSNorm, RoPE, SwiGLU)."""
    num_layers: int
    hidden: int
    heads: int
    groups: int
    """key/value groups (= heads without GQA)."""
    ffn: int
    vocab: int
    """the tokenizer's vocabulary (rows HF gets)."""
    padded_vocab: int
    """megatron's embedding rows."""
    bias: bool
    tied: bool
    max_positions: int
    rotary_base: int
    eod: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def shape_from_record(record: Dict) -> Shape:
    """The Shape of a checkpoint written by the training entry (its manifest's model record)."""
    c = record["config"]
    norm, pos, swiglu = c["normalization"], c["position_embedding_type"], c["swiglu"]
    bias = not c["disable_bias_linear"]
    if norm == "LayerNorm" and pos == "learned_absolute" and not swiglu:
        family = "gpt2"
    elif norm == "RMSNorm" and pos == "rope" and swiglu:
        family = "llama"
    else:
        raise ConversionError(
            f"--normalization {norm} --position-embedding-type {pos} swiglu={swiglu}: HF has no "
            f"model class for this mix; convertible are GPT-2-style (LayerNorm, learned_absolute, "
            f"GeLU) and Llama-style (RMSNorm, rope, --swiglu) models")
    heads = c["num_attention_heads"]
    groups = c.get("num_query_groups") or heads
    if family == "gpt2" and (groups != heads or not bias):
        raise ConversionError(
            f"GPT-2-style model with num_query_groups={groups} (heads {heads}) and biases="
            f"{bias}: HF GPT-2 has neither GQA nor bias-free linears; use the Llama-style layers")
    tok = record["tokenizer"]
    return Shape(family=family, num_layers=c["num_layers"], hidden=c["hidden_size"], heads=heads,
                 groups=groups, ffn=c.get("ffn_hidden_size") or 4 * c["hidden_size"],
                 vocab=int(tok["vocab_size"]), padded_vocab=int(record["padded_vocab_size"]),
                 bias=bias, tied=not c.get("untie_embeddings_and_output_weights", True),
                 max_positions=c.get("max_position_embeddings") or c["seq_length"],
                 rotary_base=int(c.get("rotary_base", 10000)), eod=int(tok["eod"]))


def hf_config(shape: Shape):
    """The transformers config of ``shape`` (GPT2Config or LlamaConfig), dropout off."""
    common = dict(vocab_size=shape.vocab, tie_word_embeddings=shape.tied,
                  bos_token_id=shape.eod, eos_token_id=shape.eod)
    if shape.family == "gpt2":
        from transformers import GPT2Config

        # activation "gelu" is the exact erf GeLU megatron uses (GPT-2's own is the tanh one)
        return GPT2Config(n_positions=shape.max_positions, n_embd=shape.hidden, n_layer=shape.num_layers,
                          n_head=shape.heads, n_inner=shape.ffn, activation_function="gelu",
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          layer_norm_epsilon=LAYERNORM_EPS, architectures=["GPT2LMHeadModel"], **common)
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn,
                       num_hidden_layers=shape.num_layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.groups, head_dim=shape.head_dim, hidden_act="silu",
                       max_position_embeddings=shape.max_positions, rms_norm_eps=LAYERNORM_EPS,
                       rope_parameters={"rope_type": "default", "rope_theta": float(shape.rotary_base)},
                       attention_bias=shape.bias, mlp_bias=shape.bias, attention_dropout=0.0,
                       architectures=["LlamaForCausalLM"], **common)


def shape_from_hf(config, eod: Optional[int], make_divisible_by: int, tp: int) -> Shape:
    """The Shape of an HF GPT-2 or Llama config; megatron's vocabulary padded as training
    pads it for tensor-parallel size ``tp``."""
    kind = config.model_type
    multiple = make_divisible_by * tp
    padded = ((config.vocab_size + multiple - 1) // multiple) * multiple
    if eod is None:
        eod = config.eos_token_id if config.eos_token_id is not None else config.vocab_size - 1
    if kind == "gpt2":
        if config.activation_function not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ConversionError(f"GPT-2 activation {config.activation_function!r} has no megatron option")
        return Shape("gpt2", config.n_layer, config.n_embd, config.n_head, config.n_head,
                     config.n_inner or 4 * config.n_embd, config.vocab_size, padded, True,
                     bool(config.tie_word_embeddings), config.n_positions, 10000, int(eod))
    if kind == "llama":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_dim * config.num_attention_heads != config.hidden_size:
            raise ConversionError(f"head_dim {head_dim} x {config.num_attention_heads} heads != hidden "
                                  f"{config.hidden_size}: megatron's GPT layers assume they are equal")
        if config.attention_bias != config.mlp_bias:
            raise ConversionError("attention_bias != mlp_bias: megatron has one add_bias_linear for both")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ConversionError(f"rope_type {rope.get('rope_type')!r}: only the default RoPE maps "
                                  f"onto --position-embedding-type rope")
        return Shape("llama", config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                     config.num_key_value_heads, config.intermediate_size, config.vocab_size, padded,
                     bool(config.attention_bias), bool(config.tie_word_embeddings),
                     config.max_position_embeddings, int(rope.get("rope_theta", 10000)), int(eod))
    raise ConversionError(f"HF model_type {kind!r}: convertible are gpt2 and llama")


def model_flags(shape: Shape) -> Dict:
    """The training entry's model config (ModelConfig fields) for ``shape``."""
    flags = dict(num_layers=shape.num_layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                 ffn_hidden_size=shape.ffn, num_query_groups=shape.groups if shape.groups != shape.heads else None,
                 disable_bias_linear=not shape.bias,
                 untie_embeddings_and_output_weights=not shape.tied)
    if shape.family == "gpt2":
        flags.update(max_position_embeddings=shape.max_positions)
    else:
        flags.update(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                     rotary_base=shape.rotary_base)
    return flags


# ---- per-layer mapping ---------------------------------------------------------------------

def _split_qkv(t: torch.Tensor, s: Shape):
    """megatron's per-group [q.., k, v] rows -> (q, k, v) in HF's head order."""
    per = s.heads // s.groups
    g = t.reshape(s.groups, per + 2, s.head_dim, *t.shape[1:])
    q = g[:, :per].reshape(s.heads * s.head_dim, *t.shape[1:])
    return q, g[:, per].reshape(s.groups * s.head_dim, *t.shape[1:]), g[:, per + 1].reshape(-1, *t.shape[1:])


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    per = s.heads // s.groups
    rest = q.shape[1:]
    parts = [q.reshape(s.groups, per, s.head_dim, *rest), k.reshape(s.groups, 1, s.head_dim, *rest),
             v.reshape(s.groups, 1, s.head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def megatron_layer_to_hf(get: Callable[[str], torch.Tensor], s: Shape, i: int) -> Dict[str, torch.Tensor]:
    """HF tensors of layer ``i``; ``get(key)`` returns layer i's slice of a megatron key."""
    q, k, v = _split_qkv(get(QKV + "weight"), s)
    if s.family == "gpt2":
        p = f"transformer.h.{i}."
        qb, kb, vb = _split_qkv(get(QKV + "bias"), s)
        return {p + "ln_1.weight": get(QKV + "layer_norm_weight"), p + "ln_1.bias": get(QKV + "layer_norm_bias"),
                p + "attn.c_attn.weight": torch.cat([q, k, v]).t(), p + "attn.c_attn.bias": torch.cat([qb, kb, vb]),
                p + "attn.c_proj.weight": get(PROJ + "weight").t(), p + "attn.c_proj.bias": get(PROJ + "bias"),
                p + "ln_2.weight": get(FC1 + "layer_norm_weight"), p + "ln_2.bias": get(FC1 + "layer_norm_bias"),
                p + "mlp.c_fc.weight": get(FC1 + "weight").t(), p + "mlp.c_fc.bias": get(FC1 + "bias"),
                p + "mlp.c_proj.weight": get(FC2 + "weight").t(), p + "mlp.c_proj.bias": get(FC2 + "bias")}
    p = f"model.layers.{i}."
    fc1 = get(FC1 + "weight")
    out = {p + "input_layernorm.weight": get(QKV + "layer_norm_weight"),
           p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
           p + "self_attn.o_proj.weight": get(PROJ + "weight"),
           p + "post_attention_layernorm.weight": get(FC1 + "layer_norm_weight"),
           p + "mlp.gate_proj.weight": fc1[:s.ffn], p + "mlp.up_proj.weight": fc1[s.ffn:],
           p + "mlp.down_proj.weight": get(FC2 + "weight")}
    if s.bias:
        qb, kb, vb = _split_qkv(get(QKV + "bias"), s)
        fb = get(FC1 + "bias")
        out.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                    p + "self_attn.v_proj.bias": vb, p + "self_attn.o_proj.bias": get(PROJ + "bias"),
                    p + "mlp.gate_proj.bias": fb[:s.ffn], p + "mlp.up_proj.bias": fb[s.ffn:],
                    p + "mlp.down_proj.bias": get(FC2 + "bias")})
    return {k: t.contiguous() for k, t in out.items()}


def hf_layer_to_megatron(get: Callable[[str], torch.Tensor], s: Shape, i: int) -> Dict[str, torch.Tensor]:
    """Layer ``i``'s slice of each megatron layer key; ``get(name)`` reads an HF tensor."""
    if s.family == "gpt2":
        p = f"transformer.h.{i}."
        w, b = get(p + "attn.c_attn.weight").t(), get(p + "attn.c_attn.bias")
        n = s.hidden
        return {QKV + "layer_norm_weight": get(p + "ln_1.weight"), QKV + "layer_norm_bias": get(p + "ln_1.bias"),
                QKV + "weight": _join_qkv(w[:n], w[n:2 * n], w[2 * n:], s),
                QKV + "bias": _join_qkv(b[:n], b[n:2 * n], b[2 * n:], s),
                PROJ + "weight": get(p + "attn.c_proj.weight").t(), PROJ + "bias": get(p + "attn.c_proj.bias"),
                FC1 + "layer_norm_weight": get(p + "ln_2.weight"), FC1 + "layer_norm_bias": get(p + "ln_2.bias"),
                FC1 + "weight": get(p + "mlp.c_fc.weight").t(), FC1 + "bias": get(p + "mlp.c_fc.bias"),
                FC2 + "weight": get(p + "mlp.c_proj.weight").t(), FC2 + "bias": get(p + "mlp.c_proj.bias")}
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = {QKV + "layer_norm_weight": get(p + "input_layernorm.weight"),
           QKV + "weight": _join_qkv(get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"), s),
           PROJ + "weight": get(a + "o_proj.weight"),
           FC1 + "layer_norm_weight": get(p + "post_attention_layernorm.weight"),
           FC1 + "weight": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
           FC2 + "weight": get(p + "mlp.down_proj.weight")}
    if s.bias:
        out.update({QKV + "bias": _join_qkv(get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias"), s),
                    PROJ + "bias": get(a + "o_proj.bias"),
                    FC1 + "bias": torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")]),
                    FC2 + "bias": get(p + "mlp.down_proj.bias")})
    return {k: t.contiguous() for k, t in out.items()}


def megatron_globals_to_hf(get: Callable[[str], torch.Tensor], s: Shape) -> Dict[str, torch.Tensor]:
    """Embeddings, final norm and output layer; the vocabulary padding is dropped."""
    emb = get(EMB)[:s.vocab].contiguous()
    if s.family == "gpt2":
        out = {"transformer.wte.weight": emb, "transformer.wpe.weight": get(POS),
               "transformer.ln_f.weight": get(FINAL + "weight"), "transformer.ln_f.bias": get(FINAL + "bias")}
    else:
        out = {"model.embed_tokens.weight": emb, "model.norm.weight": get(FINAL + "weight")}
    if not s.tied:
        out["lm_head.weight"] = get(OUT)[:s.vocab].contiguous()
    return out


def hf_globals_to_megatron(get: Callable[[str], torch.Tensor], s: Shape) -> Dict[str, torch.Tensor]:
    """The inverse of megatron_globals_to_hf; padded rows are zero (never a real token's)."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(s.padded_vocab, t.shape[1], dtype=t.dtype)
        out[:t.shape[0]] = t
        return out

    if s.family == "gpt2":
        emb = get("transformer.wte.weight")
        out = {EMB: pad(emb), POS: get("transformer.wpe.weight"),
               FINAL + "weight": get("transformer.ln_f.weight"), FINAL + "bias": get("transformer.ln_f.bias")}
    else:
        emb = get("model.embed_tokens.weight")
        out = {EMB: pad(emb), FINAL + "weight": get("model.norm.weight")}
    if not s.tied:
        out[OUT] = pad(get("lm_head.weight"))
    return out
