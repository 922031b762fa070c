"""A GRPO training run whose inner optimizer has TE FusedAdam's semantics (megatron_grpo/platform/fused_adam.py):

    torchrun --nproc_per_node 2 tests/multiproc/fused_adam_probe.py OUT.json [--apex] <training flags...>

megatron-core picks TE's FusedAdam on CUDA when transformer-engine is installed; here the CPU
double takes its place (--apex: apex's, state made lazily). Per rank and iteration it records
each param group's step counter, and the most optimizer state allocated at the end of any
step() call of the iteration against what the memory tier's windows allow: the resident units'
state plus three streamed units' (running, arriving, leaving). Rank 0 writes OUT.json.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from harness import leave, write_gathered  # noqa: E402  (the probes' shared epilogue)


def main():
    import torch

    from megatron_grpo.platform.fused_adam import install
    from megatron_grpo.megatron import grpo_hooks, grpo_optimizers
    from megatron_grpo.training.arguments import parse_args
    from megatron_grpo.training.loop import run

    out_path, argv = sys.argv[1], sys.argv[2:]
    apex = "--apex" in argv
    argv = [a for a in argv if a != "--apex"]
    install(eager=not apex)
    cfg = parse_args(argv, world_size=int(os.environ["WORLD_SIZE"]))
    hooks = grpo_hooks(cfg)
    probe, records = {}, []
    base_after_build, base_before, base_after = hooks.after_build, hooks.before_step, hooks.after_step

    def after_build(built):
        base_after_build(built)
        probe["opts"] = grpo_optimizers(built.optimizer)
        assert all(type(o.optimizer).__name__ == "FusedAdamDouble" for o in probe["opts"])

    def before_step(iteration):
        base_before(iteration)
        for o in probe["opts"]:
            o.optimizer.reset_peak()

    def unit_bytes(o, ctrl):
        out = {}
        for model_param, shard in o._pairs():
            unit = ctrl.unit_of_bucket[id(o._bucket_of(model_param))]
            for v in o.optimizer.state.get(shard, {}).values():
                if torch.is_tensor(v) and v.numel() == shard.numel() and v.numel() > 1:
                    out[unit] = out.get(unit, 0) + v.numel() * v.element_size()
        return out

    def after_step(iteration):
        rec = {"iteration": iteration, "counters": [], "peak": 0, "bound": 0, "total": 0,
               "streamed_allocated": 0}
        for o in probe["opts"]:
            ctrl, placement = o.grpo, o.placement
            rec["counters"] += [g.get("step") for g in o.optimizer.param_groups if g["params"]]
            per_unit = unit_bytes(o, ctrl)
            windows = placement.windows(ctrl.step.stable_update) if placement is not None else []
            streamed = [per_unit.get(u, 0) for u in windows]
            rec["peak"] += o.optimizer.peak_state_bytes
            rec["total"] += sum(per_unit.values())
            rec["bound"] += sum(b for u, b in per_unit.items() if u not in windows) \
                + 3 * max(streamed, default=0)
            if placement is not None:
                placement.store.wait_all()
                placement.settle()
                # Streamed units' state with memory after the step: none is left resident.
                rec["streamed_allocated"] += sum(
                    v.untyped_storage().nbytes() for mp, s in o._pairs()
                    if ctrl.unit_of_bucket[id(o._bucket_of(mp))] in windows
                    for v in o.optimizer.state.get(s, {}).values() if torch.is_tensor(v) and v.numel() > 1)
        records.append(rec)
        base_after(iteration)

    hooks.after_build, hooks.before_step, hooks.after_step = after_build, before_step, after_step
    run(cfg, hooks)
    write_gathered(out_path, records)


if __name__ == "__main__":
    main()
    leave()
