"""Every config field given an invalid value: refused before any process group exists, with a
message naming the flag (or the YAML key) and the value.

Every field of every config dataclass (PretrainConfig's sections, GRPOConfig, OffloadConfig) is tried twice,
in-process through parse_args (the launcher's path; one subprocess per field would take minutes):
a value of the wrong type from a YAML file, and an out-of-range value as a flag. A field without
a case fails the test, so a new field needs one. Fields parse_args once accepted out of range
(LATE_FAILURES: training then failed with a raw traceback, or ran on) also go through the launcher
in the slow test. tests/unit/test_arguments.py checks the exact wording of many of these messages."""

import dataclasses
import typing

import pytest

from reliability_harness import first_line, run_job, torchrun_failure
from megatron_grpo.training.arguments import ConfigError, _base_type, _sections, flag_name, parse_args
from megatron_grpo.training.config import PretrainConfig

GROUP = "Invalid config fields"
DATA = ["--data-path", "data/x"]

# field -> out-of-range flags (None: any value of the right type is valid, or a free-form path
# that is checked where it is used: --load, --data-path ... at run start).
RANGE = {
    "model.num_layers": ["--num-layers", "0"], "model.hidden_size": ["--hidden-size", "0"],
    "model.num_attention_heads": ["--num-attention-heads", "0"],
    "model.ffn_hidden_size": ["--ffn-hidden-size", "-5"], "model.seq_length": ["--seq-length", "0"],
    "model.max_position_embeddings": ["--max-position-embeddings", "32"],
    "model.make_vocab_size_divisible_by": ["--make-vocab-size-divisible-by", "0"],
    "model.init_method_std": ["--init-method-std", "-1"], "model.hidden_dropout": ["--hidden-dropout", "1.0"],
    "model.attention_dropout": ["--attention-dropout", "-0.1"],
    "model.num_query_groups": ["--num-query-groups", "3"], "model.swiglu": None,
    "model.normalization": ["--normalization", "BatchNorm"],
    "model.position_embedding_type": ["--position-embedding-type", "alibi"],
    "model.rotary_base": ["--rotary-base", "0"], "model.disable_bias_linear": None,
    "model.untie_embeddings_and_output_weights": ["--grpo", "--no-untie-embeddings-and-output-weights",
                                                  "--pipeline-model-parallel-size", "2"],
    "model.recompute_granularity": ["--recompute-granularity", "everything"],
    "model.recompute_method": ["--recompute-granularity", "full", "--recompute-method", "random"],
    "model.recompute_num_layers": ["--recompute-granularity", "full", "--recompute-method", "block",
                                   "--recompute-num-layers", "0"],
    "parallel.sequence_parallel": ["--sequence-parallel"],  # needs TP >= 2
    "parallel.tensor_model_parallel_size": ["--tensor-model-parallel-size", "0"],
    "parallel.pipeline_model_parallel_size": ["--pipeline-model-parallel-size", "0"],
    "parallel.pipeline_model_parallel_layout": ["--pipeline-model-parallel-layout", "E|tx|L"],
    "parallel.ddp_bucket_size": ["--ddp-bucket-size", "0"], "parallel.overlap_grad_reduce": None,
    "parallel.use_distributed_optimizer": None,
    "parallel.distributed_timeout_minutes": ["--distributed-timeout-minutes", "0"],
    "parallel.num_distributed_optimizer_instances": ["--num-distributed-optimizer-instances", "-1"],
    "optimizer.lr": ["--lr", "0"], "optimizer.min_lr": ["--min-lr", "-1"],
    "optimizer.lr_warmup_iters": ["--lr-warmup-iters", "-1"], "optimizer.lr_decay_style": ["--lr-decay-style", "step"],
    "optimizer.lr_decay_iters": ["--lr-decay-iters", "0"], "optimizer.weight_decay": ["--weight-decay", "-1"],
    "optimizer.adam_beta1": ["--adam-beta1", "1.5"], "optimizer.adam_beta2": ["--adam-beta2", "1.5"],
    "optimizer.adam_eps": ["--adam-eps", "-1"], "optimizer.clip_grad": ["--clip-grad", "-1"],
    "training.micro_batch_size": ["--micro-batch-size", "0"], "training.global_batch_size": ["--global-batch-size", "0"],
    "training.train_iters": ["--train-iters", "-1"], "training.seed": ["--seed", "-1"], "training.bf16": None,
    "training.cpu": None, "training.exit_after_iter": ["--exit-after-iter", "0"],
    "training.check_for_nan_in_loss_and_grad": None,
    "training.max_consecutive_skipped_steps": ["--max-consecutive-skipped-steps", "-1"],
    "data.data_path": [], "data.split": ["--split", "98,2"], "data.data_cache_dir": None,
    "checkpoint.save": None, "checkpoint.save_interval": ["--save-interval", "0", "--save", "d"],
    "checkpoint.load": ["--load", "a", "--init-from", "b"], "checkpoint.init_from": ["--init-from", "b", "--load", "a"], "checkpoint.load_optim": None,
    "checkpoint.overwrite_checkpoints": ["--overwrite-checkpoints"],  # without --save
    "checkpoint.override_opt_param_scheduler": ["--override-opt_param-scheduler",
                                                "--use-checkpoint-opt_param-scheduler"],  # both
    "checkpoint.use_checkpoint_opt_param_scheduler": ["--use-checkpoint-opt_param-scheduler",
                                                      "--override-opt_param-scheduler"],
    "logging.log_interval": ["--log-interval", "0"], "logging.eval_interval": ["--eval-interval", "0"],
    "logging.eval_iters": ["--eval-iters", "-1"], "logging.metrics_file": None, "logging.tensorboard_dir": None,
    "logging.run_name": None, "logging.check_weight_hash_interval": ["--check-weight-hash-interval", "0"],
    "grpo.enabled": None, "grpo.core_share": ["--grpo-core-share", "1.5"],
    "grpo.dynamic_share": ["--grpo-dynamic-share", "-0.1"], "grpo.stable_share": ["--grpo-stable-share", "2"],
    "grpo.bucket_mb": ["--grpo-bucket-mb", "0"], "grpo.warmup_iters": ["--grpo-warmup-iters", "-1"],
    "grpo.retier_interval": ["--grpo-retier-interval", "0"],
    "grpo.importance_interval": ["--grpo-importance-interval", "0"],
    "grpo.importance_decay": ["--grpo-importance-decay", "1.0"], "grpo.hysteresis": ["--grpo-hysteresis", "1.0"],
    "grpo.compressor": ["--grpo-compressor", "int3"], "grpo.compress_chunk": ["--grpo-compress-chunk", "0"],
    "grpo.core_compressor": ["--grpo-core-compressor", "topk"],
    "grpo.topk_ratio": ["--grpo-topk-ratio", "0"], "grpo.compress_param_gather": None,
    "grpo.powersgd_rank": ["--grpo-powersgd-rank", "0"],
    "grpo.importance_score": ["--grpo-importance-score", "hessian"],
    "grpo.tier_policy": ["--grpo-tier-policy", "best"],
    "grpo.stable_interval": ["--grpo-stable-interval", "-1"], "grpo.stable_mode": ["--grpo-stable-mode", "lazy"],
    "grpo.stable_compressor": ["--grpo-stable-compressor", "int3"],
    "grpo.gvr_interval": ["--grpo-gvr-interval", "0"], "grpo.gvr_min": ["--grpo-gvr-min", "0"],
    "grpo.gvr_max": ["--grpo-gvr-max", "0.5"], "grpo.max_compression_error": ["--grpo-max-compression-error", "0"],
    "grpo.gvr_window": ["--grpo-gvr-window", "0"], "grpo.remediation_promote": ["--grpo-remediation-promote", "0"],
    "grpo.sparse_gradient_tier": ["--grpo-sparse-gradient-tier", "all"],
    "grpo.max_dynamic_share": ["--grpo-max-dynamic-share", "1.5"],
    "grpo.core_sync_interval": ["--grpo-core-sync-interval", "0"],
    "grpo.dynamic_sync_interval": ["--grpo-dynamic-sync-interval", "0"],
    "grpo.outer_lr": ["--grpo-outer-lr", "0"], "grpo.outer_momentum": ["--grpo-outer-momentum", "1.0"],
    "grpo.internode_preset": ["--grpo-internode-preset", "diloco"],
    "grpo.release_grads": None, "grpo.first_batch_overlap": None,
    "grpo.grad_units_in_flight": ["--grpo-grad-units-in-flight", "0"],
    "grpo.grad_accumulation": ["--grpo", "--grpo-grad-accumulation", "cpu"],
    "grpo.residual_dtype": ["--grpo-residual-dtype", "fp16"],
    "grpo.sampled_backward": None,
    "grpo.sample_variance_budget": ["--grpo-sample-variance-budget", "0"],
    "grpo.sample_min_keep": ["--grpo-sample-min-keep", "0"],
    "grpo.sample_max_keep": ["--grpo-sample-max-keep", "1.5"],
    "grpo.compress": ["--grpo-compress", "sometimes"],
    "grpo.compress_ab_steps": ["--grpo-compress-ab-steps", "-1"],
    "grpo.sample_interval": ["--grpo-sample-interval", "0"],
    "grpo.sample_dgrad": ["--grpo-sample-dgrad", "all"],
    "grpo.sample_policy": ["--grpo-sample-policy", "random"],
    "offload.target": ["--grpo", "--grpo-offload", "disk"], "offload.stream": None,
    "offload.residuals": None, "offload.grads": None,
    "offload.core": ["--grpo", "--grpo-offload", "cpu", "--grpo-offload-core", "--no-grpo-offload-stream"],
    "offload.offload_dir": ["--grpo", "--grpo-offload", "ssd"],  # ssd without a directory
    "offload.chunk_mb": ["--grpo-offload-chunk-mb", "0"],
    "offload.fallback": ["--grpo-offload-fallback", "warn"],
    "offload.io_workers": ["--grpo-offload-io-workers", "0"],
    "offload.staging_buffers": ["--grpo-offload-staging-buffers", "0"],
    "offload.capacity": ["--grpo-offload-capacity", "-1"],
    "offload.io_mode": ["--grpo-offload-io-mode", "async"],
    "offload.memory_budget_gb": ["--grpo", "--grpo-memory-budget-gb", "-1"],
}
# Once accepted by parse_args out of range: megatron or torch failed at build time with a raw
# traceback or an unnamed error, or the run trained on (--lr-decay-iters 0, --ddp-bucket-size 0).
LATE_FAILURES = {"model.ffn_hidden_size", "model.init_method_std", "parallel.ddp_bucket_size",
                 "optimizer.lr_decay_iters", "optimizer.weight_decay", "optimizer.adam_beta1",
                 "optimizer.adam_beta2", "optimizer.adam_eps", "training.seed"}
# Checked when the run starts (before the process group), not by parse_args.
AT_RUN_START = {"logging.check_weight_hash_interval"}
# A YAML mapping or list for a str field (free-form paths and names included) is a type error.
WRONG_TYPE = {int: "two", float: "fast", bool: "maybe", str: {"a": 1}}


def _fields():
    out = []
    for section, sub, prefix in _sections(PretrainConfig()):
        hints = typing.get_type_hints(type(sub))
        for f in dataclasses.fields(sub):
            base, is_list = _base_type(hints[f.name])
            out.append((f"{section}.{f.name}", flag_name(f.name, prefix, getattr(sub, "FLAG_NAMES", None)),
                        base, is_list))
    return out


def _refusal(argv, tmp_path=None, yaml_text=None, data=True):
    """The ConfigError message (or the run-start check's), or None if accepted."""
    if yaml_text is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml_text)
        argv = ["--config", str(path), *argv]
    try:
        cfg = parse_args([*argv, *DATA] if data else list(argv), world_size=2)
    except ConfigError as exc:
        return str(exc).replace(str(tmp_path) + "/", "") if tmp_path else str(exc)
    from megatron_grpo.training import weight_check

    try:
        weight_check.validate_interval(cfg.logging.check_weight_hash_interval)
    except ConfigError as exc:
        return f"(at run start) {exc}"
    return None


def test_every_field_is_covered():
    names = {n for n, *_ in _fields()}
    assert names == set(RANGE), (f"fields without a case: {sorted(names - set(RANGE))}; "
                                 f"cases without a field: {sorted(set(RANGE) - names)}")


def test_every_invalid_field_is_refused_naming_it(tmp_path, table):
    import yaml

    for name, flag, base, is_list in _fields():
        key = flag[2:]
        bad = 5 if is_list else WRONG_TYPE[base]
        type_msg = _refusal([], tmp_path, yaml.safe_dump({key: bad}, default_flow_style=True).strip(),
                            data=name != "data.data_path")
        argv = RANGE[name]
        range_msg = _refusal(argv, data=name != "data.data_path") if argv is not None else None
        type_ok = type_msg is not None and key in type_msg and repr(bad) in type_msg
        range_ok = argv is None or (range_msg is not None and flag in range_msg)
        assert type_ok, f"{name}: YAML {key}: {bad!r} -> {type_msg!r}"
        if argv is not None:
            assert range_ok, f"{name}: {' '.join(argv) or '(no --data-path)'} -> {range_msg!r}"
        tried = f"YAML `{key}: {bad!r}`" + (f"; flags `{' '.join(argv) or '(no --data-path)'}`" if argv is not None else "")
        happened = f"YAML: {type_msg}"
        if argv is not None:
            happened += f"; flags: {range_msg}"
        table.row(GROUP + ", field by field", f"`{flag}` ({name}): {tried}",
                  "ConfigError naming the flag/key and the value, before any process group", happened)


def test_invalid_flag_through_the_launcher(tmp_path, table):
    job = run_job(tmp_path / "job", 1, ["--grpo", "--grpo-compressor", "int3", *DATA], probe=False,
                  timeout=120)
    said = first_line(job.err, "error (rank 0 on")
    assert job.rc == 1 and said.endswith("--grpo-compressor must be one of int4, int8, topk, powersgd, got 'int3'"), job.err[-3000:]
    summary = torchrun_failure(job.err)
    assert "exitcode 2" in summary
    assert "Traceback" not in job.err.split("Root Cause")[0].split("error (rank 0")[0]
    table.row(GROUP, "torchrun --nproc_per_node 1 launch/pretrain_gpt.py --grpo --grpo-compressor int3",
              "one line naming rank, host, flag and value; the rank exits 2",
              f"\"{said}\"; the rank exited 2 ({summary}); torchrun rc {job.rc}; {job.seconds:.1f} s, "
              f"no traceback from the rank")


@pytest.mark.reliability_slow
@pytest.mark.parametrize("name", sorted(LATE_FAILURES))
def test_once_unchecked_field_through_the_launcher(stdlib_data, tmp_path, table, name):
    import socket

    from harness import SMALL_MODEL

    argv = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", "3", "--eval-iters", "0",
            *RANGE[name], "--metrics-file", str(tmp_path / "m.jsonl")]
    with pytest.raises(ConfigError) as refused:  # what parse_args says in-process, same argv
        parse_args(argv, world_size=1)
    message = str(refused.value)
    assert message.startswith(RANGE[name][0] + " must be"), message
    job = run_job(tmp_path / "job", 1, argv, probe=False, timeout=180)
    said = first_line(job.err, "error (rank 0 on")
    assert said == f"error (rank 0 on {socket.gethostname()}): {message}", job.err[-3000:]
    summary = torchrun_failure(job.err)
    assert job.rc == 1 and "exitcode 2" in summary, job.err[-3000:]
    assert "Traceback" not in job.err.split("Root Cause")[0].split("error (rank 0")[0], job.err[-3000:]
    assert not (tmp_path / "m.jsonl").exists() and not job.leftovers  # no iteration, no process left
    table.row(GROUP, f"launcher, 1 rank, `{' '.join(RANGE[name])}` (once accepted by parse_args, "
                     f"then a raw error or a silent run)",
              "refused before training, naming the flag", f"\"{said}\"; the rank exited 2 ({summary}); "
              f"torchrun rc {job.rc}; no metrics file (no iteration); {job.seconds:.1f} s")
