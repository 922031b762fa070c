"""Binding megatron's bucket groups to GRPO: ``install`` turns every bucket group of the DDP
chunks into a ``GRPOBucketGroup`` (megatron/bucket_group.py) bound to the controller, after
refusing, before changing anything, the options GRPO does not carry."""

from __future__ import annotations

import torch

from megatron_grpo.megatron import grad_accum
from megatron_grpo.megatron.bucket_group import GRPOBucketGroup
from megatron_grpo.megatron.grad_storage import reads_after_sync
from megatron_grpo.megatron.options import check_ddp_options


def install(ddp_chunks: list, controller) -> None:
    """Turn every bucket group of the DDP chunks into a GRPOBucketGroup bound to ``controller``.
    Refuses, before changing anything, the options GRPO does not carry (megatron/options.py)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    grad_dtypes = {b.grad_data.dtype for unit in controller.units
                   for b in getattr(unit.group, "buckets", [])}
    for chunk in ddp_chunks:
        if getattr(chunk.ddp_config, "overlap_param_gather", False):
            # The compressed parameter gather sends what this step's optimizer staged, and the
            # controller drops the staging (and may re-tier) at the end of the step; megatron's
            # overlapped gather would run in the next forward, after both.
            raise ValueError(f"rank {rank}: GRPO does not support "
                             f"overlap_param_gather (DistributedDataParallelConfig, "
                             f"--overlap-param-gather) yet: build the DDP model without it")
        dp_cp = getattr(chunk, "dp_cp_group", None)
        check_ddp_options(chunk.ddp_config, getattr(chunk, "config", None), grad_dtypes,
                          getattr(controller, "dp_size", None),
                          dp_cp.size() if dp_cp is not None else None, rank)
        instances = getattr(chunk.ddp_config, "num_distributed_optimizer_instances", 1)
        if instances == 1 and controller.config.periodic and controller.dp_size > 1:
            # --num-distributed-optimizer-instances 0 on a single node resolves to 1.
            raise ValueError(f"rank {rank}: GRPO's periodic tiers (--grpo-*-sync-interval > 1, "
                             f"--grpo-stable-mode local or --grpo-internode-preset) sync across "
                             f"distributed-optimizer instances, but this run has one: run on "
                             f"several nodes with --num-distributed-optimizer-instances 0, or set N > 1")
        if instances > 1:
            # Not built for the hierarchy yet: PowerSGD's factors are all-reduced over the flat
            # group, so they would reach the wrong ranks between instances.
            if controller.powersgd is not None:
                raise ValueError(f"rank {rank}: --grpo-compressor powersgd does not support "
                                 f"--num-distributed-optimizer-instances {instances}: use int4 or int8")
    storage_of = {id(g): getattr(chunk, "__dict__", {}).get("grpo_grad_storage")
                  for chunk in ddp_chunks for g in getattr(chunk, "bucket_groups", [])}
    late_of = _late_params(ddp_chunks)
    for unit in controller.units:
        grad_accum.check_installable(storage_of.get(id(unit.group)), ddp_chunks[0].ddp_config,
                                     controller.config, rank)
    for unit in controller.units:
        group = unit.group
        group.__class__ = GRPOBucketGroup
        group.grpo = controller
        group.grpo_unit = unit.index
        group.grpo_storage = storage_of.get(id(group))
        group.grpo_late_params = late_of.get(id(group), set())


def _late_params(ddp_chunks: list) -> dict:
    """id(bucket group) -> the set of its parameters megatron's ``finalize_model_grads`` reads
    and rewrites after the data-parallel sync (grad_storage.reads_after_sync)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    out = {}
    for chunk in ddp_chunks:
        module = getattr(chunk, "module", None)
        if module is None:
            continue
        names = {p: n for n, p in module.named_parameters()}
        for group in getattr(chunk, "bucket_groups", []):
            out[id(group)] = {p for b in group.buckets for p in b.params_list
                              if reads_after_sync(p, chunk.config, tp, pp, names.get(p, ""))}
    return out
