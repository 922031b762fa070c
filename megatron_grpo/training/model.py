"""Builders: process groups, megatron-core GPTModel, DDP, optimizer and lr schedule.

Only real megatron-core classes are built here; on CPU they run under CPU mode
(megatron_grpo.platform.cpu), which must be enabled before this module builds anything.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.platform import Platform
from megatron_grpo.platform.ports import free_port as _free_port
from megatron_grpo.training.config import PretrainConfig


def init_distributed(platform: Platform, timeout_s: int = 600) -> None:
    """Join the torchrun job (env:// rendezvous). A single process gets a 1-rank group,
    because megatron's dataset builder and optimizer call torch.distributed unconditionally."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group(platform.backend, timeout=datetime.timedelta(seconds=timeout_s))


def padded_vocab_size(vocab_size: int, cfg: PretrainConfig) -> int:
    """Megatron-LM's rule: pad to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def cuda_build_settings(cfg: PretrainConfig, platform: Platform):
    """Initialisation and fusions (megatron_grpo.training.cuda_settings): Megatron-LM's on CUDA,
    limited to the kernels that import here; CPU mode's fixed ones otherwise."""
    from megatron_grpo.training.cuda_settings import build_settings, probe_kernels

    if platform.cpu_mode:
        return build_settings(cfg, on_cuda=False)
    return build_settings(cfg, on_cuda=True, kernels=probe_kernels())


def transformer_config(cfg: PretrainConfig, platform: Platform, settings=None):
    """megatron's TransformerConfig; ``settings`` (a cuda_settings.BuildSettings) defaults to
    cuda_build_settings(cfg, platform)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if settings is None:
        settings = cuda_build_settings(cfg, platform)
    m, p = cfg.model, cfg.parallel
    dtype = torch.bfloat16 if cfg.training.bf16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=cfg.training.bf16,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        num_query_groups=m.num_query_groups,
        gated_linear_unit=m.swiglu,  # SwiGLU = a gated unit with SiLU (megatron's default is GeLU)
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        normalization=m.normalization,
        add_bias_linear=not m.disable_bias_linear,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        sequence_parallel=p.sequence_parallel,
        # Where weights are made and which fusions run: on CUDA as Megatron-LM (device init,
        # every fusion whose kernel imports), in CPU mode host init and no fusion (the local
        # spec's unfused paths are exact on CPU). Layout-independent weights on CUDA come from
        # the seed checkpoint (cuda_settings' docstring).
        **settings.kwargs(),
        # No CUDA graphs; megatron 0.16.1's default scope "full" only warns that it is deprecated.
        cuda_graph_scope=[],
    )


def layer_spec(platform: Platform, normalization: str = "LayerNorm"):
    """Transformer-engine spec when TE is importable on CUDA, megatron's local spec otherwise
    (whose norm is chosen by the spec: RMSNorm needs asking for)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if not platform.cpu_mode:
        try:
            import transformer_engine  # noqa: F401

            return specs.get_gpt_layer_with_transformer_engine_spec(), "transformer_engine"
        except ImportError:
            pass
    return specs.get_gpt_layer_local_spec(normalization=normalization), "local"


@dataclass
class BuiltModel:
    """Everything the training loop needs, as megatron-core built it."""

    ddp_model: list
    """Model chunks wrapped in megatron DDP (one chunk: no virtual pipeline)."""
    optimizer: object
    """megatron optimizer (DistributedOptimizer inside a ChainedOptimizer or alone)."""
    scheduler: object
    """megatron OptimizerParamScheduler."""
    tf_config: object
    """megatron TransformerConfig."""
    vocab_size: int
    """Padded vocabulary size of the model."""
    num_params: int
    """Parameters held by this rank."""
    spec_name: str
    """'local' or 'transformer_engine'."""
    settings: object = None
    """cuda_settings.BuildSettings the model was built with (initialisation, fusions)."""


def build_gpt_model(cfg: PretrainConfig, platform: Platform, tokenizer_vocab_size: int,
                    padded_vocab: Optional[int] = None, settings=None):
    """The megatron-core GPTModel of this rank's pipeline stage (CPU mode: on the host, not yet
    moved; CUDA: on the device): (model, TransformerConfig, spec name, padded vocabulary).
    ``padded_vocab`` overrides the padding rule (a converter building a checkpoint's model at
    another TP size); ``settings`` as transformer_config's."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    tf_config = transformer_config(cfg, platform, settings)
    spec, spec_name = layer_spec(platform, cfg.model.normalization)
    if spec_name == "local" and cfg.parallel.sequence_parallel:
        from megatron_grpo.training.arguments import ConfigError

        # megatron's torch norms (the local spec: CPU mode, or CUDA without transformer-engine)
        # assert on it deep inside the model build; say so first, naming the flag.
        raise ConfigError(f"rank {torch.distributed.get_rank()}: --sequence-parallel needs the "
                          f"transformer-engine layer spec (CUDA with transformer-engine installed): "
                          f"megatron-core's local spec norms do not support it")
    vocab = padded_vocab or padded_vocab_size(tokenizer_vocab_size, cfg)
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=cfg.model.max_position_embeddings or cfg.model.seq_length,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base,
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    return model, tf_config, spec_name, vocab


def build_model(cfg: PretrainConfig, platform: Platform, tokenizer_vocab_size: int,
                optimizer_factory=None, ddp_class=None, bucket_size=None) -> BuiltModel:
    """GPTModel -> megatron DDP -> megatron optimizer (or ``optimizer_factory``'s)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    settings = cuda_build_settings(cfg, platform)
    if not platform.cpu_mode:  # before the build: a model too big for unfused attention is named
        _report_cuda_build(cfg, settings, layer_spec(platform)[1], tokenizer_vocab_size)
    model, tf_config, spec_name, vocab = build_gpt_model(cfg, platform, tokenizer_vocab_size,
                                                         settings=settings)
    if not platform.cpu_mode:
        # megatron built the weights on the current device (select_platform set it); this moves
        # anything a module made on the host.
        model = model.to(platform.device)
    num_params = sum(p.numel() for p in model.parameters())
    if cfg.training.bf16:
        from megatron.core.transformer.module import Float16Module

        # As Megatron-LM does: cast inputs to bf16 on the first stage and outputs back to fp32
        # on the last; the distributed optimizer keeps fp32 master weights.
        model = Float16Module(tf_config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        bucket_size=bucket_size or cfg.parallel.ddp_bucket_size,
        num_distributed_optimizer_instances=cfg.parallel.num_distributed_optimizer_instances,
    )
    ddp = (ddp_class or DistributedDataParallel)(tf_config, ddp_config, model)
    o = cfg.optimizer
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=cfg.training.bf16,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    factory = optimizer_factory or (lambda oc, chunks: get_megatron_optimizer(oc, chunks))
    optimizer = factory(opt_config, [ddp])
    scheduler = build_scheduler(cfg, optimizer)
    # The pipeline schedules call these hooks: grad sync on the last micro-batch only,
    # cross-rank grad finalisation, and loss scaling (1.0 in fp32/bf16).
    tf_config.no_sync_func = ddp.no_sync
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.grad_scale_func = optimizer.scale_loss
    return BuiltModel([ddp], optimizer, scheduler, tf_config, vocab, num_params, spec_name, settings)


def _report_cuda_build(cfg: PretrainConfig, settings, spec_name: str, vocab: int) -> None:
    """Rank 0, at start-up: the fusions (each one off with its reason), where the weights were
    made, and WARNING lines (unfused attention that costs memory, CUDA_DEVICE_MAX_CONNECTIONS)."""
    import sys

    from megatron_grpo.training.cuda_settings import startup_warnings

    if dist.get_rank() != 0:
        return
    name = cfg.logging.run_name
    for line in settings.describe():
        print(f"[{name}] {line}", flush=True)
    for line in startup_warnings(cfg, spec_name, vocab, os.environ):
        print(f"[{name}] WARNING: {line}", file=sys.stderr, flush=True)


def build_scheduler(cfg: PretrainConfig, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, t = cfg.optimizer, cfg.training
    decay_iters = o.lr_decay_iters or t.train_iters
    # The scheduler counts samples when given sample counts; we step it once per iteration with
    # increment=global_batch_size, as Megatron-LM does.
    g = t.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters * g,
        lr_decay_steps=max(decay_iters, o.lr_warmup_iters + 1) * g,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay_iters * g,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )


def instances_per_node(world: int, tp: int, pp: int, per_node: Optional[int]) -> int:
    """--num-distributed-optimizer-instances 0: one instance per node that a pipeline stage's
    ranks span (megatron's rank order puts TP innermost, then DP, then PP; a stage is
    world / pp consecutive ranks and an instance consecutive data-parallel ranks)."""
    dp = world // (tp * pp)
    stage = world // pp
    if per_node is None or stage <= per_node:
        return 1  # one node (or unknown: then one instance, megatron's default)
    if stage % per_node or per_node % tp or dp % (stage // per_node):
        raise ValueError(f"--num-distributed-optimizer-instances 0 (one per node): a pipeline stage's "
                         f"{stage} ranks do not split into whole nodes of {per_node} ranks with "
                         f"TP {tp} and data-parallel size {dp}; give the instance count")
    return stage // per_node


def model_parallel_init(cfg: PretrainConfig) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if cfg.parallel.num_distributed_optimizer_instances == 0:
        from megatron_grpo.comm.wire import ranks_per_node

        world = torch.distributed.get_world_size()
        rank = torch.distributed.get_rank()
        try:
            n = instances_per_node(world, cfg.parallel.tensor_model_parallel_size,
                                   cfg.parallel.pipeline_model_parallel_size, ranks_per_node())
        except ValueError as exc:
            raise ValueError(f"rank {rank}: {exc}") from None
        cfg.parallel.num_distributed_optimizer_instances = n  # recorded as resolved
        if rank == 0:
            print(f"[run] distributed-optimizer instances: one per node -> {n}", flush=True)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
            # Megatron's default (30 min) would bound every data/tensor/pipeline-parallel
            # collective, the step's own included: without this a hung peer goes unreported for
            # 30 min whatever --distributed-timeout-minutes says. timedelta(minutes=) takes floats.
            distributed_timeout_minutes=cfg.parallel.distributed_timeout_minutes,
            num_distributed_optimizer_instances=cfg.parallel.num_distributed_optimizer_instances,
        )
    # Seeds the default generator (CPU init) and megatron's model-parallel RNG tracker, so
    # replicated weights are equal on every TP rank and TP-split ones come from one full tensor.
    torch.manual_seed(cfg.training.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.training.seed)


def optimizer_list(optimizer) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def unwrap(chunk):
    return getattr(chunk, "module", chunk)


def data_parallel_info() -> tuple:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def is_metrics_rank() -> bool:
    """The rank that holds the loss and writes metrics: last PP stage, TP rank 0, DP rank 0."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0)


def optional_device_peak(platform: Platform) -> Optional[int]:
    """Peak allocated device memory since the previous call (then reset), None on CPU."""
    if platform.cpu_mode:
        return None
    peak = int(torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
    return peak
