"""RunHooks: the extension points of a training run (megatron_grpo.training.loop.run).

Its own module, below both users, so the data flow stays one way: the megatron glue
(megatron_grpo.megatron.grpo_hooks) builds hooks and the training entry calls them, and
neither imports the other for it (before, loop.py and megatron/__init__.py imported each other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class RunHooks:
    """Extension points of a run; the defaults do nothing (the megatron baseline)."""

    optimizer_factory: Optional[Callable] = None
    """(OptimizerConfig, model_chunks) -> optimizer; default megatron's get_megatron_optimizer."""
    ddp_class: Optional[type] = None
    """DDP class; default megatron's DistributedDataParallel."""
    bucket_size: Optional[int] = None
    """DDP bucket size in elements, overriding --ddp-bucket-size."""
    after_build: Callable = lambda built: None
    """Called once the model, DDP and optimizer exist (before --load)."""
    before_step: Callable = lambda iteration: None
    """Called before each training step."""
    after_step: Callable = lambda iteration: None
    """Called after each optimizer step (iteration = steps done)."""
    step_metrics: Callable = lambda iteration, wire, step_time: {}
    """Extra fields for the iteration's metrics record (wire: the step's byte counts)."""
    checkpoint_state: Callable = lambda: {}
    """Extra plain state stored in checkpoints, identical on all ranks (written by rank 0)."""
    load_state: Callable = lambda state: None
    """Restores what checkpoint_state returned."""
    rank_state: Callable = lambda: {}
    """Extra state that differs per rank, stored in the rank's own checkpoint file."""
    load_rank_state: Callable = lambda state: None
    """Restores what rank_state returned."""
    params_between_syncs: Callable = lambda: set()
    """Ids of parameters whose data-parallel copies are identical only inside each
    distributed-optimizer instance after this step (GRPO's periodic tiers between syncs); the
    weight check compares all the others across every data-parallel copy."""
    before_save: Callable = lambda: None
    """Called before each checkpoint is written (offloaded state comes back to be saved)."""
    finish: Callable = lambda: None
    """Called once when the run ends, normally or by an exception (background workers stop,
    offload files are deleted)."""
