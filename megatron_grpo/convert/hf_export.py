"""megatron torch_dist checkpoint -> Hugging Face transformers directory (to-hf).

Written layer by layer: each decoder layer's tensors are read (one slice of each stacked key),
mapped, and written to their own safetensors shard before the next layer is read, so the
conversion holds one layer at a time. Output: ``config.json``, ``model-*.safetensors`` with
``model.safetensors.index.json``, and tokenizer files. It is written into ``OUT.tmp`` and renamed
to ``OUT`` when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict

import torch

from megatron_grpo.convert import hf_layout as hl
from megatron_grpo.convert.reader import CheckpointView


def _byte_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def save_byte_tokenizer(out_dir: str) -> None:
    """The project's ByteTokenizer (ids 0-255 = bytes, 256 = end of document, 257 = pad) as an
    HF fast tokenizer with the same ids: byte-level pre-tokenisation and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>"])  # -> 256, 257
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(out_dir)


def _save_tokenizer(record: Dict, out_dir: str) -> str:
    spec = record["tokenizer"]
    if spec["type"] == "byte":
        save_byte_tokenizer(out_dir)
        return "byte tokenizer (ids 0-255 bytes, 256 end of document, 257 pad)"
    from transformers import AutoTokenizer

    path = spec.get("path")
    if not path or not os.path.isdir(path):
        return f"no tokenizer files: the training tokenizer's directory {path!r} is not here"
    AutoTokenizer.from_pretrained(path, local_files_only=True).save_pretrained(out_dir)
    return f"tokenizer of {path}"


def to_hf(ckpt: str, out_dir: str, dtype: str = "float32") -> Dict:
    """Convert; returns a summary (family, shards, parameters, tokenizer)."""
    view = CheckpointView(ckpt)
    if view.record is None:
        raise hl.ConversionError(
            f"{view.path}: its manifest has no model record (written before this tool existed); "
            f"resume it once with the training entry and save again, which records the model")
    shape = hl.shape_from_record(view.record)
    for key in (hl.QKV + "weight", hl.FC1 + "weight", hl.EMB):
        if not view.has(key):
            raise hl.ConversionError(f"{view.path}: no {key!r}; keys here: "
                                     f"{', '.join(sorted(view.tensors())[:8])} ...")
    cast = getattr(torch, dtype)
    tmp = out_dir.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    from safetensors.torch import save_file

    n = shape.num_layers + 1
    weight_map, total, params = {}, 0, 0
    for i in range(n):
        if i < shape.num_layers:
            tensors = hl.megatron_layer_to_hf(lambda k: view.tensor(k, i), shape, i)
        else:
            tensors = hl.megatron_globals_to_hf(view.tensor, shape)
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {k: t.to(cast).contiguous() for k, t in tensors.items()}
        save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
            params += t.numel()
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1, sort_keys=True)
    config = hl.hf_config(shape)
    config.dtype = dtype
    config.save_pretrained(tmp)
    tokenizer = _save_tokenizer(view.record, tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return {"family": shape.family, "shards": n, "parameters": params, "tokenizer": tokenizer,
            "iteration": view.manifest.get("iteration"), "source": view.path}
