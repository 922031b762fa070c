"""Stream and timing checks of phase b (each a function ``(ex: Expect, device)``): the CUDA-event
interval timer against a known sleep kernel, importance on the controller's side stream
overlapping the main stream, and a release-while-pending stress test of the error-feedback
residuals (a residual freed right after a side-stream read is queued, then many allocations of
its size on the main stream: with no ``record_stream`` / event guarding the free, the caching
allocator hands its block to one of them and the queued read sees their bytes).

The timing checks need CUDA and are skipped on the CPU; the stress test runs there too (it then
checks the logic and the API, not the allocator). tools/gpu_check.py runs them in a worker
process of their own (``--worker streams``) before any training run shares the device.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from typing import Callable, Dict

from .common import CheckSkipped, Expect

def _cycles_per_ms() -> float:
    """Clock cycles of torch.cuda._sleep per millisecond on this device (event-measured)."""
    import torch

    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    n, rate = 10_000_000, 0.0
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(n)
        e1.record()
        e1.synchronize()
        rate = n / max(e0.elapsed_time(e1), 1e-3)
        n = int(rate * 30)
    return rate


def _host_synced_ms(cycles: int) -> float:
    """Wall time of one sleep kernel, host clock, synchronized around it (the reference)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def check_interval_timer_cuda(ex: Expect, device: str = "cuda") -> None:
    import torch

    from megatron_grpo.grpo.timing import IntervalTimer

    if torch.device(device).type != "cuda":
        raise CheckSkipped("needs CUDA events")
    rate = _cycles_per_ms()
    cycles = int(rate * 40)  # ~40 ms per interval
    ex.number("sleep_cycles_per_ms", rate)
    ref = [_host_synced_ms(cycles) for _ in range(2)]
    timer = IntervalTimer(torch.cuda.Event)
    ex.that(timer.on_device, "IntervalTimer(torch.cuda.Event).on_device")
    torch.cuda.synchronize()
    host_inside = 0.0
    t0 = time.perf_counter()
    with timer.time():
        torch.cuda._sleep(cycles)
    host_inside += time.perf_counter() - t0
    torch.cuda._sleep(2 * cycles)  # between the intervals: must not be counted
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # events go on the stream the work runs on
        t0 = time.perf_counter()
        with timer.time():
            torch.cuda._sleep(cycles)
        host_inside += time.perf_counter() - t0
    torch.cuda.current_stream().wait_stream(side)
    total_ms = 1e3 * timer.total_s()
    ref.extend(_host_synced_ms(cycles) for _ in range(2))
    one = statistics.median(ref)
    expected = 2 * one
    ex.number("timer_ms", total_ms)
    ex.number("expected_ms", expected)
    ex.that(abs(total_ms - expected) <= 0.12 * expected + 1.0,
            f"two 40 ms sleep intervals (one on a side stream, 80 ms of sleep between them "
            f"outside): timer {total_ms:.2f} ms vs host-synced reference {expected:.2f} ms "
            f"(within 12% + 1 ms; single sleep {min(ref):.2f}-{max(ref):.2f} ms)")
    ex.that(1e3 * host_inside < 0.25 * one, f"no host sync while timing: host time inside the two "
            f"blocks {1e3 * host_inside:.3f} ms (< 25% of one interval, {0.25 * one:.1f} ms)")
    host_timer = IntervalTimer()
    torch.cuda.synchronize()
    with host_timer.time():
        torch.cuda._sleep(cycles)
    host_read = 1e3 * host_timer.total_s()
    torch.cuda.synchronize()
    ex.info(f"timer {total_ms:.2f} ms vs reference {expected:.2f} ms")
    ex.info(f"a host timer around the same kernel reads {host_read:.3f} ms (why GRPO uses events)")
    timer.reset()
    ex.that(timer.total_s() == 0.0, "reset() clears the device intervals")


class _FakeBucket:
    def __init__(self, param) -> None:
        self.params_list = [param]
        self.grad_data = param.main_grad.view(-1)


class _FakeGroup:
    def __init__(self, params) -> None:
        self.buckets = [_FakeBucket(p) for p in params]


class _FakeChunk:
    """The parts of a megatron DDP model chunk that GRPOController reads."""

    expert_parallel_bucket_groups = None
    # megatron's DistributedDataParallelConfig, as far as the controller reads it.
    ddp_config = type("DDPConfig", (), {"num_distributed_optimizer_instances": 1})()

    def __init__(self, module, groups) -> None:
        self.module = module
        self.bucket_groups = groups


def build_test_controller(device: str, units: int = 4, numel: int = 1 << 16):
    """A GRPOController over ``units`` one-parameter buckets (fp32, main_grad set) on a 1-rank
    process group (gloo: a world of one issues no collective). Returns (controller, params)."""
    import torch
    import torch.distributed as dist

    from megatron_grpo.grpo.config import GRPOConfig
    from megatron_grpo.grpo.controller.core import GRPOController

    if not dist.is_initialized():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    module = torch.nn.Module()
    params = []
    gen = torch.Generator().manual_seed(3)
    for i in range(units):
        p = torch.nn.Parameter(torch.randn(numel, generator=gen).to(device))
        p.main_grad = torch.randn(numel, generator=gen).to(device)
        module.register_parameter(f"w{i}", p)
        params.append(p)
    chunk = _FakeChunk(module, [_FakeGroup([p]) for p in params])
    config = GRPOConfig(enabled=True)
    config.validate(1)
    return GRPOController(config, [chunk], torch.device(device), dp_group=None), params


def check_side_stream_overlap(ex: Expect, device: str = "cuda") -> None:
    """The real path: GRPOBucketGroup._side_stream + GRPOController.observe_importance +
    join_side_stream, with importance made long by a sleep kernel inside the timed block."""
    import torch

    from megatron_grpo.megatron.bucket_group import GRPOBucketGroup

    ctrl, params = build_test_controller(device)
    if torch.device(device).type != "cuda":  # the CPU dry run: the same calls, nothing to time
        ex.that(len(ctrl.units) == 4 and ctrl.side_stream is None,
                f"test controller on the CPU: {len(ctrl.units)} units, no side stream (the overlap "
                f"itself needs CUDA streams)")
        ctrl.begin_step(0)
        unit = type("Unit", (), {"grpo": ctrl})()
        with GRPOBucketGroup._side_stream(unit):
            ctrl.observe_importance(0)
        ctrl.join_side_stream()
        ctrl.end_step()
        _expect_committed(ex, ctrl, params)
        return
    ex.that(ctrl.side_stream is not None and ctrl.side_stream != torch.cuda.current_stream()
            and ctrl.side_stream != torch.cuda.default_stream(),
            "the controller has its own side stream (not the current / default stream)")
    ex.that(ctrl.importance_timer.on_device and ctrl.wait_timer_.on_device,
            "importance and wait timers use CUDA events")
    rate = _cycles_per_ms()
    A, B, C = 10.0, 80.0, 40.0  # ms: backward so far, importance (side stream), rest of backward
    real_observe = ctrl.importance.observe

    def slow_observe(*args, **kwargs):
        real_observe(*args, **kwargs)
        torch.cuda._sleep(int(B * rate))  # stands in for a long importance computation

    unit = ctrl.units[0]  # warm-up: first launches load kernels, not part of the timing
    real_observe(0, [p.main_grad for p in unit.params], [p.detach() for p in unit.params])
    ctrl.importance.discard()
    ctrl.importance.observe = slow_observe
    ctrl.begin_step(0)
    ex.that(ctrl.step.measure_importance, "iteration 1 measures importance (interval 1)")
    bucket_group = type("Unit", (), {})()
    bucket_group.grpo = ctrl
    main = torch.cuda.current_stream()
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("t0", "s0", "s1", "m0", "m1", "end")}
    torch.cuda.synchronize()
    host0 = time.perf_counter()
    ev["t0"].record(main)
    torch.cuda._sleep(int(A * rate))
    with GRPOBucketGroup._side_stream(bucket_group):  # the path start_grad_sync takes
        on_side = torch.cuda.current_stream() == ctrl.side_stream
        ev["s0"].record()
        ctrl.observe_importance(0)
        ev["s1"].record()
    ev["m0"].record(main)
    torch.cuda._sleep(int(C * rate))
    ev["m1"].record(main)
    ctrl.join_side_stream()
    ev["end"].record(main)
    host_enqueue = 1e3 * (time.perf_counter() - host0)
    ev["end"].synchronize()
    at = {k: ev["t0"].elapsed_time(e) for k, e in ev.items()}
    ex.that(on_side, "GRPOBucketGroup._side_stream makes the controller's side stream current")
    ex.that(host_enqueue < 0.5 * B, f"enqueueing took {host_enqueue:.2f} ms on the host "
            f"(< {0.5 * B:.0f} ms: no host sync in the side-stream path)")
    overlap = min(at["s1"], at["m1"]) - max(at["s0"], at["m0"])
    ex.number("overlap_ms", overlap)
    ex.that(overlap > 0.8 * C, f"side [{at['s0']:.1f}, {at['s1']:.1f}] ms and main "
            f"[{at['m0']:.1f}, {at['m1']:.1f}] ms overlap by {overlap:.1f} ms (> {0.8 * C:.0f})")
    serial, lo, hi = A + B + C, 0.9 * (A + B), A + B + 0.5 * C
    ex.number("step_ms", at["end"])
    ex.that(lo <= at["end"] <= hi, f"main stream after join_side_stream: {at['end']:.1f} ms in "
            f"[{lo:.0f}, {hi:.0f}] (overlapped {A + B:.0f}; serial would be {serial:.0f}, "
            f"no join {A + C:.0f})")
    imp = 1e3 * ctrl.importance_timer.total_s()
    ex.number("importance_ms", imp)
    ex.that(0.88 * B <= imp <= 1.15 * B + 2.0, f"importance timer (events on the side stream) "
            f"{imp:.2f} ms for the {B:.0f} ms importance block")
    ex.info(f"side {at['s1'] - at['s0']:.1f} ms || main {at['m1'] - at['m0']:.1f} ms: "
            f"overlap {overlap:.1f} ms, step {at['end']:.1f} ms (serial {serial:.0f})")
    ctrl.end_step()
    _expect_committed(ex, ctrl, params)


def _expect_committed(ex: Expect, ctrl, params) -> None:
    scores = ctrl.importance.bucket_scores()
    ref = float((params[0].main_grad.double().abs() * params[0].detach().double().abs()).sum())
    ex.that(abs(float(scores[0]) - ref) <= 1e-3 * ref and float(scores[1]) == 0.0,
            f"end_step commits the side-stream measurement: unit 0 score {float(scores[0]):.6g} "
            f"(float64 reference {ref:.6g}), unobserved unit 1 stays 0")


def _owe_and_stage(ef, key, grad, c, dp):
    """What CompressedReduceScatter does with the error-feedback state, without the network:
    c = g + r into ``grad`` (the residual is released right after), the payload, the staged
    commit, then the reduce-scatter's overwrite of this rank's shard."""
    owed = ef.owed(key, grad)
    payload = c.compress_rows(owed.view(dp, -1))
    ef.stage(key, grad, payload, 0, c)
    grad[: grad.numel() // dp].fill_(123.0)
    return payload


def check_release_while_pending(ex: Expect, device: str = "cuda", steps: int = 10,
                                numel: int = 1 << 20, keys: int = 4, fillers: int = 6) -> None:
    """ErrorFeedback with the memory tier's OffloadedResiduals on ``device``: every residual is
    read on a side stream held back by a sleep kernel, so its add is still queued when
    ``release`` frees it; the main stream then allocates ``fillers`` tensors of the same size
    and fills them with 7e30. Payloads and residuals must equal a CPU ErrorFeedback's bit for bit."""
    import torch

    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.error_feedback import ErrorFeedback
    from megatron_grpo.offload import ChunkStore, OffloadConfig
    from megatron_grpo.offload.residuals import OffloadedResiduals

    cuda = torch.device(device).type == "cuda"
    c, dp = build_compressor("int4", 256), 2
    names = [(u, 0) for u in range(keys)]
    side = torch.cuda.Stream() if cuda else None
    sleep = int(2 * _cycles_per_ms()) if cuda else 0  # ~2 ms: the add stays queued
    bad_payloads, corrupted = [], 0
    with ChunkStore(OffloadConfig(target="cpu", chunk_mb=1.0), rank=0) as store:
        res = OffloadedResiduals(store, "cpu", lookahead=2)
        ef_dev, ef_ref = ErrorFeedback(), ErrorFeedback()
        ef_dev.use_store(res)
        for step in range(steps):
            res.begin_step()  # main stream: the first reads are fetched into main-stream blocks
            held = []
            for key in reversed(names):
                g = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + key[0]))
                grad = g.to(device, copy=True)
                if cuda:
                    side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                    if cuda:
                        torch.cuda._sleep(sleep)
                    payload = _owe_and_stage(ef_dev, key, grad, c, dp)
                for _ in range(fillers):  # main stream, while the side stream sleeps
                    held.append(torch.full((numel,), 7.0e30, device=device))
                if cuda:
                    torch.cuda.current_stream().wait_stream(side)
                ref = _owe_and_stage(ef_ref, key, g.clone(), c, dp)
                if not torch.equal(payload.cpu(), ref):
                    bad_payloads.append(f"step {step} key {key}")
                    corrupted += int((payload.cpu() != ref).any(dim=1).sum())
            ef_dev.commit()
            ef_ref.commit()
            del held
        store.wait_all()
        res.settle()
        same = [k for k in names if torch.equal(ef_dev.residual(k).cpu(), ef_ref.residual(k))]
    ex.that(not bad_payloads, f"{steps} steps x {keys} residuals of {numel:,} elements, each "
            f"released while its side-stream add was queued, {fillers} same-size main-stream "
            f"allocations after each: payloads identical to the CPU reference"
            + (f"; {len(bad_payloads)} differ ({corrupted} rows), first {bad_payloads[:3]}"
               if bad_payloads else ""))
    ex.that(len(same) == keys, f"residuals after the last step identical to the CPU reference: "
            f"{len(same)}/{keys}")


CHECKS: Dict[str, Callable] = {
    "interval_timer": check_interval_timer_cuda,
    "side_stream_overlap": check_side_stream_overlap,
    "release_while_pending": check_release_while_pending,
}
