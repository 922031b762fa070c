"""megatron-core's own memory options beside GRPO's: the planner's predictions for them.

GRPO's largest model is compared with megatron's DistributedOptimizer (the planner's
baseline) and with the two options megatron-core 0.16.1 offers to fit a larger model on the
same GPUs. Neither runs on this project's CPU setup (the CPU optimizer needs CUDA streams,
Megatron-FSDP is not wired into launch/pretrain_gpt.py), so these figures are predictions from
the same pieces as the baseline's and are not held to a measured run. Per GPU of pipeline stage
k, with e the parameter dtype's bytes (2 for bf16), P the elements of megatron's padded DDP
buckets of the stage (the baseline's layout), E this TP rank's parameter elements of the stage,
L those of one transformer layer, N = E - (layers of the stage) L those outside the layers
(embedding, position table, final norm, output layer) and A the stage's activations
(planner/activations.py, the baseline's):

* ``megatron-cpu-offload``: ``OptimizerConfig(optimizer_cpu_offload=True,
  optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True)``. megatron's
  HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py) keeps each shard's fp32
  master weights and Adam moments on the host and copies gradients down and parameters up every
  step; the device keeps the parameter buffer, the fp32 gradient buffer (grad_reduce_in_fp32)
  and the activations: ``P (e + 4) + A``, the baseline's figure less its masters and moments.
* ``megatron-fsdp``: Megatron-FSDP with ``data_parallel_sharding_strategy="optim_grads_params"``
  and its default units (one per TransformerLayer). Each rank keeps 1/dp of the parameters, the
  fp32 gradients, the fp32 master weights (bf16 only, as the baseline) and the Adam moments, S =
  ceil(E / dp) elements: ``S (e + 4 + 4 + 8)``. Gathered whole at the peak: the parameters
  outside the units, which megatron_fsdp.py all-gathers in every forward and no hook releases
  before backward ends (N e), the layer computing and the one prefetched (2 L e), and in
  backward the full fp32 gradients of the non-unit parameters and of one layer before their
  reduce-scatter (4 (N + L)). Peak ``S (e + 16) + e (N + 2 L) + 4 (N + L) + A`` (e + 12 for
  fp32 parameters: no separate masters).

What they cost instead of memory: the CPU optimizer runs Adam on the host and moves 4 + e
bytes per shard element over PCIe each step; FSDP reduce-scatters gradients and gathers the
parameters twice (forward and backward) for every micro-batch (``fsdp_step_bytes``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from megatron_grpo.planner.activations import stage_activation_bytes

PEERS = ("megatron-cpu-offload", "megatron-fsdp")
"""The megatron-core memory options the planner predicts (``launch/plan.py --largest-model``)."""


@dataclass
class PeerMemory:
    """Bytes on one GPU of one pipeline stage under a megatron-core memory option."""

    which: str
    """One of ``PEERS``."""
    stage: int
    """Pipeline stage the figures are for (the busiest unless one was asked for)."""
    params: int
    """Parameters resident: megatron's whole parameter buffer (cpu offload) or this rank's
    1/dp shard (FSDP)."""
    grads: int
    """fp32 gradients resident: the whole buffer (cpu offload) or this rank's shard (FSDP)."""
    master_params: int
    """fp32 master weights on the device: FSDP's shard with bf16 parameters; 0 with cpu
    offload (on the host)."""
    optimizer_moments: int
    """Adam moments on the device: FSDP's shard; 0 with cpu offload (on the host)."""
    gathered: int
    """FSDP: parameters and gradients gathered whole at the peak (see the module notes)."""
    activations: int
    """The stage's activations at the peak, as the baseline's (planner/activations.py)."""
    host: int = 0
    """cpu offload: the fp32 masters and Adam moments of this rank's shard, on the host (not in
    ``total``)."""

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.master_params + self.optimizer_moments
                + self.gathered + self.activations)


def _stage_elements(model, cluster, stage: int):
    """(E, N, L): this TP rank's parameter elements of ``stage``, those outside the
    transformer layers, and one layer's."""
    from megatron_grpo.planner.plan import stage_param_numels

    layers = model.num_layers // cluster.pp
    whole = sum(stage_param_numels(model, cluster, stage))
    # The same shapes with no layers: what the stage holds outside them.
    outside = sum(stage_param_numels(dataclasses.replace(model, num_layers=0), cluster, stage))
    return whole, outside, (whole - outside) // layers if layers else 0


def cpu_offload_memory(model, cluster, grpo, stage: int,
                       bucket_size: Optional[int] = None) -> PeerMemory:
    """``megatron-cpu-offload`` on ``stage``: the baseline's buffers and activations, its
    masters and moments on the host."""
    from megatron_grpo.planner.plan import plan

    base = plan(model, cluster, grpo, bucket_size=bucket_size, stage=stage).baseline_memory
    # The baseline's fp32 run keeps no separate masters (views), so host holds 0 of them there.
    return PeerMemory("megatron-cpu-offload", stage, params=base.params, grads=base.grads,
                      master_params=0, optimizer_moments=0, gathered=0,
                      activations=base.activations,
                      host=base.master_params + base.optimizer_moments)


def fsdp_memory(model, cluster, stage: int, grad_bytes: int = 4) -> PeerMemory:
    """``megatron-fsdp`` on ``stage`` (optim_grads_params, one unit per layer); ``grad_bytes``
    2 for bf16 gradient buffers (its shards and the gradients gathered whole)."""
    e = model.param_bytes
    whole, outside, layer = _stage_elements(model, cluster, stage)
    shard = math.ceil(whole / cluster.dp)
    return PeerMemory("megatron-fsdp", stage, params=shard * e, grads=shard * grad_bytes,
                      master_params=shard * 4 if model.bf16 else 0, optimizer_moments=shard * 8,
                      gathered=e * (outside + 2 * layer) + grad_bytes * (outside + layer),
                      activations=stage_activation_bytes(model, cluster, stage))


def peer_memory(model, cluster, grpo, which: str, bucket_size: Optional[int] = None,
                stage: Optional[int] = None) -> PeerMemory:
    """``which``'s memory on ``stage``, or on its busiest stage when ``stage`` is None."""
    if which not in PEERS:
        raise ValueError(f"which must be one of {', '.join(PEERS)}, got {which!r}")
    model.validate()
    cluster.validate(model)
    stages = range(cluster.pp) if stage is None else [stage]
    mems = [cpu_offload_memory(model, cluster, grpo, st, bucket_size) if which == PEERS[0]
            else fsdp_memory(model, cluster, st) for st in stages]
    return max(mems, key=lambda m: m.total)


def fsdp_step_bytes(model, cluster, stage: int = 0) -> int:
    """Bytes one rank of ``stage`` sends per step under Megatron-FSDP (ring model, as
    ``comm/analytic.py``): every micro-batch all-gathers the parameters for forward and again
    for backward (e bytes each) and reduce-scatters the fp32 gradients (4 bytes), each
    (dp-1)/dp of E; the DistributedOptimizer does one reduce-scatter and one all-gather per
    step."""
    dp = cluster.dp
    whole, _, _ = _stage_elements(model, cluster, stage)
    per_micro_batch = (dp - 1) * math.ceil(whole / dp) * (2 * model.param_bytes + 4)
    return model.micro_batches(dp, cluster.pp) * per_micro_batch
