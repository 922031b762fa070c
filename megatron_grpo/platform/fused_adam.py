"""FusedAdamDouble: transformer-engine's and apex's FusedAdam, their observable semantics in
plain torch. Installed where megatron-core picks its Adam class, it makes a run on a machine
without TE or apex (CPU included) exercise what a CUDA run with them does. The one copy: the CPU
tests and the device check (tools/gpu_checks/fused_adam.py) both use it.

What it copies (read from transformer_engine/pytorch/optimizers/fused_adam.py and
apex/optimizers/fused_adam.py):
* ONE step counter per param group, ``group["step"]``, advanced by every ``step()`` call for
  every param group it is handed, whatever the parameters' gradients; Adam's bias correction
  uses that group counter (there is no per-parameter ``state["step"]``).
* TE: the state of EVERY parameter of every group it is handed (``exp_avg``, ``exp_avg_sq``) is
  made at the first ``step()`` that sees it, with or without a gradient (``eager=True``).
  apex makes it only for parameters with a gradient (``eager=False``).
* apex reads ``group["params"][0]`` of every group: an empty param group fails
  (``empty_group_fails``, the default: the stricter of the two); TE skips an empty group.
* the update of the fused kernel (csrc multi_tensor_adam.cu): m, v, m/bc1 / (sqrt(v/bc2)+eps),
  adam_w_mode adds the decay to the update, else to the gradient.

Instrumentation: ``calls`` (step() calls), ``peak_state_bytes`` (the most bytes of optimizer
state with allocated storage seen at the end of any step() call since ``reset_peak()``).
"""

from __future__ import annotations

import torch


class FusedAdamDouble(torch.optim.Optimizer):
    eager = True  # TE's behaviour; install(eager=False) for apex's
    empty_group_fails = True  # apex's; TE skips an empty group (False)

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.calls = 0
        self.peak_state_bytes = 0

    def reset_peak(self) -> None:
        self.peak_state_bytes = 0

    def state_bytes(self) -> int:
        """Bytes of optimizer state whose storage is allocated now (offloaded state has 0)."""
        return sum(v.untyped_storage().nbytes() for st in self.state.values() for v in st.values()
                   if torch.is_tensor(v))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.calls += 1
        for group in self.param_groups:
            params = group["params"]
            if len(params) == 0:
                if not self.empty_group_fails:
                    continue  # TE does not advance an empty group
                # apex: device = group['params'][0].device
                raise IndexError("FusedAdam (apex) indexes group['params'][0]: an empty param "
                                 "group fails")
            group["step"] = group["step"] + 1 if "step" in group else 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in params:
                state = self.state[p]
                if len(state) == 0 and (self.eager or p.grad is not None):
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
        self.peak_state_bytes = max(self.peak_state_bytes, self.state_bytes())
        return loss


def install(eager: bool = True, empty_group_fails: bool = True) -> type:
    """Make megatron-core build FusedAdamDouble where it would build TE's (``eager``) or apex's
    FusedAdam, with the module flags a machine with that package has: megatron.core.optimizer
    looks ``Adam`` and ``USING_PYTORCH_OPTIMIZER`` up when it builds the optimizer (and then
    passes ``adam_w_mode``); its distrib_optimizer checks ``isinstance(optimizer, Adam)`` and
    takes the group ``step`` path of its state_dict from ``USING_TE/APEX_OPTIMIZER``. Call
    before the model is built."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.distrib_optimizer as dopt

    cls = type("FusedAdamDouble", (FusedAdamDouble,), {"eager": eager, "empty_group_fails": empty_group_fails})
    mopt.Adam = cls
    mopt.USING_PYTORCH_OPTIMIZER = False
    dopt.Adam = cls
    dopt.HAVE_APEX_OR_TE = True
    dopt.USING_TE_OPTIMIZER, dopt.USING_APEX_OPTIMIZER = eager, not eager
    return cls
