"""Megatron-LM's ``train_step`` with GRPO's per-step hooks and the metrics file around it.

``train()`` calls the module global ``megatron.training.training.train_step`` once per
iteration (0.16.1-0.19.x), after setting ``args.curr_iteration``; wrapping it gives each step
GRPO's begin/end (tiers, importance, the memory tier's prefetch) and one JSONL record with the
bytes every collective of the step sent, counted by the same wrappers as the project's own loop
(megatron_grpo.comm.wire). Evaluation and checkpoint traffic fall outside the wrapper and so
outside the step's count.
"""

from __future__ import annotations

import functools
import time
from typing import Optional

import torch

from megatron_grpo.training.metrics import wire_fields
from megatron_grpo.training.metrics_log import JsonlLog
from megatron_grpo.training.model import is_metrics_rank


def _loss(loss_dict) -> Optional[float]:
    """Megatron-LM's reduced language-model loss (last pipeline stage), or None elsewhere."""
    if not loss_dict:
        return None
    value = loss_dict.get("lm loss", next(iter(loss_dict.values())))
    return float(value.item() if torch.is_tensor(value) else value)


def install(hooks, metrics_file: Optional[str], run_name: str, counter) -> None:
    """Wrap ``train_step``. ``hooks``: GRPO's RunHooks, or None for a run without GRPO (then
    only the metrics file is written)."""
    from megatron.training import get_args, training

    original = training.train_step
    state = {"log": None}

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        margs = get_args()
        iteration = kwargs.get("iteration")
        if iteration is None:
            iteration = margs.curr_iteration
        if hooks is not None:
            hooks.before_step(iteration)
        counter.reset()  # whatever ran between steps (evaluation, a save) is not this step's
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        if hooks is not None:
            hooks.after_step(iteration + 1)
        step_time = time.perf_counter() - t0
        wire = counter.reset()
        # GRPO's fields every step on every rank, file or not, as the project's own loop does
        # (its metrics may take collectives, tagged so they are not counted as the step's).
        extra = hooks.step_metrics(iteration + 1, wire, step_time) if hooks is not None else {}
        if metrics_file:
            _record(state, extra, margs, metrics_file, run_name, iteration + 1, out, wire, step_time)
        return out

    training.train_step = train_step


def _record(state, extra, margs, path, run_name, iteration, out, wire, step_time) -> None:
    record = {
        "iteration": iteration, "run": run_name, "loss": _loss(out[0]),
        "skipped": bool(out[1]), "grad_norm": None if out[5] is None else float(out[5]),
        "step_time_s": step_time,
        "tokens_per_s": margs.global_batch_size * margs.seq_length / step_time,
        **wire_fields(wire),
        "wire_bytes_by_op": dict(wire["by_op"]),  # bytes per collective (reduce_scatter_tensor, ...)
    }
    record.update(extra)  # GRPO's tiers, decisions and bytes by tier
    if not is_metrics_rank():
        return
    if state["log"] is None:
        state["log"] = JsonlLog(path, iteration - 1, label=run_name, flag="--grpo-metrics-file",
                                header={"run_name": run_name, "train_iters": margs.train_iters})
    state["log"].write(record)
