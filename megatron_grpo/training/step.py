"""One training step and one evaluation, through megatron-core's pipeline schedules.

The same code serves no pipelining and PP > 1: ``get_forward_backward_func`` picks the schedule,
and every stage reads the same micro-batches (first stage uses tokens, last stage labels).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses and token count; megatron divides by tokens and micro-batches."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach().clone(), mask.sum()])}


class ForwardStep:
    """megatron forward_step_func: batch -> (output, loss_func)."""

    def __init__(self, seq_length: int, device: torch.device) -> None:
        # Boolean mask where True = masked out (megatron's convention), causal.
        self.attention_mask = (torch.tril(torch.ones(1, 1, seq_length, seq_length)) < 0.5).to(device)
        self.device = device

    def __call__(self, data_iterator: Iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        position_ids = batch["position_ids"].to(self.device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(self.device, non_blocking=True)
        output = model(tokens, position_ids, self.attention_mask, labels=labels)
        return output, partial(_loss_func, loss_mask)


@dataclass
class StepResult:
    loss: Optional[float]
    """Mean token loss over the global batch (None on ranks that are not the last PP stage)."""
    grad_norm: Optional[float]
    """Global gradient norm before clipping."""
    update_successful: bool
    """False when the optimizer skipped the step (fp16 overflow)."""
    optimizer_time_s: float = 0.0
    """Wall time of optimizer.step() (includes the distributed optimizer's param all-gather)."""
    local_loss_finite: bool = True
    """This rank's own summed token loss, before the data-parallel reduction, is finite (True on
    ranks that are not the last PP stage): names the rank where a loss went NaN/Inf."""


def _reduce_loss(results, dp_group, device) -> Tuple[Optional[float], bool]:
    """(token-weighted mean loss over micro-batches and data-parallel ranks, whether this
    rank's own loss sum was finite)."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage():
        return None, True
    if results:
        totals = torch.stack([r["lm loss"] for r in results]).sum(0).to(device)
    else:
        totals = torch.zeros(2, device=device)
    own = totals[0].clone()
    if dist.get_world_size(dp_group) > 1:
        from megatron_grpo.comm.wire import wire_counter

        # Loss bookkeeping is not gradient traffic: tag it so per-step figures separate it.
        with wire_counter().tag("logging"):
            dist.all_reduce(totals, group=dp_group)
    # One host read for both (a GPU sync either way).
    loss, own_finite = torch.stack([totals[0] / totals[1].clamp(min=1), torch.isfinite(own).float()]).tolist()
    return loss, bool(own_finite)


def train_step(forward_step: ForwardStep, data_iterator, built, num_microbatches: int,
               seq_length: int, micro_batch_size: int) -> StepResult:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in built.ddp_model:
        chunk.zero_grad_buffer()
    built.optimizer.zero_grad()
    fb = get_forward_backward_func()
    results = fb(forward_step_func=forward_step, data_iterator=data_iterator,
                 model=built.ddp_model, num_microbatches=num_microbatches,
                 seq_length=seq_length, micro_batch_size=micro_batch_size,
                 decoder_seq_length=seq_length, forward_only=False)
    t0 = time.perf_counter()
    update_successful, grad_norm, _ = built.optimizer.step()
    optimizer_time = time.perf_counter() - t0
    loss, own_finite = _reduce_loss(results, ps.get_data_parallel_group(), forward_step.device)
    return StepResult(loss, None if grad_norm is None else float(grad_norm), bool(update_successful),
                      optimizer_time, own_finite)


@torch.no_grad()
def evaluate(forward_step: ForwardStep, data_iterator, built, eval_iters: int,
             num_microbatches: int, seq_length: int, micro_batch_size: int) -> Optional[float]:
    """Mean validation token loss over ``eval_iters`` global batches (last PP stage only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in built.ddp_model:
        chunk.eval()
    fb = get_forward_backward_func()
    totals = torch.zeros(2, device=forward_step.device)
    for _ in range(eval_iters):
        results = fb(forward_step_func=forward_step, data_iterator=data_iterator,
                     model=built.ddp_model, num_microbatches=num_microbatches,
                     seq_length=seq_length, micro_batch_size=micro_batch_size,
                     decoder_seq_length=seq_length, forward_only=True)
        if ps.is_pipeline_last_stage() and results:
            totals += torch.stack([r["lm loss"] for r in results]).sum(0).to(totals.device)
    for chunk in built.ddp_model:
        chunk.train()
    if not ps.is_pipeline_last_stage():
        return None
    dp_group = ps.get_data_parallel_group()
    if dist.get_world_size(dp_group) > 1:
        from megatron_grpo.comm.wire import wire_counter

        with wire_counter().tag("eval"):
            dist.all_reduce(totals, group=dp_group)
    return (totals[0] / totals[1].clamp(min=1)).item()


def microbatch_layout(global_batch_size: int, micro_batch_size: int, dp_size: int) -> Tuple[int, int]:
    """(num_microbatches, samples per step on this rank)."""
    num_microbatches = global_batch_size // (micro_batch_size * dp_size)
    return num_microbatches, num_microbatches * micro_batch_size
