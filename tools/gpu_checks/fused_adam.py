"""The optimizer a device-check training run uses, and its step counters after the run.

megatron-core picks transformer-engine's FusedAdam when TE is importable, apex's when apex is,
else torch's AdamW. The memory tier's windowed optimizer step (megatron_grpo/megatron/offload.py)
calls the inner optimizer once per streamed unit; TE and apex keep ONE step counter per param
group and advance it on every call, so a wrong call pattern shows as a group counter above the
number of iterations (issue 27, item 4). ``install(kind)`` makes megatron build, for this
process:

* ``te`` / ``apex``: the real FusedAdam (only where the package imports);
* ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on CUDA (per-parameter step tensors);
* ``double``: ``FusedAdamDouble``, FusedAdam's observable semantics in plain torch (a copy of
  the minimal logic of tests/fused_adam_double.py: the device check never imports from tests/),
  for machines without TE or apex, CPU included.

Every optimizer megatron builds is recorded; ``dump(path)`` writes their step counters as JSON
(rank-local) after the run.
"""

from __future__ import annotations

import json
from typing import List

import torch

KINDS = ("te", "apex", "torch_fused", "double")
GROUP_STEP_KINDS = ("te", "apex", "double")  # one counter per param group
RECORDED: List[torch.optim.Optimizer] = []


class FusedAdamDouble(torch.optim.Optimizer):
    """TE FusedAdam's observable semantics: ``group["step"]`` advanced by every ``step()`` call
    for every non-empty group whatever the gradients (bias correction uses it; no per-parameter
    step); the moments of EVERY parameter of a group made at the first ``step()`` (eager); the
    fused kernel's update (adam_w_mode: decay added to the update, else to the gradient)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if len(group["params"]) == 0:  # TE does not advance an empty group
                continue
            group["step"] = group["step"] + 1 if "step" in group else 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:  # eager: with or without a gradient
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if p.grad is None:
                    continue
                g = p.grad.float()
                if not self.adam_w_mode and decay:
                    g = g + decay * p
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + eps)
                if self.adam_w_mode and decay:
                    update = update + decay * p
                p.add_(update, alpha=-lr)
        return loss


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
