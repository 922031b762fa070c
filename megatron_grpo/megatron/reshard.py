"""Resuming GRPO at another data- or tensor-parallel size: what carries over, what starts again.

Per-rank GRPO state is tied to the rank's shard and data: error-feedback residuals (what this
rank's compressed sends still owe), the importance EMA of its own gradients, delayed-stable
accumulators and carries. A checkpoint keeps them per rank (rng/rank_NNNNN.pt), usable only at
the same world size. Re-partitioning them at another size would mean every new rank reading
every old rank's file (a model-sized residual each: dp reads of the model per rank), so at
another size they start empty, and the run says so. What is per parameter carries over exactly:
the Adam step counters (GRPO skips stable units, so they differ by unit; megatron's checkpoint
keeps one, the largest), gathered into the common state at save and restored by parameter name.
The tier map is the replica's and is kept. Another TP/PP layout is refused at load time
(megatron_grpo.training.checkpointing: the optimizer state is saved per data-parallel shard);
--load with --no-load-optim resumes it without optimizer and GRPO state (a new exact warm-up,
GRPOController.begin_step), --init-from starts any layout from the weights alone.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from megatron_grpo.platform.layout import parallel_layout
from megatron_grpo.megatron.optimizer import load_named_param_steps, named_param_steps


def _names(built) -> Dict:
    return {p: n for chunk in built.ddp_model for n, p in chunk.module.named_parameters()}


def gathered_param_steps(built) -> Dict[str, float]:
    """Every parameter's Adam step counter over the whole job (collective: all ranks)."""
    from megatron.core import parallel_state as ps

    mine = named_param_steps(built.optimizer, _names(built), ps.get_pipeline_model_parallel_rank())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out: Dict[str, float] = {}
    for part in every:
        out.update(part)
    return out


def resume_elsewhere(built, ctrl, saved: Dict) -> Dict:
    """Apply the policy above after a load at another world size; returns the event (printed
    once by rank 0, kept in the controller's events and in the first record's ``grpo_retier``)."""
    from megatron.core import parallel_state as ps

    restored, missing = load_named_param_steps(built.optimizer, _names(built),
                                               ps.get_pipeline_model_parallel_rank(),
                                               saved.get("param_steps", {}))
    t = torch.tensor([restored, missing], dtype=torch.int64, device=ctrl.device)
    with ctrl.counter.tag("grpo_control"):
        dist.all_reduce(t)
    restored, missing = t.tolist()
    tp, pp = parallel_layout()
    old = saved.get("layout")
    reason = (f"resumed at world size {dist.get_world_size()} (tp x pp {tp} x {pp}) from a checkpoint "
              f"written at {saved.get('world_size', '?')}"
              + (f" (tp x pp {old[0]} x {old[1]})" if old else "") + ": per-rank GRPO state starts empty (error-feedback "
              f"residuals, importance EMA, delayed accumulators, carries); Adam step counters "
              f"restored per parameter for {restored} shard(s)"
              + (f", {missing} kept megatron's largest step (no saved counter: another pipeline "
                 f"layout or an older checkpoint)" if missing else "")
              + "; tier map kept")
    return ctrl.note_event(reason)
