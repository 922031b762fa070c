"""The CUDA path's build settings, chosen as Megatron-LM chooses them; CPU mode keeps its own.

* Initialisation. On CUDA the weights are created on the device (``use_cpu_initialization=False``)
  as in Megatron-LM: no rank builds full fp32 weights on the host. megatron then draws each
  tensor-parallel shard from that TP rank's own RNG stream, so the initial weights depend on
  the TP/PP layout (pipeline stages already did on CPU). Identical weights for every layout
  come from the seed checkpoint, as they already did for PP: ``--train-iters 0 --save DIR`` once,
  then ``--init-from DIR`` in every layout (docs/design.md). CPU mode keeps host
  initialisation, under which TP=1 and TP=2 start from the same weights by seeding alone.
* Fusions. Each fusion megatron-core offers for this model is on when its kernel is importable
  here (``probe_kernels``, the same imports megatron-core makes), so a missing kernel turns a
  fusion off with a start-up line instead of crashing the first step.
* Attention. Without transformer-engine megatron's local spec materialises the S x S scores;
  ``unfused_attention_warning`` says so, with the planner's figure, where that costs memory.
* CUDA_DEVICE_MAX_CONNECTIONS: ``cuda_max_connections`` is the rule the launchers apply
  (launch/slurm/job_setup.py) and training checks at start-up. This module imports no torch at
  import time, so the launchers' flag check stays fast.

Everything except ``probe_kernels`` is a pure function of the config (tests/unit/test_cuda_build.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

# Kernel -> what provides it. A probe result is None when the kernel is importable, else why not.
KERNELS: Dict[str, str] = {
    "fused_weight_gradient_mlp_cuda": "apex built with --cuda_ext",
    "jit_fuser": "megatron.core.jit.jit_fuser, torch.compile: needs triton on CUDA",
    "scaled_masked_softmax_cuda": "apex built with --cuda_ext",
    "scaled_upper_triang_masked_softmax_cuda": "apex built with --cuda_ext",
    "te_fused_rope": "transformer-engine >= 1.4, through megatron.core.extensions.transformer_engine",
}

# Fusion (a TransformerConfig field) -> the kernels it calls. masked_softmax_fusion: on a causal
# mask the fused path asks scaled_masked_softmax_cuda for its block size and then runs the
# upper-triangular kernel, so both must import.
FUSION_KERNELS: Dict[str, Tuple[str, ...]] = {
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
    "bias_activation_fusion": ("jit_fuser",),
    "bias_dropout_fusion": ("jit_fuser",),
    "masked_softmax_fusion": ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
    "apply_rope_fusion": ("te_fused_rope",),
}
FUSIONS: Tuple[str, ...] = tuple(FUSION_KERNELS)

CPU_REASON = "CPU mode: megatron's unfused torch paths, exact on CPU"
# Below this much extra activation memory per GPU unfused attention is not worth a warning: it is
# a rounding error on any accelerator, while the S x S terms grow quadratically past it.
UNFUSED_ATTENTION_WARN_BYTES = 1e9
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def _import(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
        return None
    except Exception as exc:  # a broken extension raises OSError & co., not only ImportError
        return f"{type(exc).__name__}: {exc}"


def _probe_jit_fuser() -> Optional[str]:
    import torch
    from megatron.core import jit

    if jit.jit_fuser is not torch.compile:
        return None  # torch.jit.script or megatron's no-op: nothing more to import
    return _import("triton")


def _probe_te_rope() -> Optional[str]:
    try:
        from megatron.core.models.common.embeddings.rope_utils import fused_apply_rotary_pos_emb
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if fused_apply_rotary_pos_emb is None:
        return "megatron-core found no fused RoPE (transformer-engine is not importable)"
    return None


def probe_kernels() -> Dict[str, Optional[str]]:
    """Which kernels import here: None when one does, else the reason. Called on CUDA only."""
    found = {name: _import(name) for name in KERNELS if name.endswith("_cuda")}
    found["jit_fuser"] = _probe_jit_fuser()
    found["te_fused_rope"] = _probe_te_rope()
    return found


@dataclass(frozen=True)
class BuildSettings:
    """What transformer_config() passes to megatron's TransformerConfig beyond the model shape."""

    use_cpu_initialization: bool
    """True: full weights built on the host, then split and moved (CPU mode)."""
    fusions: Dict[str, bool]
    """TransformerConfig fusion field -> on."""
    off_reasons: Dict[str, str] = field(default_factory=dict)
    """For each fusion that is off: why (the missing kernel and its import error, or the model)."""

    def kwargs(self) -> Dict[str, bool]:
        return dict(use_cpu_initialization=self.use_cpu_initialization, **self.fusions)

    def describe(self) -> List[str]:
        """Start-up lines: fusions on, each one off with its reason, where weights are made."""
        on = [f for f in FUSIONS if self.fusions[f]]
        lines = ["fusions on: " + (", ".join(on) if on else "none")]
        lines += [f"fusion off: {f}: {self.off_reasons[f]}" for f in FUSIONS if not self.fusions[f]]
        if self.use_cpu_initialization:
            lines.append("weights initialised on the host (the same for every TP layout)")
        else:
            lines.append("weights initialised on the device, as Megatron-LM does: each TP rank draws "
                         "its shard from its own RNG stream, so they depend on the TP/PP layout; for "
                         "the same weights in every layout write a seed checkpoint once "
                         "(--train-iters 0 --save DIR) and start each layout with --init-from DIR")
        return lines


def _model_reason(cfg, fusion: str) -> Optional[str]:
    """Why megatron would refuse (or have nothing to do with) ``fusion`` for this model."""
    m = cfg.model
    if fusion == "bias_activation_fusion" and not m.swiglu and m.disable_bias_linear:
        return ("GeLU MLP without linear biases (--disable-bias-linear): megatron's TransformerConfig "
                "refuses the bias-GeLU fusion then (Megatron-LM turns it off too)")
    if fusion == "apply_rope_fusion" and m.position_embedding_type != "rope":
        return f"--position-embedding-type {m.position_embedding_type}: no RoPE to fuse"
    return None


def build_settings(cfg, on_cuda: bool, kernels: Optional[Mapping[str, Optional[str]]] = None) -> BuildSettings:
    """Megatron-LM's choices on CUDA given which ``kernels`` import (probe_kernels(); a kernel
    absent from the mapping counts as missing); CPU mode's fixed settings otherwise."""
    if not on_cuda:
        return BuildSettings(True, {f: False for f in FUSIONS}, {f: CPU_REASON for f in FUSIONS})
    kernels = kernels or {}
    fusions, reasons = {}, {}
    for fusion, needs in FUSION_KERNELS.items():
        why = _model_reason(cfg, fusion)
        if why is None:
            missing = [(k, kernels.get(k, "not probed")) for k in needs]
            missing = [(k, err) for k, err in missing if err is not None]
            if missing:
                why = "; ".join(f"{k}: {err} (from {KERNELS[k]})" for k, err in missing)
        fusions[fusion] = why is None
        if why is not None:
            reasons[fusion] = why
    return BuildSettings(False, fusions, reasons)


def unfused_attention_bytes(cfg, vocab: int) -> int:
    """Activation bytes per GPU, on the busiest pipeline stage, that megatron's local spec
    (unfused attention: S x S scores and probabilities, the causal mask, expanded K/V, torch
    norms) keeps beyond transformer-engine's fused attention, by the planner's model of both."""
    from megatron_grpo.planner.plan import ClusterSpec, stage_activation_bytes
    from megatron_grpo.training.memory_budget import model_spec

    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    cluster = ClusterSpec(nodes=1, gpus_per_node=tp * pp, tp=tp, pp=pp)
    unfused, fused = model_spec(cfg, vocab, "unfused"), model_spec(cfg, vocab, "flash")
    return max(stage_activation_bytes(unfused, cluster, s) - stage_activation_bytes(fused, cluster, s)
               for s in range(pp))


def unfused_attention_warning(cfg, spec_name: str, vocab: int) -> Optional[str]:
    """A start-up warning when ``spec_name`` is megatron's local spec and unfused attention costs
    at least UNFUSED_ATTENTION_WARN_BYTES per GPU; None otherwise."""
    if spec_name != "local":
        return None
    extra = unfused_attention_bytes(cfg, vocab)
    if extra < UNFUSED_ATTENTION_WARN_BYTES:
        return None
    m, t, p = cfg.model, cfg.training, cfg.parallel
    return (f"attention is unfused: without transformer-engine megatron-core's local layer spec "
            f"materialises the S x S attention scores. At --seq-length {m.seq_length} (micro-batch "
            f"{t.micro_batch_size}, TP {p.tensor_model_parallel_size}) that keeps {extra / 1e9:.1f} GB "
            f"more activations per GPU than fused attention (planner, megatron_grpo/planner/activations.py), "
            f"and its time grows with S^2, for the baseline and GRPO alike. Install transformer-engine "
            f"(fused attention), or lower --seq-length / --micro-batch-size, or recompute attention "
            f"(--recompute-granularity selective)")


@dataclass(frozen=True)
class MaxConnections:
    """The launchers' CUDA_DEVICE_MAX_CONNECTIONS decision."""

    export: Optional[str]
    """The value to export; None: leave the environment as it is (unset, or the user's value)."""
    why: str
    """One line for the job log."""
    warning: Optional[str] = None
    """Set when the user's own value works against the rule, saying what it costs."""


def cuda_max_connections(tp: int, environ: Mapping[str, str], grpo_enabled: bool = False) -> MaxConnections:
    """1 where megatron-core relies on it, unset elsewhere; a value the user set is kept.

    megatron-core 0.16.1 (tensor_parallel/layers.py) issues the tensor-parallel all-reduce of
    input gradients (TP > 1; the reduce-scatter and all-gather with sequence parallelism)
    asynchronously and relies on CUDA_DEVICE_MAX_CONNECTIONS=1, one hardware queue, so the GPU
    starts it before the weight-gradient GEMM it overlaps; it warns when the variable is not 1.
    Nothing else in megatron-core needs it (parallel_state.py asserts the opposite only for a UCC
    pipeline backend, which this project does not use). One queue has a price: kernels of every
    stream start in issue order, so GRPO's side stream (importance, compression, its
    collectives) waits behind the main stream instead of running beside backward.
    """
    user = environ.get(MAX_CONNECTIONS) or None
    if tp > 1:
        wants = "1"
        rule = (f"TP={tp}: megatron-core overlaps the tensor-parallel gradient all-reduce (reduce-scatter "
                f"with sequence parallelism) with the weight-gradient GEMM and relies on one hardware "
                f"queue to start it first; GRPO's side stream shares that queue")
    else:
        wants = None
        rule = ("TP=1: no tensor-parallel overlap needs one hardware queue, and one would hold "
                "GRPO's side stream behind the main stream (left unset)")
    if user is None:
        return MaxConnections(wants, rule)
    warning = None
    if wants == "1" and user != "1":
        warning = (f"{MAX_CONNECTIONS}={user} at TP={tp}: megatron-core relies on 1 to start the "
                   f"tensor-parallel gradient communication before the weight-gradient GEMM; with more "
                   f"queues it may run after the GEMM instead of beside it (unset it to get 1)")
    elif wants is None and user == "1" and grpo_enabled:
        warning = (f"{MAX_CONNECTIONS}=1 at TP=1: every stream shares one hardware queue, so GRPO's "
                   f"side-stream work (importance, compression) starts only in issue order behind the "
                   f"main stream and cannot overlap backward; nothing at TP=1 needs it (unset it)")
    return MaxConnections(None, f"{MAX_CONNECTIONS}={user} kept as given; {rule}", warning)


def startup_warnings(cfg, spec_name: str, vocab: int, environ: Mapping[str, str]) -> List[str]:
    """What rank 0 prints as WARNING before a CUDA run starts."""
    out = []
    attention = unfused_attention_warning(cfg, spec_name, vocab)
    if attention:
        out.append(attention)
    conn = cuda_max_connections(cfg.parallel.tensor_model_parallel_size, environ, cfg.grpo.enabled)
    if conn.warning:
        out.append(conn.warning)
    elif conn.export is not None:  # launched without launch/'s scripts, which export it
        out.append(f"{MAX_CONNECTIONS} is not set at TP={cfg.parallel.tensor_model_parallel_size}: "
                   f"megatron-core's tensor-parallel overlap needs {MAX_CONNECTIONS}={conn.export} "
                   f"before the process starts (launch/slurm and launch/run_local.sh export it)")
    return out
