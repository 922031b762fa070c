"""GRPO's classes at Megatron-LM's construction points, and the check that they were used.

Megatron-LM (0.16.1-0.19.x) has no plug-in hook for a DDP or optimizer class, so its module
globals are replaced before the training script runs:

- ``megatron.training.training.DDP``: ``get_model`` wraps each model chunk with it (0.16.1-0.19.x);
- ``megatron.training.models.dist_utils.DistributedDataParallel``: the model builders of 0.19
  (``setup_model_and_optimizer`` -> ``build_distributed_models`` -> ``_ddp_wrap``) import it
  themselves, so replacing ``training.DDP`` alone would silently leave megatron's class there;
- ``megatron.training.training.get_megatron_optimizer``: builds the distributed optimizer.

Megatron compares the class it is about to build with the module's own name (``DP is DDP``) to
decide whether to precompute a parameter layout; since the names themselves are replaced, those
comparisons hold for GRPO's class, and GRPODistributedDataParallel drops a precomputed layout
to keep its own bucket size (ddp.py).

A Megatron-LM whose loop builds its model or optimizer somewhere else is caught when the
optimizer is built (every chunk must be GRPO's DDP) and after ``setup_model_and_optimizer``
(the optimizer must be GRPO's): the run stops naming the point, not later with wrong traffic.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, List, Tuple

from megatron_grpo.grpo.config import ConfigError
from megatron_grpo.megatron.ddp import GRPODistributedDataParallel
from megatron_grpo.megatron.optimizer import get_grpo_optimizer, grpo_optimizers

DDP_POINTS: Tuple[Tuple[str, str], ...] = (
    ("megatron.training.training", "DDP"),
    ("megatron.training.models.dist_utils", "DistributedDataParallel"),
)
OPTIMIZER_POINT = ("megatron.training.training", "get_megatron_optimizer")
SETUP_POINT = ("megatron.training.training", "setup_model_and_optimizer")


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def bound_ddp_class(grpo_config) -> type:
    """GRPODistributedDataParallel with this run's GRPO settings bound, constructible with
    exactly megatron's DDP arguments."""

    class GRPODDP(GRPODistributedDataParallel):
        def __init__(self, config, ddp_config, module, *args, **kwargs):
            if grpo_config.enabled:
                # GRPO's --grpo-bucket-mb, in place of the size Megatron-LM resolved from
                # --ddp-bucket-size (the project's own loop passes it the same way).
                ddp_config.bucket_size = grpo_config.bucket_elements
            kwargs.setdefault("grpo_config", grpo_config)
            super().__init__(config, ddp_config, module, *args, **kwargs)

    GRPODDP.__name__ = GRPODDP.__qualname__ = "GRPODistributedDataParallel"
    return GRPODDP


def install(grpo_config, after_build: Callable, rank: int) -> List[str]:
    """Replace every construction point this Megatron-LM has; returns their names.
    ``after_build(model_chunks, optimizer)`` runs once GRPO's optimizer exists (before
    Megatron-LM loads a checkpoint into it)."""
    ddp = bound_ddp_class(grpo_config)
    replaced = []
    for module_name, attr in DDP_POINTS:
        module = _module(module_name)
        if module is not None and hasattr(module, attr):
            setattr(module, attr, ddp)
            replaced.append(f"{module_name}.{attr}")
    if not replaced:
        raise ConfigError(f"rank {rank}: this Megatron-LM has none of the DDP construction points "
                          f"the GRPO runner knows ({', '.join(m + '.' + a for m, a in DDP_POINTS)}); "
                          f"it supports Megatron-LM core_v0.16.1 through core_v0.19.x")
    training = _module(OPTIMIZER_POINT[0])
    original_get = getattr(training, OPTIMIZER_POINT[1], None)
    if original_get is None:
        raise ConfigError(f"rank {rank}: this Megatron-LM has no {'.'.join(OPTIMIZER_POINT)}; the "
                          f"GRPO runner supports Megatron-LM core_v0.16.1 through core_v0.19.x")

    @functools.wraps(original_get)
    def get_megatron_optimizer(config, model_chunks, **kwargs):
        chunks = list(model_chunks)
        foreign = [type(c).__name__ for c in chunks if not isinstance(c, GRPODistributedDataParallel)]
        if foreign:
            raise ConfigError(f"rank {rank}: --grpo is on but the model chunks were wrapped by "
                              f"{', '.join(sorted(set(foreign)))}, not GRPO's DDP: this Megatron-LM "
                              f"builds DDP outside the points the runner replaced ({', '.join(replaced)})")
        optimizer = get_grpo_optimizer(config, chunks, grpo_config, **kwargs)
        after_build(chunks, optimizer)
        return optimizer

    setattr(training, OPTIMIZER_POINT[1], get_megatron_optimizer)
    replaced.append(".".join(OPTIMIZER_POINT))
    original_setup = getattr(training, SETUP_POINT[1])

    @functools.wraps(original_setup)
    def setup_model_and_optimizer(*args, **kwargs):
        out = original_setup(*args, **kwargs)
        optimizer = out[1]
        if not grpo_optimizers(optimizer):
            raise ConfigError(f"rank {rank}: --grpo is on but setup_model_and_optimizer built "
                              f"{type(optimizer).__name__} without GRPO's distributed optimizer: "
                              f"this Megatron-LM builds its optimizer outside "
                              f"{'.'.join(OPTIMIZER_POINT)}")
        return out

    setattr(training, SETUP_POINT[1], setup_model_and_optimizer)
    return replaced
