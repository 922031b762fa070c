"""Hugging Face transformers directory -> megatron torch_dist checkpoint (from-hf).

The checkpoint is written by megatron-core itself: the model is built as the training entry
builds it (TP 1, PP 1, CPU), HF tensors are copied into its parameters through the keys of
its own ``sharded_state_dict`` (the checkpoint keys, whatever the layer spec calls the module),
then ``dist_checkpointing.save`` writes it. So any run of the training entry, at any TP/PP
layout, starts from it with ``--init-from DIR``, and stock megatron-core loads it. HF tensors
are read one at a time from the safetensors files; the megatron model is held once in host
memory (the conversion is not streamed on that side).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Dict, Optional

import torch

from megatron_grpo.convert import hf_layout as hl


class HFReader:
    """Tensors of an HF model directory (safetensors, sharded or not), one at a time."""

    def __init__(self, hf_dir: str) -> None:
        from safetensors import safe_open

        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = json.load(open(index))["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise hl.ConversionError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                                     f"(save the model with save_pretrained(safe_serialization=True))")
        self._where: Dict[str, object] = {}
        for name in files:
            handle = safe_open(os.path.join(hf_dir, name), framework="pt")
            for key in handle.keys():
                self._where[key] = handle
        self.hf_dir = hf_dir

    def keys(self):
        return self._where.keys()

    def get(self, name: str) -> torch.Tensor:
        # Old GPT-2 checkpoints store the body without the "transformer." prefix.
        for key in (name, name.removeprefix("transformer.")):
            if key in self._where:
                return self._where[key].get_tensor(key)
        raise hl.ConversionError(f"{self.hf_dir}: no tensor {name!r} in its safetensors files")


def _tokenizer_record(hf_dir: str, vocab_size: int, eos: Optional[int]) -> Dict:
    """The project's byte tokenizer when the directory holds its HF export (to-hf writes it);
    else the HF tokenizer of the directory, or none."""
    if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return {"type": "none", "path": None, "vocab_size": vocab_size, "eod": eos, "pad": None}
    from transformers import AutoTokenizer

    from megatron_grpo.data.tokenizer import ByteTokenizer, tokenizer_spec_dict

    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    byte = ByteTokenizer()
    if len(tok) == vocab_size == byte.vocab_size and tok.eos_token_id == byte.eod \
            and tok("ab")["input_ids"] == byte.tokenize("ab"):
        return tokenizer_spec_dict(byte)
    eod = tok.eos_token_id if tok.eos_token_id is not None else eos
    return {"type": "hf", "path": os.path.abspath(hf_dir), "vocab_size": vocab_size, "eod": eod, "pad": None}


def record_for(hf_dir: str, tp: int = 1, make_divisible_by: int = 128):
    """(Shape, model record) of an HF directory, as a checkpoint's manifest records a model."""
    from transformers import AutoConfig

    from megatron_grpo.training.checkpointing import model_versions
    from megatron_grpo.training.config import ModelConfig

    config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    tok = _tokenizer_record(hf_dir, config.vocab_size, config.eos_token_id)
    shape = hl.shape_from_hf(config, tok["eod"], make_divisible_by, tp)
    tok["eod"] = shape.eod  # the config's eos, or the last id when it names none
    model = dataclasses.asdict(ModelConfig())
    model.update(hl.model_flags(shape), seq_length=min(shape.max_positions, 4096),
                 make_vocab_size_divisible_by=make_divisible_by)
    return shape, {"config": model, "padded_vocab_size": shape.padded_vocab, "tokenizer": tok,
                   "grpo": False, "versions": model_versions(), "source": {"hf": os.path.abspath(hf_dir)}}


def _sharded_tensors(sd) -> list:
    """Every ShardedTensor of a sharded state dict; factories (SwiGLU's fc1 is stored as its
    gate and up halves) are built: their tensors are views of the parameter."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for value in (sd.values() if isinstance(sd, dict) else sd):
        if isinstance(value, ShardedTensorFactory):
            value = value.build()
        if isinstance(value, (dict, list, tuple)):
            out.extend(_sharded_tensors(value))
        elif isinstance(value, ShardedTensor):
            out.append(value)
    return out


def fill_megatron(model, reader: HFReader, shape: hl.Shape) -> int:
    """Copy HF tensors into ``model`` (a TP 1 / PP 1 GPTModel) by checkpoint key; returns the
    number of elements copied. Every megatron tensor must get one: a key left over is an error."""
    from megatron_grpo.training.checkpointing import SHARDING

    by_layer: Dict[Optional[int], list] = {}
    for sh in _sharded_tensors(model.sharded_state_dict(metadata=SHARDING)):
        layer = sh.global_offset[0] if sh.prepend_axis_num else None
        by_layer.setdefault(layer, []).append(sh)
    copied = 0
    with torch.no_grad():
        for layer, shards in sorted(by_layer.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            mapped = (hl.hf_globals_to_megatron(reader.get, shape) if layer is None
                      else hl.hf_layer_to_megatron(reader.get, shape, layer))
            for sh in shards:
                if sh.key == hl.OUT and shape.tied:
                    continue  # the embedding's own tensor
                if sh.key not in mapped:
                    raise hl.ConversionError(f"megatron tensor {sh.key!r} (layer {layer}) has no HF source")
                src = mapped[sh.key]
                # this shard's region of the key's (per-layer) global tensor
                for dim, start in enumerate(sh.global_offset[sh.prepend_axis_num:]):
                    src = src.narrow(dim, start, sh.data.shape[dim])
                if tuple(src.shape) != tuple(sh.data.shape):
                    raise hl.ConversionError(f"{sh.key} (layer {layer}): HF gives {tuple(src.shape)}, "
                                             f"megatron expects {tuple(sh.data.shape)}")
                sh.data.copy_(src.to(sh.data.dtype))
                copied += src.numel()
    return copied


def from_hf(hf_dir: str, out_root: str, tp: int = 1, make_divisible_by: int = 128):
    """Write ``out_root/iter_0000000`` (+ tracker); returns (summary, MegatronModel)."""
    from megatron.core import dist_checkpointing

    from megatron_grpo.convert.verify import MegatronModel
    from megatron_grpo.training import checkpointing as ckpt

    shape, record = record_for(hf_dir, tp, make_divisible_by)
    reader = HFReader(hf_dir)
    megatron = MegatronModel(record, None)
    copied = fill_megatron(megatron.model, reader, shape)
    expected = sum(p.numel() for p in megatron.model.parameters())
    if copied != expected:  # a parameter no HF tensor reached would be saved at its random init
        raise hl.ConversionError(f"{hf_dir}: {copied} elements copied into a megatron model of "
                                 f"{expected}; some parameters have no HF source")
    final = ckpt.iteration_dir(out_root, 0)
    tmp = final + ".tmp"
    os.makedirs(out_root, exist_ok=True)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    common = {"iteration": 0, "world_size": 1, "format_version": ckpt.FORMAT_VERSION, "consumed_samples": 0}
    dist_checkpointing.save({"model": megatron.model.sharded_state_dict(metadata=ckpt.SHARDING),
                             "common": common}, tmp)
    ckpt.write_manifest(tmp, 0, 1, [1, 1], record)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    ckpt.write_tracker(out_root, 0)
    summary = {"family": shape.family, "parameters": copied, "checkpoint": final,
               "padded_vocab_size": shape.padded_vocab, "tokenizer": record["tokenizer"]["type"]}
    return summary, megatron


def roundtrip_differences(hf_dir: str, ckpt_dir: str) -> list:
    """HF tensor names whose value read back from the megatron checkpoint (mapped to HF again)
    differs from the HF original, layer by layer. Empty = the round trip is exact."""
    from megatron_grpo.convert.reader import CheckpointView
    from megatron_grpo.convert.verify import rows_equal

    view = CheckpointView(ckpt_dir)
    shape = hl.shape_from_record(view.record)
    reader = HFReader(hf_dir)
    bad = []
    for i in range(shape.num_layers + 1):
        back = (hl.megatron_layer_to_hf(lambda k: view.tensor(k, i), shape, i) if i < shape.num_layers
                else hl.megatron_globals_to_hf(view.tensor, shape))
        bad += rows_equal(back, {k: reader.get(k) for k in back})
    return bad
