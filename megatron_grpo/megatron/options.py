"""Which megatron-core DDP, model and optimizer options GRPO runs under, and which it refuses.

Each option a Megatron user may set is either carried correctly (and tested) or refused before
GRPO changes anything (``install``, ``get_grpo_optimizer``), naming the option, the rank and
what to do; one that only a GRPO feature cannot carry is refused, at the latest, when the
optimizer is bound (``bind``) or the memory tier built (``build_placement``), before step 1.
Nothing is half supported: a run that starts does not crash or go wrong later.

* ``grad_reduce_in_fp32=False`` with bf16/fp16 parameters (Megatron-LM without
  ``--accumulate-allreduce-grads-in-fp32``): the gradient buffers are bf16. Error feedback keeps
  fp32 residuals and adds them into the buffer, and the compressed sums are fp32; in a bf16
  buffer c = g + r would be rounded to 8 bits of mantissa before it is compressed, which is
  exactly the loss error feedback exists to carry. Refused (fp32 params give fp32 buffers
  whatever the flag says: accepted).
* ``average_in_collective=True``: megatron scales by 1.0 and reduces with ``ReduceOp.AVG``, which
  NCCL implements for floats as a pre-multiplication of every input by 1/n before the sum.
  GRPO's own collectives sum, so they pre-scale by ``sum_scaling_factor`` (1/n there): the same
  place and order as megatron's exact path. Carried.
* context parallelism: megatron reduces gradients over the data-parallel group *with* the
  context-parallel ranks; the controller must use that group (the glue does). A controller
  built on another group is refused, naming ``context_parallel_size``. Carried.
* fp8 parameters (``TransformerConfig.fp8_param``, ``fp8_param_gather``,
  ``reuse_grad_buf_for_mxfp8_param_ag``): megatron's optimizer quantises them in
  ``quantize_param_shard``, which GRPO's parameter copy and compressed gather replace. Refused.
  (fp8 compute with bf16 parameters is unaffected and allowed.)
* fp16 and loss scaling (``TransformerConfig.fp16`` / ``OptimizerConfig.fp16``,
  ``OptimizerConfig.loss_scale``; Megatron-LM ``--fp16``, ``--loss-scale``): megatron's grad
  scaler unscales every parameter's ``grad`` in ``prepare_grads``, but GRPO leaves ``grad=None``
  on held stable units and on shards the memory tier holds away (an AttributeError there), never
  unscales gradients it brings back, and its error-feedback residuals and delayed accumulators
  would carry gradients scaled by a factor that changes from step to step. Refused, naming bf16
  (``--bf16``, no loss scale needed) as the way.
* options of megatron-core 0.17-0.19 (megatron/compat.py), read with ``getattr`` so one rule
  serves every version: ``fp4_param_gather`` (quantised in megatron's parameter copy, as fp8:
  refused); ``param_name_patterns_for_fp32_local_accumulation`` (fp32 ``main_grad`` copies
  beside bf16 buffers, copied in and out around megatron's own collective, which GRPO's
  compressed path replaces: refused, as bf16 buffers are); ``num_buckets`` (the bucket count
  replaces the size GRPO's tier units are cut by: refused, naming ``--grpo-bucket-mb``); GTP
  weight remat (``gtp_weight_remat_size`` > 1: gradients reduced over a replicate group
  GRPO's collectives do not know: refused); ``use_layer_wise_distributed_optimizer`` (not
  megatron's DistributedOptimizer, which GRPO subclasses: refused);
  ``grad_norm_skip_threshold`` (carried: the controller counts such a step as skipped).
* the precision-aware optimizer (``use_precision_aware_optimizer``): the optimizer holds the
  main parameters and reads ``decoupled_grad``, which GRPO's per-tier gradient skipping does not
  clear and its parameter staging does not read. Refused.
* per-token loss (``TransformerConfig.calculate_per_token_loss``, Megatron-LM
  ``--calculate-per-token-loss``): megatron sums gradients over the data-parallel ranks and
  divides the gradient buffer by the step's token count N_t after the sync
  (``finalize_model_grads``, ``scale_gradients``); the count is all-reduced there, after every
  bucket's sync has started. Three GRPO features keep a gradient across that division:

  - error feedback (a tier compressed every step: dynamic, core with
    ``--grpo-core-compressor``, stable with ``--grpo-stable-mode compressed``): the residual r_t
    is what step t's compression held back, in step t's raw token sums (taken before the
    division), and step t+1 adds it into its buffer before the sync, so it is divided by
    N_{t+1}: r_t / N_{t+1} lands where r_t / N_t was owed. Landing it exactly needs N_{t+1}
    when the residual is added, during step t+1's backward, and nothing knows it then.
    Re-owing the mismatch once N_{t+1} is known keeps the sum but grows without bound when
    counts swing by more than 2x from step to step (the owed amount times |1 - N_t/N_{t+1}|
    each step). Refused unless nothing is compressed (one data-parallel rank, or every tier
    exact or periodic, or ``--grpo-compress none``).
  - a delayed stable tier (``--grpo-stable-mode delayed`` and a stable share): a delayed unit's
    gradient is added to its accumulator at the step's end, already divided by its step's
    count, and at the update the sum goes out with the update step's gradient and is divided
    again: 1/(N_t N_T) for the earlier steps. The mean megatron would apply over k steps,
    (1/k) sum_t G_t / N_t, needs the update step's count N_T before its sync starts in
    backward. Refused (a frozen stable tier divides each step's own gradient once, as megatron
    does).
  - gradient shards on the memory tier (``--grpo-offload-grads``): a streamed unit's shard is
    written to host memory or SSD right after its sync, before megatron divides it. Refused when
    the placement is built (megatron/offload.py), before step 1.
* CUDA graphs (``cuda_graph_impl`` other than ``"none"``, ``enable_cuda_graph``,
  ``external_cuda_graph``: whichever the release has) with ``--grpo-sampled-backward``: the
  sampled backward decides in Python at every step which units sample, their keep ratios and
  the rows drawn; a captured graph replays the kernels of the step it was captured in. Refused.
* megatron 0.19's separate grad-norm groups (``grad_norm_group``, multi-token prediction) with
  the memory tier moving gradient shards (``--grpo-offload-grads``): megatron clips such a
  parameter by its group's own norm, but a gradient brought back from the tier is clipped by the
  main norm. Refused when the placement is built (megatron/offload.py), before step 1.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def _loss_scaling_refusal(owner: str, options, rank: int) -> ValueError:
    return ValueError(
        f"rank {rank}: GRPO does not support fp16 training with loss scaling ({', '.join(options)}"
        f" on {owner}; Megatron-LM --fp16 / --loss-scale): megatron's grad scaler unscales "
        f"param.grad, which GRPO's held and offloaded shards do not carry, and error-feedback "
        f"residuals would keep gradients scaled by a changing loss scale. Train in bf16 "
        f"(--bf16, no loss scale) instead")


def sum_scaling_factor(gradient_scaling_factor: float, average_in_collective: bool,
                       dp_size: int) -> float:
    """The factor a rank's gradient is scaled by before a GRPO collective that *sums* over the
    ``dp_size`` data-parallel (with context-parallel) ranks, so the result is what megatron's
    own reduction gives: its bucket's ``gradient_scaling_factor`` and, when megatron averages in
    the collective instead (factor 1.0, ``ReduceOp.AVG``), the 1/dp_size that AVG applies."""
    if average_in_collective:
        return gradient_scaling_factor / dp_size
    return gradient_scaling_factor


def check_ddp_options(ddp_config, tf_config, grad_dtypes: Iterable[torch.dtype],
                      controller_dp_size: Optional[int], ddp_dp_size: Optional[int],
                      rank: int) -> None:
    """Raise ValueError for a DDP model GRPO cannot run correctly (see the module docstring).

    ``grad_dtypes``: dtypes of the gradient buffers of GRPO's buckets; ``controller_dp_size``:
    size of the controller's data-parallel group; ``ddp_dp_size``: size of the group megatron
    reduces gradients over (data-parallel x context-parallel); None skips that comparison."""
    bad = sorted({str(d).replace("torch.", "") for d in grad_dtypes if d != torch.float32})
    if bad:
        raise ValueError(
            f"rank {rank}: GRPO needs fp32 gradient buffers, but this DDP model reduces gradients "
            f"in {', '.join(bad)} (DistributedDataParallelConfig.grad_reduce_in_fp32="
            f"{getattr(ddp_config, 'grad_reduce_in_fp32', None)}): error feedback adds fp32 "
            f"residuals into the buffer and compresses it. Set grad_reduce_in_fp32=True "
            f"(Megatron-LM: --accumulate-allreduce-grads-in-fp32)")
    fp8 = [name for owner, name in ((tf_config, "fp8_param"), (ddp_config, "fp8_param_gather"),
                                    (ddp_config, "reuse_grad_buf_for_mxfp8_param_ag"))
           if getattr(owner, name, False)]
    if fp8:
        raise ValueError(
            f"rank {rank}: GRPO does not support fp8 parameters ({', '.join(fp8)}; Megatron-LM "
            f"--fp8-param-gather): megatron quantises them in its optimizer's parameter copy "
            f"(quantize_param_shard), which GRPO's per-tier copy and compressed gather replace. "
            f"Keep bf16 parameters (fp8 compute without --fp8-param-gather is fine)")
    if getattr(tf_config, "fp16", False):
        raise _loss_scaling_refusal("TransformerConfig", ["fp16"], rank)
    if getattr(ddp_config, "fp4_param_gather", False):
        raise ValueError(
            f"rank {rank}: GRPO does not support fp4 parameters (DistributedDataParallelConfig."
            f"fp4_param_gather): megatron quantises them in its optimizer's parameter copy, which "
            f"GRPO's per-tier copy and compressed gather replace. Keep bf16 parameters")
    if getattr(ddp_config, "param_name_patterns_for_fp32_local_accumulation", ()):
        raise ValueError(
            f"rank {rank}: GRPO does not support DistributedDataParallelConfig."
            f"param_name_patterns_for_fp32_local_accumulation (fp32 main_grad copies beside bf16 "
            f"gradient buffers, copied around megatron's own collective, which GRPO's compressed "
            f"path replaces): use fp32 gradient buffers instead, grad_reduce_in_fp32=True "
            f"(Megatron-LM: --accumulate-allreduce-grads-in-fp32)")
    if getattr(ddp_config, "num_buckets", None) is not None:
        raise ValueError(
            f"rank {rank}: GRPO does not support DistributedDataParallelConfig.num_buckets="
            f"{ddp_config.num_buckets}: GRPO's tier units are megatron's buckets, cut by size. Set "
            f"the size instead (--grpo-bucket-mb, or DistributedDataParallelConfig.bucket_size)")
    gtp = [name for name in ("gtp_weight_remat_size", "expert_gtp_weight_remat_size")
           if (getattr(tf_config, name, 1) or 1) > 1]
    if gtp:
        raise ValueError(
            f"rank {rank}: GRPO does not support GTP weight remat ({', '.join(gtp)} > 1 on "
            f"TransformerConfig): megatron reduces those gradients over a replicate group that "
            f"GRPO's collectives and tiers do not span. Run with {gtp[0]}=1")
    if controller_dp_size is not None and ddp_dp_size is not None and controller_dp_size != ddp_dp_size:
        cp = getattr(tf_config, "context_parallel_size", 1)
        raise ValueError(
            f"rank {rank}: the GRPO controller's data-parallel group has {controller_dp_size} "
            f"rank(s), but megatron's DDP reduces gradients over {ddp_dp_size} (data-parallel x "
            f"context-parallel, context_parallel_size={cp}): build GRPOController with "
            f"parallel_state.get_data_parallel_group(with_context_parallel=True)")


def check_optimizer_options(opt_config, rank: int) -> None:
    """Raise ValueError for an OptimizerConfig GRPO's distributed optimizer cannot carry."""
    scaled = [name for name in ("fp16", "loss_scale") if getattr(opt_config, name, None)]
    if scaled:
        raise _loss_scaling_refusal("OptimizerConfig", scaled, rank)
    if getattr(opt_config, "use_layer_wise_distributed_optimizer", False):
        raise ValueError(
            f"rank {rank}: GRPO does not support the layer-wise distributed optimizer "
            f"(OptimizerConfig.use_layer_wise_distributed_optimizer): GRPO runs inside megatron's "
            f"DistributedOptimizer. Use --use-distributed-optimizer without it")
    if getattr(opt_config, "use_precision_aware_optimizer", False):
        raise ValueError(
            f"rank {rank}: GRPO does not support the precision-aware optimizer "
            f"(OptimizerConfig.use_precision_aware_optimizer, Megatron-LM "
            f"--use-precision-aware-optimizer): that optimizer keeps the main parameters and reads "
            f"gradients from decoupled_grad, which GRPO's per-tier gradient skipping and parameter "
            f"staging do not reach. Run without it")
    if getattr(opt_config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise ValueError(
            f"rank {rank}: GRPO does not support fp8 parameters "
            f"(OptimizerConfig.reuse_grad_buf_for_mxfp8_param_ag): keep bf16 parameters")


def check_model_options(grpo_config, tf_configs: Iterable, rank: int,
                        dp_size: Optional[int] = None) -> None:
    """Raise ValueError for a TransformerConfig option that the GRPO features ``grpo_config``
    turns on cannot carry (see the module docstring). ``tf_configs``: the model chunks'
    configs (None entries are skipped); ``dp_size``: the data-parallel (x context-parallel)
    size, None when not known yet (then counted as more than one rank)."""
    for tf in tf_configs:
        if tf is None:
            continue
        per_token = getattr(tf, "calculate_per_token_loss", False)
        feedback = _feedback_tiers(grpo_config) if dp_size is None or dp_size > 1 else []
        if per_token and feedback:
            raise ValueError(
                f"rank {rank}: megatron's per-token loss (TransformerConfig."
                f"calculate_per_token_loss, Megatron-LM --calculate-per-token-loss) does not work "
                f"with GRPO's error feedback ({', '.join(feedback)}): megatron divides each "
                f"step's gradient by that step's token count after the sync, so what compression "
                f"held back at one step would land divided by the next step's count, known only "
                f"after that step's sync has started. Run without --calculate-per-token-loss, or "
                f"with every sync exact (--grpo-compress none; tiers, importance and the memory "
                f"tier still run)")
        if grpo_config.stable_delayed and grpo_config.stable_share > 0 and per_token:
            raise ValueError(
                f"rank {rank}: --grpo-stable-mode delayed does not support megatron's per-token "
                f"loss (TransformerConfig.calculate_per_token_loss, Megatron-LM "
                f"--calculate-per-token-loss): megatron divides each step's gradient by that "
                f"step's token count after the sync, and the delayed stable tier's sum of earlier "
                f"steps, each already divided by its own count, would be divided again by the "
                f"update step's. Run with --grpo-stable-mode frozen (or --grpo-stable-share 0), "
                f"or without --calculate-per-token-loss")
        graphs = _cuda_graph_options(tf)
        if grpo_config.sampled_backward and graphs:
            raise ValueError(
                f"rank {rank}: --grpo-sampled-backward does not support CUDA graphs "
                f"({', '.join(graphs)} on TransformerConfig; Megatron-LM --cuda-graph-impl, "
                f"--enable-cuda-graph, --external-cuda-graph): the sampled backward draws its "
                f"token rows and keep ratios anew every step, and a captured graph would replay "
                f"the draw it was captured with. Run with --cuda-graph-impl none, or without "
                f"--grpo-sampled-backward")


def _feedback_tiers(grpo_config) -> list:
    """The flags that send a tier's gradients compressed with error feedback every step (what
    the controller's ``unit_compressor`` compresses once tiered, with more than one
    data-parallel rank); a periodic tier syncs exactly inside its instance instead. With
    --grpo-compress auto or inter-node whether a tier compresses is decided on the run's own
    group after the build: counted as compressing."""
    cfg, out = grpo_config, []
    if getattr(cfg, "compress", "all") == "none":
        return out
    if cfg.dynamic_share > 0 and cfg.sync_interval("dynamic") == 1:
        out.append(f"--grpo-dynamic-share {cfg.dynamic_share:g} with --grpo-compressor "
                   f"{cfg.compressor}")
    if cfg.core_share > 0 and cfg.core_compressor != "none" and cfg.sync_interval("core") == 1:
        out.append(f"--grpo-core-compressor {cfg.core_compressor}")
    if cfg.stable_share > 0 and cfg.stable_compressed:
        out.append("--grpo-stable-mode compressed")
    return out


def check_grad_shards(tf_configs: Iterable, rank: int) -> None:
    """Raise ValueError when gradient shards go to the memory tier (--grpo-offload-grads) under
    megatron's per-token loss: the shard of a streamed unit is written to host memory or SSD
    right after its sync, and megatron divides the gradients by the step's token count later
    (``scale_gradients``), when it is away. Called by ``build_placement``, before step 1;
    ``BucketGrads.scale`` keeps a guard for a placement built some other way."""
    if any(tf is not None and getattr(tf, "calculate_per_token_loss", False) for tf in tf_configs):
        raise ValueError(
            f"rank {rank}: --grpo-offload-grads does not support megatron's per-token loss "
            f"(TransformerConfig.calculate_per_token_loss, Megatron-LM "
            f"--calculate-per-token-loss): megatron divides the gradients by the step's token "
            f"count after the sync, when the memory tier has already written the streamed units' "
            f"gradient shards to host memory or SSD. Run with --no-grpo-offload-grads (optimizer "
            f"state still moves), or without --calculate-per-token-loss")


def _cuda_graph_options(tf_config) -> list:
    """The CUDA-graph options set on ``tf_config``: 0.16.1 through 0.19 have
    ``cuda_graph_impl`` and the deprecated booleans it replaced, a release may lack any of them."""
    out = []
    impl = getattr(tf_config, "cuda_graph_impl", None)
    if impl not in (None, "none"):
        out.append(f"cuda_graph_impl={impl!r}")
    out += [name for name in ("enable_cuda_graph", "external_cuda_graph")
            if getattr(tf_config, name, False)]
    return out


def check_separate_norm_groups(params: Iterable, rank: int) -> None:
    """Raise ValueError if a parameter whose gradient shard the memory tier may hold away is in
    one of megatron 0.19's separate grad-norm groups. ``params``: (unit, model param, shard
    main param); megatron copies ``grad_norm_group`` onto the shard, either is read."""
    for unit, model_param, shard in params:
        group = getattr(shard, "grad_norm_group", None) or getattr(model_param, "grad_norm_group", None)
        if group is None:
            continue
        raise ValueError(
            f"rank {rank}: GRPO's memory tier would hold away the gradient of a parameter in "
            f"megatron's separate grad-norm group {group!r} (unit {unit}; multi-token "
            f"prediction), which megatron clips by that group's own norm, while a gradient "
            f"brought back from the tier is clipped by the main norm: run with "
            f"--no-grpo-offload-grads (optimizer state still moves), or without a separate norm "
            f"group for {group!r}")
