"""megatron-grpo: Gradient-aware Resource Partitioning Optimization for megatron-core.

Not Group Relative Policy Optimization (the RL algorithm): here GRPO ranks parameters by
gradient importance into core / dynamic / stable tiers and gives each tier its own
communication, compute and memory treatment inside megatron-core's DDP and distributed optimizer.
"""

__version__ = "0.1.0"

MOVED = {
    # Former module names -> where the layout tidy put them, for the modules user scripts import
    # (the README's and examples' imports, the documented planner, metrics and timing APIs). Each
    # old name is a small module that warns and gives the new one, for one release; CHANGELOG.md
    # ("Moved") lists every move, these and the internal ones without an old name.
    "megatron_grpo.config": "megatron_grpo.grpo.config",
    "megatron_grpo.controller": "megatron_grpo.grpo.controller.core",
    "megatron_grpo.importance": "megatron_grpo.grpo.importance",
    "megatron_grpo.timing": "megatron_grpo.grpo.timing",
    "megatron_grpo.metrics": "megatron_grpo.training.metrics",
    "megatron_grpo.metrics_log": "megatron_grpo.training.metrics_log",
    "megatron_grpo.planner_capacity": "megatron_grpo.planner.capacity",
    "megatron_grpo.planner_internode": "megatron_grpo.planner.internode",
}


def _moved(old: str) -> None:
    """Run by the module being imported under the former name ``old`` (after importing its new
    module): that name now gives the new module itself, so classes and functions are the same
    objects under both names. The DeprecationWarning names the line that imported ``old`` (import
    machinery skipped), so Python's default filter shows it when that line is in a script."""
    import sys
    import warnings

    new = MOVED[old]
    warnings.warn(f"{old} has moved to {new}: import {new} instead (the old name goes in the next "
                  f"release)", DeprecationWarning, stacklevel=3)
    sys.modules[old] = sys.modules[new]  # the import system hands out what sys.modules holds now
