"""The optimizer a device-check training run uses, and its step counters after the run.

megatron-core picks transformer-engine's FusedAdam when TE is importable, apex's when apex is,
else torch's AdamW. The memory tier's windowed optimizer step (megatron_grpo/megatron/offload.py)
calls the inner optimizer once per streamed unit; TE and apex keep ONE step counter per param
group and advance it on every call, so a wrong call pattern shows as a group counter above the
number of iterations. ``install(kind)`` makes megatron build, for this
process:

* ``te`` / ``apex``: the real FusedAdam (only where the package imports);
* ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on CUDA (per-parameter step tensors);
* ``double``: ``FusedAdamDouble`` (megatron_grpo/platform/fused_adam.py, TE's semantics),
  FusedAdam's observable semantics in plain torch, for machines without TE or apex, CPU
  included.

Every optimizer megatron builds is recorded; ``dump(path)`` writes their step counters as JSON
(rank-local) after the run.
"""

from __future__ import annotations

import json
from typing import List

import torch

from megatron_grpo.platform.fused_adam import FusedAdamDouble as _Double

KINDS = ("te", "apex", "torch_fused", "double")
GROUP_STEP_KINDS = ("te", "apex", "double")  # one counter per param group
RECORDED: List[torch.optim.Optimizer] = []


# FusedAdam's semantics as TE has them (eager state, an empty group skipped); the one copy
# lives in the package (megatron_grpo/platform/fused_adam.py), which the CPU tests use too.
FusedAdamDouble = type("FusedAdamDouble", (_Double,), {"eager": True, "empty_group_fails": False})


class TorchFusedAdamW(torch.optim.AdamW):
    """torch's AdamW with ``fused=True`` on CUDA, built where megatron builds FusedAdam (it
    passes ``adam_w_mode``)."""

    def __init__(self, params, adam_w_mode=True, **kwargs):
        params = list(params)
        tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        if not adam_w_mode:
            raise ValueError("gpu_check torch_fused: megatron asked for Adam with L2 decay "
                             "(adam_w_mode=False); only AdamW is wired here")
        fused = bool(tensors) and all(t.is_cuda for t in tensors)
        super().__init__(params, fused=fused, **kwargs)


def _real_class(kind: str):
    if kind == "te":
        from transformer_engine.pytorch.optimizers import FusedAdam
        return FusedAdam
    if kind == "apex":
        from apex.optimizers import FusedAdam
        return FusedAdam
    if kind == "torch_fused":
        return TorchFusedAdamW
    if kind == "double":
        return FusedAdamDouble
    raise ValueError(f"gpu_check: optimizer kind must be one of {', '.join(KINDS)}, got {kind!r}")


def install(kind: str) -> type:
    """Make megatron-core build ``kind`` (recorded) where it builds its Adam. Call before the
    model is built. megatron.core.optimizer reads ``Adam`` and ``USING_PYTORCH_OPTIMIZER`` when
    it builds the optimizer (and then passes ``adam_w_mode``); its distrib_optimizer takes the
    group-``step`` path of its state_dict from ``USING_TE/APEX_OPTIMIZER``."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    base = _real_class(kind)

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        RECORDED.append(self)

    cls = type(f"Recorded{base.__name__}", (base,), {"__init__": __init__})
    mopt.Adam = cls
    mopt.USING_PYTORCH_OPTIMIZER = False
    if kind in GROUP_STEP_KINDS:
        dopt.Adam = cls
        dopt.HAVE_APEX_OR_TE = True
        dopt.USING_TE_OPTIMIZER, dopt.USING_APEX_OPTIMIZER = kind != "apex", kind == "apex"
    return cls


def counters(opt) -> dict:
    """Step counters of one optimizer: per non-empty param group, and per parameter."""
    groups = [g.get("step") for g in opt.param_groups if g["params"]]
    params = []
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state.get(p, {})
            if "step" in st:
                params.append(float(st["step"]))
    return {"class": type(opt).__mro__[1].__name__,
            "groups": [float(s) if s is not None else None for s in groups], "params": params}


def dump(path: str, kind: str) -> None:
    with open(path, "w") as fh:
        json.dump({"kind": kind, "optimizers": [counters(o) for o in RECORDED]}, fh)
