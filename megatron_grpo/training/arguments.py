"""Command line + YAML -> PretrainConfig, with errors that name the flag.

Precedence: dataclass defaults < ``--config FILE.yaml`` < flags given on the command line.
Flags are generated from the config dataclasses, so a new field is a new flag with its
docstring as help text.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
import typing
from typing import Any, Dict, List, Optional, Sequence

import yaml

from megatron_grpo.grpo.config import ConfigError  # noqa: F401 - defined low so every layer can raise it
from megatron_grpo.training.config import SECTIONS, PretrainConfig


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")


def field_docs(cls) -> Dict[str, str]:
    """Docstrings written under dataclass fields (``x: int = 1`` followed by ``\"\"\"doc\"\"\"``)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: Dict[str, str] = {}
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_name(field_name: str, prefix: str = "", overrides: Optional[Dict[str, str]] = None) -> str:
    if overrides and field_name in overrides:
        return overrides[field_name]
    return "--" + prefix + field_name.replace("_", "-")


def _base_type(tp):
    """(scalar type, is_list) for Optional[X], List[X] and X annotations."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, List):
        return typing.get_args(tp)[0], True
    return tp, False


def _sections(cfg) -> List[tuple]:
    """(section name, dataclass instance, flag prefix) for every section of ``cfg``."""
    out = []
    for name in getattr(cfg, "SECTION_ORDER", SECTIONS):
        sub = getattr(cfg, name)
        out.append((name, sub, getattr(sub, "FLAG_PREFIX", "")))
    return out


def build_parser(cfg: PretrainConfig, prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="megatron-grpo GPT pretraining",
                                     allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file with any of the fields below; "
                        "flags given on the command line override it.")
    for section, sub, prefix in _sections(cfg):
        add_section(parser, section, sub, prefix)
    return parser


def add_section(parser: argparse.ArgumentParser, section: str, sub, prefix: str,
                title: Optional[str] = None) -> None:
    """One argument group of ``parser`` (headed ``title``, default the section's name) with a
    flag per field of the dataclass ``sub``, stored as ``<section>.<field>`` (absent unless
    given). Also used on Megatron-LM's own parser (megatron_grpo.megatron_lm.flags)."""
    group = parser.add_argument_group(title or section)
    docs = field_docs(type(sub))
    hints = typing.get_type_hints(type(sub))
    for f in dataclasses.fields(sub):
        base, is_list = _base_type(hints[f.name])
        # argparse %-formats help text; docstrings quote figures in percent.
        kw: Dict[str, Any] = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS,
                                  help=docs.get(f.name, "").replace("%", "%%"))
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = base
            kw["metavar"] = base.__name__.upper()
            if is_list:
                kw["nargs"] = "+"
        group.add_argument(flag_name(f.name, prefix, getattr(sub, "FLAG_NAMES", None)), **kw)


def _coerce(value, tp, where: str):
    base, is_list = _base_type(tp)
    if value is None:
        return None
    if is_list:
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, base, where) for v in value]
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if base is str and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
        # A mapping or list would become its str() (a directory named "{'a': 1}"). Numbers stay
        # accepted: YAML reads `run-name: 2024` and the weights of a data-path list as numbers.
        raise ConfigError(f"{where}: expected str, got {value!r}")
    try:
        if base is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return base(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {base.__name__}, got {value!r}") from None


def _closest(word: str, candidates, cutoff: float = 0.6) -> Optional[str]:
    """The candidate most like ``word`` (difflib), or None when nothing is close."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return match[0] if match else None


def _yaml_error_text(path: str, exc: yaml.YAMLError) -> str:
    """One line naming file, line and column: ``--config F:LINE:COL: not valid YAML: problem``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
    problem = getattr(exc, "problem", None)
    if problem:
        context = getattr(exc, "context", None)
        cmark = getattr(exc, "context_mark", None)
        if context and cmark is not None and mark is not None and cmark.line != mark.line:
            context += f" that starts at line {cmark.line + 1}, column {cmark.column + 1}"
        what = f"{problem} ({context})" if context else problem
    else:
        what = str(exc)
    return f"--config {where}: not valid YAML: {' '.join(what.split())}"


def _key_lines(text: str) -> Dict[str, int]:
    """1-based line of every top-level key of a YAML mapping (for error messages)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}


def _apply_yaml(cfg: PretrainConfig, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    with open(path) as fh:
        text = fh.read()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error_text(path, exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: top level must be a mapping of flag names to values")
    lines = _key_lines(text)
    index = {}
    for section, sub, prefix in _sections(cfg):
        for f in dataclasses.fields(sub):
            flag = flag_name(f.name, prefix, getattr(sub, "FLAG_NAMES", None))
            index[flag[2:].replace("-", "_")] = (section, sub, f)
    hints_cache: Dict[type, dict] = {}
    for key, value in data.items():
        where = f"{path}:{lines[str(key)]}" if str(key) in lines else path
        norm = str(key).replace("-", "_")
        if norm not in index:
            close = _closest(norm, index)
            hint = ";"
            if close is not None:
                # Suggest in the file's own spelling (hyphens or underscores).
                hint = f"; did you mean '{close if '_' in str(key) else close.replace('_', '-')}'?"
            raise ConfigError(f"--config {where}: unknown setting '{key}' (flag "
                              f"{flag_name(norm)} does not exist{hint} see --help)")
        section, sub, f = index[norm]
        hints = hints_cache.setdefault(type(sub), typing.get_type_hints(type(sub)))
        setattr(sub, f.name, _coerce(value, hints[f.name], f"--config {where}: '{key}'"))


def _unknown_flags_text(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """``unknown flag(s): ...`` with the closest valid flag for each unknown one."""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    hints = []
    for token in unknown:
        if not token.startswith("--"):
            continue  # a value that followed an unknown flag
        name = token.split("=", 1)[0]
        close = _closest(name, known)
        if close is not None:
            hints.append((name, close))
    text = f"unknown flag(s): {' '.join(unknown)}"
    if len(hints) == 1:
        text += f"; did you mean {hints[0][1]}?"
    elif hints:
        text += "; did you mean " + ", ".join(f"{c} for {n}" for n, c in hints) + "?"
    return text + " (see --help for accepted flags)"


def parse_args(argv: Optional[Sequence[str]] = None, cfg: Optional[PretrainConfig] = None,
               world_size: Optional[int] = None) -> PretrainConfig:
    """Parse ``argv`` into ``cfg`` (a fresh PretrainConfig by default) and validate it."""
    cfg = cfg if cfg is not None else PretrainConfig()
    parser = build_parser(cfg)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(_unknown_flags_text(parser, unknown))
    if args.config:
        _apply_yaml(cfg, args.config)
    for dest, value in vars(args).items():
        if dest == "config":
            continue
        section, name = dest.split(".", 1)
        setattr(getattr(cfg, section), name, value)
    validate(cfg, world_size)
    return cfg


def validate(cfg: PretrainConfig, world_size: Optional[int] = None) -> None:
    """Raise ConfigError naming the flag for any inconsistent setting."""
    m, p, o, t, d, c, lg = (cfg.model, cfg.parallel, cfg.optimizer, cfg.training, cfg.data,
                            cfg.checkpoint, cfg.logging)
    positive = {
        "--num-layers": m.num_layers, "--hidden-size": m.hidden_size,
        "--num-attention-heads": m.num_attention_heads, "--seq-length": m.seq_length,
        "--micro-batch-size": t.micro_batch_size, "--global-batch-size": t.global_batch_size,
        "--tensor-model-parallel-size": p.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": p.pipeline_model_parallel_size,
        "--log-interval": lg.log_interval, "--eval-interval": lg.eval_interval,
        "--make-vocab-size-divisible-by": m.make_vocab_size_divisible_by,
    }
    for flag, value in positive.items():
        if value is None or value <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    optional_positive = {"--ffn-hidden-size": m.ffn_hidden_size, "--ddp-bucket-size": p.ddp_bucket_size,
                         "--lr-decay-iters": o.lr_decay_iters}
    for flag, value in optional_positive.items():  # None: the default the field's help names
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if not 0 <= t.seed <= 2**32 - 1:  # numpy's and megatron's seed range
        raise ConfigError(f"--seed must be an integer in [0, 2**32 - 1], got {t.seed}")
    if p.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes must be > 0, got {p.distributed_timeout_minutes}")
    if p.num_distributed_optimizer_instances < 0:
        raise ConfigError(f"--num-distributed-optimizer-instances must be >= 0 (0: one per node), "
                          f"got {p.num_distributed_optimizer_instances}")
    if p.num_distributed_optimizer_instances != 1 and not p.use_distributed_optimizer:
        raise ConfigError("--num-distributed-optimizer-instances other than 1 is megatron's partial "
                          "distributed optimizer: it needs --use-distributed-optimizer")
    if t.train_iters < 0:
        raise ConfigError(f"--train-iters must be >= 0, got {t.train_iters}")
    if c.load and c.init_from:
        raise ConfigError("--load (resume a run) and --init-from (start from weights) exclude each "
                          "other; give one")
    if lg.eval_iters < 0:
        raise ConfigError(f"--eval-iters must be >= 0, got {lg.eval_iters}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size ({m.hidden_size}) must be divisible by "
                          f"--num-attention-heads ({m.num_attention_heads})")
    if m.num_attention_heads % p.tensor_model_parallel_size:
        raise ConfigError(f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                          f"--tensor-model-parallel-size ({p.tensor_model_parallel_size})")
    if m.num_query_groups is not None:
        if m.num_query_groups <= 0 or m.num_attention_heads % m.num_query_groups:
            raise ConfigError(f"--num-query-groups must be a positive divisor of --num-attention-heads "
                              f"({m.num_attention_heads}), got {m.num_query_groups}")
        if m.num_query_groups % p.tensor_model_parallel_size:
            raise ConfigError(f"--num-query-groups ({m.num_query_groups}) must be divisible by "
                              f"--tensor-model-parallel-size ({p.tensor_model_parallel_size})")
    if m.recompute_granularity not in (None, "full", "selective"):
        raise ConfigError(f"--recompute-granularity must be full or selective, got {m.recompute_granularity!r}")
    if m.recompute_granularity == "full":
        if m.recompute_method not in ("uniform", "block"):
            raise ConfigError(f"--recompute-method must be uniform or block with --recompute-granularity "
                              f"full, got {m.recompute_method!r}")
        if m.recompute_num_layers is None or m.recompute_num_layers <= 0:
            raise ConfigError(f"--recompute-num-layers must be a positive integer with "
                              f"--recompute-granularity full, got {m.recompute_num_layers}")
    elif m.recompute_method is not None or m.recompute_num_layers is not None:
        raise ConfigError("--recompute-method and --recompute-num-layers go with --recompute-granularity "
                          "full; give it or drop them")
    if p.sequence_parallel and p.tensor_model_parallel_size < 2:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size >= 2")
    if m.normalization not in NORMALIZATIONS:
        raise ConfigError(f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got {m.normalization!r}")
    if m.position_embedding_type not in POSITION_EMBEDDINGS:
        raise ConfigError(f"--position-embedding-type must be one of {', '.join(POSITION_EMBEDDINGS)}, "
                          f"got {m.position_embedding_type!r}")
    if m.rotary_base <= 0:
        raise ConfigError(f"--rotary-base must be a positive integer, got {m.rotary_base}")
    if p.pipeline_model_parallel_layout is not None:
        _check_layout(p.pipeline_model_parallel_layout, p.pipeline_model_parallel_size, m.num_layers)
    elif m.num_layers % p.pipeline_model_parallel_size:
        raise ConfigError(f"--num-layers ({m.num_layers}) must be divisible by "
                          f"--pipeline-model-parallel-size ({p.pipeline_model_parallel_size})")
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ConfigError(f"--max-position-embeddings ({m.max_position_embeddings}) must be >= "
                          f"--seq-length ({m.seq_length})")
    for flag, value in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {value}")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"--lr must be > 0 and 0 <= --min-lr <= --lr (got lr={o.lr}, min_lr={o.min_lr})")
    if o.lr_warmup_iters < 0:
        raise ConfigError(f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
    if o.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"--lr-decay-style must be cosine, linear or constant, got {o.lr_decay_style!r}")
    if o.clip_grad < 0:
        raise ConfigError(f"--clip-grad must be >= 0, got {o.clip_grad}")
    # Written as "not (in range)" so that nan is refused too.
    if not m.init_method_std > 0:
        raise ConfigError(f"--init-method-std must be > 0, got {m.init_method_std}")
    if not o.weight_decay >= 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {o.weight_decay}")
    for flag, value in (("--adam-beta1", o.adam_beta1), ("--adam-beta2", o.adam_beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {value}")
    if not o.adam_eps > 0:
        raise ConfigError(f"--adam-eps must be > 0, got {o.adam_eps}")
    if not d.data_path:
        raise ConfigError("--data-path is required (a prefix written by launch/preprocess_data.py)")
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
        if len(parts) != 3 or min(parts) < 0 or parts[0] <= 0 or parts[1] <= 0:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--split must be three non-negative numbers 'train,valid,test' with train "
                          f"and valid > 0, got {d.split!r}") from None
    if c.save_interval is not None and c.save_interval <= 0:
        raise ConfigError(f"--save-interval must be a positive integer, got {c.save_interval}")
    if c.save_interval is not None and not c.save:
        raise ConfigError("--save-interval needs --save DIR")
    if c.overwrite_checkpoints and not c.save:
        raise ConfigError("--overwrite-checkpoints lets saves replace verified checkpoints: it needs --save DIR")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler (this run's lr schedule and Adam settings win over a "
                          "checkpoint's) and --use-checkpoint-opt_param-scheduler (the checkpoint's win) "
                          "exclude each other; give one")
    if t.exit_after_iter is not None and t.exit_after_iter <= 0:
        raise ConfigError(f"--exit-after-iter must be positive, got {t.exit_after_iter}")
    if t.max_consecutive_skipped_steps < 0:
        raise ConfigError(f"--max-consecutive-skipped-steps must be >= 0 (0: never stop), "
                          f"got {t.max_consecutive_skipped_steps}")
    if world_size is not None:
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        if world_size % mp:
            raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size"
                              f" x --pipeline-model-parallel-size = {mp}")
        dp = world_size // mp
        if p.num_distributed_optimizer_instances and dp % p.num_distributed_optimizer_instances:
            raise ConfigError(f"--num-distributed-optimizer-instances ({p.num_distributed_optimizer_instances}) "
                              f"must divide the data-parallel size ({dp} = world size {world_size} / "
                              f"(TP x PP = {mp}))")
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ConfigError(f"--global-batch-size ({t.global_batch_size}) must be a multiple of "
                              f"--micro-batch-size x data-parallel size ({t.micro_batch_size} x {dp})")
    validate_grpo(cfg.grpo, cfg.offload, world_size)
    if (cfg.grpo.enabled and not cfg.model.untie_embeddings_and_output_weights
            and cfg.parallel.pipeline_model_parallel_size > 1):
        # The tied copies on the first and last stage are two GRPO units that may land in
        # different tiers (one frozen, one stepped) and drift apart; not supported.
        raise ConfigError("--grpo with --no-untie-embeddings-and-output-weights needs "
                          "--pipeline-model-parallel-size 1: the tied embedding's copies on the first "
                          "and last pipeline stage would be tiered apart. Untie the output layer "
                          "(--untie-embeddings-and-output-weights) or run PP 1")
    if cfg.grpo.enabled and cfg.grpo.periodic:
        # Local updates need instances to be local to: megatron's partial distributed optimizer.
        if p.num_distributed_optimizer_instances == 1:
            raise ConfigError(_periodic_flags(cfg.grpo) + " train tiers locally inside a "
                              "distributed-optimizer instance and sync them across instances: set "
                              "--num-distributed-optimizer-instances N > 1 (0: one per node)")
        if cfg.offload.target != "none":
            raise ConfigError(f"--grpo-offload {cfg.offload.target} with {_periodic_flags(cfg.grpo)}: "
                              f"the memory tier streams optimizer state the outer sync reads; "
                              f"use one or the other")
    if cfg.offload.target != "none" and not cfg.grpo.enabled:
        raise ConfigError(f"--grpo-offload {cfg.offload.target} places GRPO's stable tier: it "
                          f"needs --grpo (the megatron baseline has no tiers)")


def validate_grpo(grpo, offload, world_size: Optional[int] = None) -> None:
    """GRPO's and the memory tier's own checks (the preset applied first), as a ConfigError
    naming the flag; the project's entry and the Megatron-LM runner both call it."""
    from megatron_grpo.grpo.config import GRPOConfigError
    from megatron_grpo.offload.config import OffloadConfigError

    try:
        grpo.apply_preset()
        grpo.validate(world_size)
        offload.validate(planned=True)
    except (GRPOConfigError, OffloadConfigError) as exc:
        raise ConfigError(str(exc)) from None


def _periodic_flags(grpo) -> str:
    """The flags that made tiers periodic, for error messages."""
    if grpo.internode_preset != "none":
        return f"--grpo-internode-preset {grpo.internode_preset}"
    out = [f"--grpo-{t}-sync-interval {grpo.sync_interval(t)}" for t in ("core", "dynamic")
           if grpo.sync_interval(t) > 1]
    if grpo.stable_local:
        out.append("--grpo-stable-mode local")
    return " and ".join(out)


def _check_layout(layout: str, pp: int, num_layers: int) -> None:
    """megatron parses --pipeline-model-parallel-layout with bare asserts deep in the model
    build; check it here with megatron's own parser so a bad layout is refused by name."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    flag = f"--pipeline-model-parallel-layout {layout!r}"
    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
        if len(stages) != pp:
            raise ConfigError(f"{flag} has {len(stages)} stages; --pipeline-model-parallel-size is {pp} "
                              f"(one stage per pipeline rank: virtual pipeline stages are not supported)")
        PipelineParallelLayerLayout(layout, pp).validate_layer_layout(num_layers, None)
    except AssertionError as e:
        raise ConfigError(f"{flag}: {e}. Write the stages separated by '|' with E (embedding, first), "
                          f"t (transformer layer; --num-layers {num_layers} of them) and L (loss, last), "
                          f"e.g. 'E|t*{num_layers},L' for 2 stages") from None
