"""Runs the real training loop with one parameter corrupted on some ranks, for the weight check.

    torchrun --nproc_per_node 4 tests/multiproc/weight_check_probe.py OUT.json MODE PARAM ITER \
        <training flags...>

MODE says whose copy of PARAM (a name from the model's named_parameters) gets its lowest bit of
one element flipped right after the optimizer step of iteration ITER (before the check runs):
``tp`` - every rank with tensor-parallel rank 1 (so only the TP copies disagree), ``dp`` - every
rank with data-parallel rank 1 (only the DP replicas disagree), ``pp`` - every rank of the last
pipeline stage (PARAM: its copy of the tied embedding, output_layer.weight), ``none`` - nobody.

Every rank records the error the run stopped with (or None) and the sequence of collectives
(op, bytes) issued under the wire counter's "weight_check" tag; rank 0 writes all of it to OUT.
"""

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from harness import leave, write_gathered  # noqa: E402  (the probes' shared epilogue)


def main():
    import torch.distributed as dist

    from megatron_grpo.comm.wire import wire_counter
    from megatron_grpo.training.arguments import parse_args
    from megatron_grpo.megatron import run_hooks
    from megatron_grpo.training.loop import run

    out_path, mode, param_name, at_iter, argv = (sys.argv[1], sys.argv[2], sys.argv[3],
                                                 int(sys.argv[4]), sys.argv[5:])
    cfg = parse_args(argv, world_size=int(os.environ["WORLD_SIZE"]))
    hooks = run_hooks(cfg)
    state = {"calls": [], "perturbed": False}
    base_after_build, base_after_step = hooks.after_build, hooks.after_step

    def after_build(built):
        base_after_build(built)
        state["built"] = built
        # Spy on the counter (installed by now): the exact calls the check makes on this rank.
        counter = wire_counter()
        record = counter.record

        def spy(op, nbytes, group=None):
            stack = counter._stack()
            if stack and stack[-1] == "weight_check":
                state["calls"].append([op, nbytes])
            record(op, nbytes, group)

        counter.record = spy

    def after_step(iteration):
        base_after_step(iteration)
        if iteration != at_iter or mode == "none":
            return
        from megatron.core import parallel_state as ps

        if mode == "pp":
            mine = ps.is_pipeline_last_stage()
        else:
            mine = (ps.get_tensor_model_parallel_rank() if mode == "tp"
                    else ps.get_data_parallel_rank()) == 1
        if mine:
            p = dict(state["built"].ddp_model[0].module.named_parameters())[param_name]
            if mode == "tp":
                assert not getattr(p, "tensor_model_parallel", False), f"{param_name} is TP-split"
            with torch.no_grad():
                p.data.view(-1).view(torch.int32)[5] ^= 1  # one bit: the smallest possible drift
            state["perturbed"] = True

    hooks.after_build, hooks.after_step = after_build, after_step
    error = None
    try:
        run(cfg, hooks)
    except RuntimeError as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    mine = {"rank": dist.get_rank(), "error": error, "calls": state["calls"],
            "perturbed": state["perturbed"]}
    write_gathered(out_path, mine)


if __name__ == "__main__":
    main()
    leave()
