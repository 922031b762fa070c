"""Runs a real training (launch flags) under torchrun and measures what the planner predicts.

    torchrun --nproc_per_node 2 tests/multiproc/planner_probe.py OUT.json <training flags...>

Measured on every rank, from the actual tensors (not from formulas):
* model-state bytes after the last step: megatron DDP buffers (param_data, grad_data), the
  torch optimizer's exp_avg/exp_avg_sq, fp32 master params that have their own storage (not a
  view of a DDP buffer), GRPO error-feedback residuals and delayed accumulators;
* per iteration: the tier map, error-feedback bytes and, with periodic tiers, the outer
  optimizer's state bytes (anchors, momentum, delta residuals) (GRPO);
* activations: bytes of the distinct non-parameter storages autograd saves for backward during
  one training-mode forward of one micro-batch (``torch.autograd.graph.saved_tensors_hooks``);
* per iteration, sampled whenever gradient storage comes or goes (--grpo-release-grads), at
  the end of every forward, before the residuals are committed and after the step: the most
  bytes of all the above at once
  (``peak``: parameters, resident gradients, masters, moments, residuals committed and staged,
  accumulators, outer state, and the activations autograd holds at that moment), the most
  residual bytes (``ef_peak``) and the gradient storage's own peak (``grad_peak``).
Rank 0 writes everything (gathered from all ranks) to OUT.json.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from harness import leave, write_gathered  # noqa: E402  (the probes' shared epilogue)


def _ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def outer_state_bytes(outer_sync) -> int:
    """Bytes of the periodic tiers' outer state (megatron_grpo/comm/outer.py), 0 without it."""
    if outer_sync is None:
        return 0
    o = outer_sync.outer
    return (sum(t.numel() * t.element_size() for d in (o.anchor, o.momentum) for t in d.values())
            + o.ef.nbytes())


def model_state_bytes(built, ctrl, outer_sync=None) -> dict:
    from megatron_grpo.training.model import optimizer_list

    out = dict(params=0, grads=0, master_params=0, optimizer_moments=0, error_feedback=0,
               delayed_accumulators=0, outer_state=outer_state_bytes(outer_sync),
               params_outside_buffers=0)
    buffer_ptrs = set()
    for chunk in built.ddp_model:
        for buf in chunk.buffers + chunk.expert_parallel_buffers:
            if buf.param_data is not None:
                out["params"] += buf.param_data.numel() * buf.param_data.element_size()
                buffer_ptrs.add(_ptr(buf.param_data))
            if buf.grad_data is not None:  # megatron's one buffer
                out["grads"] += buf.grad_data.numel() * buf.grad_data.element_size()
                buffer_ptrs.add(_ptr(buf.grad_data))
            else:  # --grpo-release-grads: storage per bucket, resident or not now
                out["grads"] += sum(b.grpo_grads.resident_bytes() for b in buf.buckets)
        for p in chunk.module.parameters():
            if _ptr(p) not in buffer_ptrs:  # a parameter megatron left outside its buffers
                out["params_outside_buffers"] += p.numel() * p.element_size()
    seen = set()
    for opt in optimizer_list(built.optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for master in group["params"]:
                # fp32 baseline: masters are views of the param buffer (no memory of their own).
                if _ptr(master) not in buffer_ptrs and _ptr(master) not in seen:
                    seen.add(_ptr(master))
                    out["master_params"] += master.untyped_storage().nbytes()
                for key in ("exp_avg", "exp_avg_sq"):
                    t = inner.state.get(master, {}).get(key)
                    if t is not None:
                        out["optimizer_moments"] += t.numel() * t.element_size()
    if ctrl is not None:
        out["error_feedback"] = ctrl.ef.nbytes()
        out["delayed_accumulators"] = ctrl.accum.nbytes()
    return out


class SavedActivations:
    """Bytes of the distinct non-parameter storages autograd holds for backward right now:
    installed for the whole run, each saved tensor is wrapped in a holder whose deletion (when
    autograd frees the saved variable) releases it."""

    def __init__(self) -> None:
        self.live = {}            # storage pointer -> [saved references, bytes]
        self.params = set()       # storage pointers of parameters (not activations)
        self.nbytes = 0

    def pack(self, t):
        ptr = _ptr(t)
        if ptr in self.params:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [0, t.untyped_storage().nbytes()]
            self.nbytes += entry[1]
        entry[0] += 1
        return _Held(self, ptr, t)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def drop(self, ptr) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if not entry[0]:
            self.nbytes -= entry[1]
            del self.live[ptr]


class _Held:
    __slots__ = ("owner", "ptr", "t")

    def __init__(self, owner, ptr, t) -> None:
        self.owner, self.ptr, self.t = owner, ptr, t

    def __del__(self) -> None:
        self.owner.drop(self.ptr)


class PeakSampler:
    """Everything the planner counts, summed at each sample; the most per iteration."""

    def __init__(self, built, ctrl, outer, saved: SavedActivations) -> None:
        self.built, self.ctrl, self.outer, self.saved = built, ctrl, outer, saved
        self.storages = [s for s in (c.__dict__.get("grpo_grad_storage") for c in built.ddp_model)
                         if s is not None]
        self.reset()

    def reset(self) -> None:
        self.peak = self.ef_peak = 0
        self.at_peak = {}

    def sample(self) -> None:
        state = model_state_bytes(self.built, self.ctrl, self.outer)
        state.pop("params_outside_buffers")
        state["activations"] = self.saved.nbytes
        total = sum(state.values())
        self.ef_peak = max(self.ef_peak, state["error_feedback"])
        if total > self.peak:
            self.peak, self.at_peak = total, state

    def install(self) -> None:
        for storage in self.storages:  # every allocation and release of gradient storage
            account = storage._account

            def sampled(account=account):
                account()
                self.sample()
            storage._account = sampled
        for chunk in self.built.ddp_model:  # the end of every forward (the loss included)
            chunk.module.register_forward_hook(lambda *_: self.sample())
        commit = self.ctrl.ef.commit

        def sampled_commit():  # after backward, every new residual staged beside the old ones
            self.sample()
            commit()
        self.ctrl.ef.commit = sampled_commit

    def record(self) -> dict:
        return dict(peak=self.peak, ef_peak=self.ef_peak, at_peak=self.at_peak,
                    grad_peak=sum(s.peak for s in self.storages) if self.storages else None)


def saved_activation_bytes(built, cfg) -> dict:
    """One forward of one micro-batch in training mode; sums what autograd keeps for backward."""
    import torch

    model = built.ddp_model[0]
    params = list(model.module.parameters())
    for p in params:
        p.requires_grad_(True)
    param_ptrs = {_ptr(p) for p in params}
    storages, views = {}, [0]

    def pack(t):
        views[0] += t.numel() * t.element_size()
        ptr = _ptr(t)
        if ptr not in param_ptrs:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (b, s), generator=gen)
    labels = torch.randint(0, 256, (b, s), generator=gen)
    position_ids = torch.arange(s).repeat(b, 1)  # one row per sample, as the data loader gives
    mask = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position_ids, mask, labels=labels)
    shape = list(loss.shape)
    del loss
    return dict(storages=sum(storages.values()), views=views[0], loss_shape=shape)


def main():
    import torch.distributed as dist

    from megatron_grpo.megatron import grpo_hooks, grpo_optimizers
    from megatron_grpo.training.arguments import parse_args
    from megatron_grpo.hooks import RunHooks
    from megatron_grpo.training.loop import run

    out_path, argv = sys.argv[1], sys.argv[2:]
    cfg = parse_args(argv, world_size=int(os.environ["WORLD_SIZE"]))
    import torch

    hooks = grpo_hooks(cfg) if cfg.grpo.enabled else RunHooks()
    probe = {"ctrl": None, "outer": None, "steps": [], "sampler": None}
    saved = SavedActivations()
    base_after_build, base_after = hooks.after_build, hooks.after_step

    def after_build(built):
        base_after_build(built)
        probe["built"] = built
        opts = grpo_optimizers(built.optimizer)
        probe["ctrl"] = opts[0].grpo if opts else None
        probe["outer"] = getattr(opts[0], "outer_sync", None) if opts else None
        saved.params = {_ptr(p) for chunk in built.ddp_model for p in chunk.module.parameters()}
        if probe["ctrl"] is not None:
            probe["sampler"] = PeakSampler(built, probe["ctrl"], probe["outer"], saved)
            probe["sampler"].install()

    def after_step(iteration):
        sampler = probe["sampler"]
        if sampler is not None:
            sampler.sample()  # the step's end: moments and staged residuals, before they go
            peaks = sampler.record()
        base_after(iteration)
        ctrl = probe["ctrl"]
        if ctrl is not None:
            sampler.sample()  # after the step: what stays
            probe["steps"].append(dict(iteration=iteration, ef_bytes=ctrl.ef.nbytes(),
                                       outer_bytes=outer_state_bytes(probe["outer"]),
                                       tiers="".join(t[0] for t in ctrl.tiers),
                                       stable_update=bool(ctrl.step.stable_update), **peaks))
            sampler.reset()

    hooks.after_build, hooks.after_step = after_build, after_step
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        run(cfg, hooks)
    built, ctrl = probe["built"], probe["ctrl"]
    record = dict(rank=dist.get_rank(), state=model_state_bytes(built, ctrl, probe["outer"]), steps=probe["steps"],
                  units=[u.numel for u in ctrl.units] if ctrl is not None else [],
                  activations=saved_activation_bytes(built, cfg))
    write_gathered(out_path, record)


if __name__ == "__main__":
    main()
    leave()
