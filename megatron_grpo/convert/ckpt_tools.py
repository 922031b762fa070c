"""inspect and strip-grpo: read a checkpoint's files, or write a plain megatron-core copy.

Neither builds a model: inspect reads the manifest, torch_dist metadata and common.pt;
strip-grpo copies the torch_dist files unchanged and rewrites only common.pt (GRPO's state
removed) and the per-rank files (RNG kept, GRPO's residuals removed).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from typing import Dict

import torch

from megatron_grpo.convert.reader import CheckpointView
from megatron_grpo.training import checkpointing as ckpt

# GRPO's keys in a checkpoint: common["common"]["extensions"] (replica-wide: tier map, monitors,
# events, per-parameter Adam steps) and rng/rank_*.pt["extra"] (residuals, importance, carries).
EXTENSIONS = "extensions"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def inspect(path: str) -> Dict:
    """Everything a user asks of a checkpoint, as a dict (``describe`` prints it). Verifies the
    manifest's sizes and CRC32s first."""
    view = CheckpointView(path)
    m = view.manifest
    tensors = view.tensors()
    model = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    optim = {k: v for k, v in tensors.items() if k.startswith("optimizer.")}

    def nbytes(entries):
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in entries.values())

    common = view.common().get("common", {})
    ext = common.get(EXTENSIONS) or {}
    tiers = ext.get("tiers")
    info = {
        "path": view.path, "iteration": m.get("iteration"), "world_size": m.get("world_size"),
        "layout_tp_pp": m.get("layout"), "format_version": m.get("format_version"),
        "files": {name: dict(f) for name, f in sorted(m.get("files", {}).items())},
        "checksums": "verified (size and CRC32 of every file)",
        "model_tensors": len(model), "model_parameters": sum(math.prod(s) for s, _ in model.values()),
        "model_bytes": nbytes(model), "optimizer_tensors": len(optim), "optimizer_bytes": nbytes(optim),
        "objects": len(view.objects()),
        "grpo_state": bool(ext),
        "tier_counts": dict(Counter(tiers)) if tiers else None,
        "grpo_events": len(ext.get("events", [])) if ext else 0,
        "consumed_samples": common.get("consumed_samples"),
    }
    rec = view.record
    if rec:
        c = rec["config"]
        info["model"] = {k: c.get(k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                "num_query_groups", "ffn_hidden_size", "swiglu",
                                                "normalization", "position_embedding_type",
                                                "disable_bias_linear", "untie_embeddings_and_output_weights")}
        info["padded_vocab_size"] = rec["padded_vocab_size"]
        info["tokenizer"] = rec["tokenizer"]
        info["versions"] = rec.get("versions")
    return info


def describe(info: Dict) -> str:
    lines = [f"checkpoint {info['path']}",
             f"  iteration {info['iteration']}, written by {info['world_size']} rank(s), "
             f"tensor x pipeline parallel {info['layout_tp_pp']}, format {info['format_version']}",
             f"  files: {len(info['files'])}, {_human(sum(f['size'] for f in info['files'].values()))}; "
             f"{info['checksums']}"]
    for name, f in info["files"].items():
        lines.append(f"    {name:40s} {_human(f['size']):>10s}  crc32 {f['crc32']:08x}")
    lines.append(f"  model: {info['model_tensors']} tensors, {info['model_parameters']:,} parameters, "
                 f"{_human(info['model_bytes'])}; optimizer: {info['optimizer_tensors']} tensors, "
                 f"{_human(info['optimizer_bytes'])}; {info['objects']} non-tensor entries")
    if "model" in info:
        lines.append("  shape: " + ", ".join(f"{k}={v}" for k, v in info["model"].items()))
        tok = info["tokenizer"]
        lines.append(f"  vocabulary: {tok['vocab_size']} ({tok['type']} tokenizer), padded to "
                     f"{info['padded_vocab_size']}; versions {info['versions']}")
    else:
        lines.append("  shape: not recorded (written before manifests held a model record)")
    if info["grpo_state"]:
        lines.append(f"  GRPO state: tier map {info['tier_counts']} (units), {info['grpo_events']} event(s)")
    else:
        lines.append("  GRPO state: none (a plain megatron-core checkpoint)")
    return "\n".join(lines)


def strip_grpo(path: str, out_root: str) -> Dict:
    """Write ``out_root/iter_N``: the same model and optimizer files, common.pt and the rank
    files without GRPO's state, a new manifest. The source is not touched."""
    view = CheckpointView(path)
    if "common.pt" not in view.manifest["files"]:
        # megatron-core >= 0.19 keeps the common state inside the torch_dist files: removing
        # GRPO's part would mean rewriting them, which this tool does not do yet.
        raise ckpt.CheckpointError(
            f"{view.path}: strip-grpo rewrites common.pt, and this checkpoint has none (written "
            f"with megatron-core 0.19 or later, which stores the common state inside the "
            f"torch_dist files). Convert it where megatron-core 0.16-0.18 wrote it, or resume "
            f"without --grpo from its weights with --no-load-optim (docs/checkpoints.md)")
    it = int(view.manifest["iteration"])
    final = ckpt.iteration_dir(out_root, it)
    tmp = final + ".tmp"
    os.makedirs(out_root, exist_ok=True)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    removed = []
    for name in view.manifest["files"]:
        src, dst = os.path.join(view.path, name), os.path.join(tmp, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if name == "common.pt":
            state = torch.load(src, map_location="cpu", weights_only=False)
            if state.get("common", {}).get(EXTENSIONS):
                removed.append("common.pt: extensions (tier map, monitors, events, per-parameter Adam steps)")
            state.setdefault("common", {})[EXTENSIONS] = {}
            torch.save(state, dst)
        elif name.startswith("rng/"):
            state = torch.load(src, map_location="cpu", weights_only=False)
            if state.get("extra"):
                removed.append(f"{name}: extra ({', '.join(sorted(state['extra']))})")
            state["extra"] = {}
            torch.save(state, dst)
        else:
            shutil.copy2(src, dst)
    record = dict(view.record or {})
    if record:
        record["grpo"] = False
    ckpt.write_manifest(tmp, it, int(view.manifest.get("world_size", 1)),
                        view.manifest.get("layout", [1, 1]), record or None)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    ckpt.write_tracker(out_root, it)
    return {"checkpoint": final, "removed": removed, "resume": resume_advice(record, view.manifest)}


def resume_advice(record: Dict, manifest: Dict) -> str:
    """How a run without GRPO resumes the stripped checkpoint (its optimizer state is saved per
    DDP bucket, and GRPO's buckets are not megatron's default)."""
    buckets = (record or {}).get("optimizer_buckets")
    if not buckets:
        return "resume it with the flags of the run that wrote it, without --grpo"
    if buckets["later_stages"] is not None:
        return ("its optimizer state is in GRPO's buckets on every pipeline stage, which megatron "
                "builds only on the first: start from its weights with --init-from (fresh optimizer "
                "state)")
    size = buckets["first_stage"]
    return (f"resume it without --grpo with --ddp-bucket-size {size}" if size
            else "resume it without --grpo with --no-overlap-grad-reduce")


def as_json(info: Dict) -> str:
    return json.dumps(info, indent=1, sort_keys=True, default=str)
