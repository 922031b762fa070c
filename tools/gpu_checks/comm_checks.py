"""Collective checks of phase b at world size 1: GRPO's compressed collectives over the device's
process group (NCCL on a GPU) against the same calls over a gloo group on the CPU, bit for bit,
with async handles (``async_op=True`` then ``wait()``) where the API has them:

* ``CompressedReduceScatter`` (megatron_grpo/comm/dynamic.py), with and without replicated
  (exactly synced) elements, error feedback committed after each step;
* ``compressed_param_gather`` into a bf16 parameter buffer, replicated elements included;
* ``InterInstanceAllReduce`` (comm/hierarchical.py), with exact offsets;
* ``OuterOptimizer.sync`` (comm/outer.py), compressed and exact, Nesterov momentum.

At world size 1 the payload goes to oneself, so what is checked is everything around the
wire: the kernels, the async handles, the stream bookkeeping and that every tensor handed to
the collective is on the group's device (the byte counter's strict mode is on, with each group
bound to its device: a host tensor handed to NCCL fails here, not on a cluster).
tools/gpu_check.py runs them in a worker process (``--worker collectives``) that initialises
the default group on the device (NCCL) and a gloo group for the CPU side. On the CPU (dry run)
both sides are gloo groups on the CPU.
"""

from __future__ import annotations

import socket
from typing import Callable, Dict, List

from .common import Expect


def _bits(t):
    import torch

    t = t.detach().to("cpu", copy=True).contiguous()
    if t.is_floating_point():  # one NaN pattern: its payload is the device's (tensor_checks._bits)
        t[torch.isnan(t)] = float("nan")
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def init_groups(device: str):
    """(device group, cpu group, counter): the default group on ``device`` (NCCL on CUDA, else
    gloo) of world size 1, a gloo group for the CPU side, the byte counter installed in strict
    mode with both groups bound to their devices."""
    import torch
    import torch.distributed as dist

    from megatron_grpo.comm.wire import wire_counter

    if not dist.is_initialized():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    cpu_group = dist.new_group([0], backend="gloo")
    counter = wire_counter()
    counter.install()
    counter.set_strict(True)
    counter.bind_group_device(None, torch.device(device))
    counter.bind_group_device(cpu_group, torch.device("cpu"))
    return dist.group.WORLD, cpu_group, counter


def _grads(step: int, n: int):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    scales = torch.logspace(-3, 2, steps=8).repeat_interleave(-(-n // 8))[:n]
    return torch.randn(n, generator=g) * scales


def check_reduce_scatter(ex: Expect, device: str, groups) -> None:
    import torch

    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.dynamic import CompressedReduceScatter
    from megatron_grpo.comm.error_feedback import ErrorFeedback
    from megatron_grpo.comm.replicated import ReplicatedElements

    dev_group, cpu_group, _ = groups
    n = 3 * 4096 + 77
    index = torch.tensor([0, 5, 300, 4097, n - 1], dtype=torch.int64)
    for name in ("int4", "int8"):
        c = build_compressor(name, 256)
        efs = {"dev": ErrorFeedback(), "cpu": ErrorFeedback()}
        bad: List[str] = []
        for step in range(5):
            g = _grads(step, n)
            out = {}
            for side, where, group in (("dev", device, dev_group), ("cpu", "cpu", cpu_group)):
                grad = g.to(where, copy=True)
                rep = ReplicatedElements(index.to(where), n, 0) if step % 2 else None
                handle = CompressedReduceScatter(("u", 0), grad, grad[:n], efs[side], c, group,
                                                 async_op=True, replicated=rep)
                handle.wait()
                efs[side].commit()
                out[side] = (grad, handle.send, efs[side].residual(("u", 0)))
            for what, a, b in zip(("shard", "payload", "residual"), out["dev"], out["cpu"]):
                if not _same(a, b):
                    bad.append(f"step {step} {what}")
            if out["dev"][2].device.type != torch.device(device).type:
                bad.append(f"step {step}: residual left {device}")
        ex.that(not bad, f"CompressedReduceScatter {name} (async, 5 steps, replicated elements on "
                f"odd steps): shard, payload and residual on {device} identical to gloo/CPU"
                + (": " + ", ".join(bad[:4]) if bad else ""))


def check_param_gather(ex: Expect, device: str, groups) -> None:
    import torch

    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.dynamic import compressed_param_gather
    from megatron_grpo.comm.replicated import ReplicatedElements

    dev_group, cpu_group, _ = groups
    n = 2 * 4096 + 13
    c = build_compressor("int8", 256)
    index = torch.tensor([1, 2, 3, 4000, n - 2], dtype=torch.int64)
    init = (torch.randn(n, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    params = {"dev": init.to(device, copy=True), "cpu": init.clone()}
    bad = []
    for step in range(4):
        master = init.float() + 0.001 * (step + 1) * _grads(50 + step, n)
        for side, where, group in (("dev", device, dev_group), ("cpu", "cpu", cpu_group)):
            rep = ReplicatedElements(index.to(where), n, 0) if step % 2 else None
            compressed_param_gather(params[side], master.to(where), c, group, replicated=rep)
        if not _same(params["dev"], params["cpu"]):
            bad.append(f"step {step}")
    exact = bool(torch.equal(params["dev"].cpu()[index], master[index].to(torch.bfloat16)))
    ex.that(not bad and exact, f"compressed_param_gather int8 into a bf16 buffer (4 steps, "
            f"replicated elements on odd steps): {device} identical to gloo/CPU, replicated "
            f"elements exact" + (f"; differ at {bad}" if bad else "") + ("" if exact else "; not exact"))


def check_inter_instance(ex: Expect, device: str, groups) -> None:
    import torch

    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.error_feedback import ErrorFeedback
    from megatron_grpo.comm.hierarchical import InterInstanceAllReduce

    dev_group, cpu_group, _ = groups
    n = 4096 + 300
    c = build_compressor("int4", 256)
    offsets = torch.tensor([0, 17, 4095], dtype=torch.int64)
    efs = {"dev": ErrorFeedback(), "cpu": ErrorFeedback()}
    bad = []
    for step in range(4):
        g = _grads(80 + step, n)
        out = {}
        for side, where, group in (("dev", device, dev_group), ("cpu", "cpu", cpu_group)):
            shard = g.to(where, copy=True)
            h = InterInstanceAllReduce(("i", 0), shard, efs[side], c, group, async_op=True,
                                       exact_offsets=offsets.to(where) if step % 2 else None)
            h.wait()
            efs[side].commit()
            out[side] = (shard, efs[side].residual(("i", 0)))
        for what, a, b in zip(("shard", "residual"), out["dev"], out["cpu"]):
            if not _same(a, b):
                bad.append(f"step {step} {what}")
    ex.that(not bad, f"InterInstanceAllReduce int4 (async, 4 steps, exact offsets on odd steps): "
            f"shard and residual on {device} identical to gloo/CPU" + (f"; {bad[:4]}" if bad else ""))


def check_outer_sync(ex: Expect, device: str, groups) -> None:
    import torch

    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.outer import OuterOptimizer

    dev_group, cpu_group, _ = groups
    n = 3000
    start = torch.randn(n, generator=torch.Generator().manual_seed(9))
    outs = {}
    for side, where, group in (("dev", device, dev_group), ("cpu", "cpu", cpu_group)):
        opt = OuterOptimizer(0.7, 0.5, group)
        local = start.to(where, copy=True)
        opt.set_anchor("k", local)
        figures = []
        for step in range(4):
            local.sub_(0.01 * _grads(120 + step, n).to(where))
            compressor = build_compressor("int4", 256) if step < 3 else None  # the last one exact
            spread, size = opt.sync("k", local, compressor)
            figures.append((float(spread), float(size)))
        outs[side] = (local, opt.anchor["k"], opt.momentum["k"], figures)
    same = [_same(a, b) for a, b in zip(outs["dev"][:3], outs["cpu"][:3])]
    # The drift figures are norms: a reduction, summed in another order on the GPU (seen: the
    # state bit-identical, a figure not), so they agree to a relative 1e-5, not bit for bit.
    figs = [(d, c) for fd, fc in zip(outs["dev"][3], outs["cpu"][3]) for d, c in zip(fd, fc)]
    rel = max(abs(d - c) / max(abs(c), 1e-30) for d, c in figs)
    ex.that(all(same) and rel < 1e-5,
            f"OuterOptimizer.sync (lr 0.7, momentum 0.5; 3 int4 syncs, then an exact one): local "
            f"shard, anchor and momentum on {device} identical to gloo/CPU (local/anchor/momentum "
            f"{same}), drift figures within 1e-5 (max rel diff {rel:.2e})")


def check_collectives(ex: Expect, device: str = "cuda") -> None:
    groups = init_groups(device)
    counter = groups[2]
    counter.reset()
    for fn in (check_reduce_scatter, check_param_gather, check_inter_instance, check_outer_sync):
        try:
            fn(ex, device, groups)
        except Exception as exc:  # one failing part must not hide the others
            ex.that(False, f"{fn.__name__}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    calls = dict(counter.snapshot().get("calls", {}))
    wanted = ("all_to_all_single", "all_gather_into_tensor", "all_reduce")
    ex.that(all(calls.get(op, 0) > 0 for op in wanted),
            "the checks went through the counted collectives (strict device mode): "
            + ", ".join(f"{op} x{calls.get(op, 0)}" for op in wanted))
    ex.number("collective_calls", calls)


CHECKS: Dict[str, Callable] = {"collectives": check_collectives}
