"""What a checkpoint says about the model it holds, and the check of it at a load.

``model_record`` is written into every manifest (the model config, the vocabularies, the
tokenizer, GRPO on/off, package versions, the optimizer's bucket layout), so tools read a
checkpoint without the run's flags; ``check_record`` refuses a checkpoint of another model
shape or bucket layout at ``--load`` / ``--init-from``, naming each difference.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_grpo.training.safety.checkpoint_dirs import MANIFEST, CheckpointError


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def model_versions() -> Dict:
    """Versions of the packages that wrote a checkpoint (None where not installed)."""
    from importlib import metadata

    def version(dist_name: str) -> Optional[str]:
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            return None

    return {"megatron_core": version("megatron-core"), "megatron_grpo": version("megatron-grpo"),
            "torch": torch.__version__}


def bucket_layout(cfg, grpo_bucket_size: Optional[int], dp: int) -> Dict:
    """DDP bucket sizes (elements) on the first and on later pipeline stages; None = one bucket
    per buffer. The distributed optimizer's state is saved per bucket (dp_reshardable), so a
    resume needs the same buckets. megatron makes one bucket on later stages and without
    overlap_grad_reduce; GRPO (megatron_grpo.megatron.ddp) keeps its buckets everywhere.
    ``later_stages`` is None at pipeline-parallel size 1 (there are none)."""
    later_exist = cfg.parallel.pipeline_model_parallel_size > 1
    if grpo_bucket_size:
        out = {"first_stage": int(grpo_bucket_size),
               "later_stages": int(grpo_bucket_size) if later_exist else None}
    else:
        from megatron_grpo.grpo.config import default_bucket_elements

        first = (cfg.parallel.ddp_bucket_size or default_bucket_elements(dp)) if cfg.parallel.overlap_grad_reduce else None
        out = {"first_stage": first, "later_stages": None}
    # Partial distributed optimizer: state is sharded inside an instance, and GRPO's residuals
    # between instances have the shard's length. Recorded only when not 1, so records of
    # earlier checkpoints still compare equal.
    instances = cfg.parallel.num_distributed_optimizer_instances
    if instances != 1:
        out["distributed_optimizer_instances"] = int(instances)
    return out


def model_record(cfg, tokenizer, padded_vocab: int, buckets: Optional[Dict] = None) -> Dict:
    """What a checkpoint's manifest says about the model, so tools (checkpoints/grpo_ckpt.py)
    read it without the run's flags and a load can say what differs: the model config, the
    padded and the tokenizer's vocabulary, the tokenizer, GRPO on/off and package versions."""
    import dataclasses

    from megatron_grpo.data.tokenizer import tokenizer_spec_dict

    return {"config": dataclasses.asdict(cfg.model), "padded_vocab_size": int(padded_vocab),
            "tokenizer": tokenizer_spec_dict(tokenizer), "grpo": bool(cfg.grpo.enabled),
            "versions": model_versions(), "optimizer_buckets": buckets}


def _shape(record: Dict) -> Dict:
    """The model-config values that decide tensor shapes, with defaults resolved."""
    c = record["config"]
    shape = {k: c.get(k) for k in ("num_layers", "hidden_size", "num_attention_heads", "swiglu",
                                   "normalization", "position_embedding_type", "disable_bias_linear")}
    shape["ffn_hidden_size"] = c.get("ffn_hidden_size") or 4 * c["hidden_size"]
    shape["num_query_groups"] = c.get("num_query_groups") or c["num_attention_heads"]
    shape["untie_embeddings_and_output_weights"] = c.get("untie_embeddings_and_output_weights", True)
    if c.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        shape["max_position_embeddings"] = c.get("max_position_embeddings") or c["seq_length"]
    # The tokenizer's vocabulary, not the padded one: padding follows TP, and megatron loads the
    # embedding and output layer across it (allow_shape_mismatch).
    shape["vocab_size"] = record["tokenizer"]["vocab_size"]
    return shape


def check_record(flag: str, path: str, manifest: Dict, record: Optional[Dict],
                 optimizer: bool = True) -> None:
    """Refuse a checkpoint of another model shape, naming each difference; say once (rank 0)
    when it was written with GRPO on/off otherwise or by other package versions. Checkpoints
    written before manifests held a model record are not checked."""
    saved = manifest.get("model")
    if record is None or saved is None:
        return
    ours, theirs = _shape(record), _shape(saved)
    diff = [f"{k} {theirs.get(k)} there, {ours.get(k)} here" for k in sorted(set(ours) | set(theirs))
            if ours.get(k) != theirs.get(k)]
    if diff:
        raise CheckpointError(
            f"{flag} {path} (rank {_rank()}): the checkpoint holds another model shape: "
            f"{'; '.join(diff)}. Give this run the checkpoint's model flags (its manifest "
            f"{MANIFEST} lists them), or point {flag} at a checkpoint of this model.")
    theirs_b, ours_b = saved.get("optimizer_buckets"), record.get("optimizer_buckets")
    if flag == "--load" and optimizer and theirs_b and ours_b and theirs_b != ours_b:
        inst_t, inst_o = (b.get("distributed_optimizer_instances", 1) for b in (theirs_b, ours_b))
        if inst_t != inst_o:
            how = f"resume with --num-distributed-optimizer-instances {inst_t}, as it was written"
        elif theirs_b["later_stages"] is not None and ours_b["later_stages"] is None and not record["grpo"]:
            how = ("it was written by GRPO, whose buckets megatron rebuilds only at pipeline-parallel "
                   "size 1 with overlapped gradient reduce: resume with --ddp-bucket-size "
                   f"{theirs_b['first_stage']} at --pipeline-model-parallel-size 1, or with --grpo")
        else:
            how = "resume with the same bucket size (--ddp-bucket-size or --grpo-bucket-mb)"
        raise CheckpointError(
            f"--load {path} (rank {_rank()}): the distributed optimizer's state is saved per DDP "
            f"bucket; buckets there: {theirs_b}, here: {ours_b} (elements; None = one bucket). "
            f"{how[0].upper() + how[1:]}; or start from its weights with --init-from {path} "
            f"(fresh optimizer state).")
    notes = [f"{k.replace('_', '-')} {v} there, {record['versions'].get(k)} here"
             for k, v in sorted(saved.get("versions", {}).items()) if v != record["versions"].get(k)]
    if saved.get("grpo") != record["grpo"]:
        notes.append(f"GRPO {'on' if saved.get('grpo') else 'off'} there, "
                     f"{'on' if record['grpo'] else 'off'} here")
    if notes and _rank() == 0:
        print(f"[checkpoint] {flag} {path}: written with {'; '.join(notes)}", flush=True)
