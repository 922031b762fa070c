"""The tensor checks of launch/gpu_check.py: compressors, error feedback, importance tracker,
CUDA-event interval timer, side-stream overlap, CPU mode as a no-op and the pinned-memory
offload worker part, each a function ``(ex: Expect, device="cuda")`` listed in ``WORKERS``.

The runner starts each in a subprocess of its own (``gpu_check.py --worker NAME``), so a crash
or a hung kernel costs that check alone. With ``device="cpu"`` the same logic runs against
itself on a CPU machine (tests/unit/test_gpu_check_script.py). They need only tensors and
megatron_grpo, no training run; kept apart from run_checks.py for that reason.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Callable, Dict, List

from .common import Expect


def _bits(t):
    """fp32 tensor as int32 bits (NaN-safe bitwise comparison), on the CPU."""
    import torch

    return t.detach().contiguous().to("cpu").view(torch.int32)


def _same_bits(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _test_rows(seed: int, rows: int, n: int):
    """Random fp32 [rows, n] with rows of very different magnitudes (chunk scales vary)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    scales = torch.logspace(-4, 3, steps=max(rows, 2))[:rows].view(rows, 1)
    return (x * scales).contiguous()


COMPRESS_SHAPES = [(1, 1), (1, 255), (1, 256), (1, 1000), (1, 1_048_583), (3, 777), (8, 5000),
                   (64, 4096), (512, 79), (512, 625), (16, 65_539)]


def check_compress_cuda(ex: Expect, device: str = "cuda", shapes=None) -> None:
    """compress_rows / compress / decompress_rows / decompress_rows_sum / decompress(accumulate)
    give the same bytes and bits on ``device`` as on the CPU (int4, int8; topk on tie-free data,
    and with ties the same multiset of kept magnitudes)."""
    import torch

    from megatron_grpo.comm.compress import build_compressor

    shapes = COMPRESS_SHAPES if shapes is None else shapes
    for name in ("int4", "int8"):
        c = build_compressor(name, 256)
        bad: List[str] = []
        cases = 0
        for i, (rows, n) in enumerate(shapes):
            x = _test_rows(100 + i, rows, n)
            if rows >= 2 and n >= 300:  # non-finite chunks: canonical NaN scale and codes
                x[0, 5] = float("nan")
                x[1, min(n - 1, 299)] = float("inf")
                x[rows - 1, 0] = float("-inf")
            xd = x.to(device)
            p_cpu, p_dev = c.compress_rows(x), c.compress_rows(xd)
            cases += 1
            if not torch.equal(p_cpu, p_dev.cpu()):
                diff = int((p_cpu != p_dev.cpu()).sum())
                bad.append(f"compress_rows {rows}x{n}: {diff} of {p_cpu.numel()} bytes differ")
                continue
            if not torch.equal(c.compress(x[0]), c.compress(xd[0]).cpu()):
                bad.append(f"compress row 0 of {rows}x{n}: bytes differ")
            d_cpu, d_dev = c.decompress_rows(p_cpu, n), c.decompress_rows(p_dev, n)
            if not _same_bits(d_cpu, d_dev):
                bad.append(f"decompress_rows {rows}x{n}: values differ")
            if not _same_bits(d_cpu, c.decompress_rows(p_cpu.to(device), n)):
                bad.append(f"decompress_rows of the CPU payload on {device} {rows}x{n}: differ")
            if not _same_bits(c.decompress_rows_sum(p_cpu, n), c.decompress_rows_sum(p_dev, n)):
                bad.append(f"decompress_rows_sum {rows}x{n}: sums differ")
            acc_cpu = torch.ones(n)
            acc_dev = acc_cpu.to(device)
            c.decompress(p_cpu[0], n, out=acc_cpu, accumulate=True)
            c.decompress(p_dev[0], n, out=acc_dev, accumulate=True)
            if not _same_bits(acc_cpu, acc_dev):
                bad.append(f"decompress(accumulate=True) {rows}x{n}: differ")
        ex.that(not bad, f"{name}: {cases} shapes (incl. NaN/inf chunks), payload bytes, decode, "
                f"rows-sum, accumulate and cross-device decode identical to CPU"
                + (f"; {len(bad)} mismatch(es): " + "; ".join(bad[:4]) if bad else ""))

    c = build_compressor("topk", 256, 0.05)
    bad = []
    for i, (rows, n) in enumerate(shapes):
        g = torch.Generator().manual_seed(200 + i)
        # Distinct magnitudes: the kept set is unique, so the bytes must be identical.
        mags = torch.stack([torch.randperm(n, generator=g) for _ in range(rows)]).float() + 1.0
        signs = torch.randint(0, 2, (rows, n), generator=g).float() * 2 - 1
        x = (mags * signs * 1e-3).contiguous()
        p_cpu, p_dev = c.compress_rows(x), c.compress_rows(x.to(device))
        if not torch.equal(p_cpu, p_dev.cpu()):
            bad.append(f"tie-free compress_rows {rows}x{n}: bytes differ")
        elif not _same_bits(c.decompress_rows(p_cpu, n), c.decompress_rows(p_dev, n)):
            bad.append(f"tie-free decompress_rows {rows}x{n}: values differ")
    ex.that(not bad, f"topk: {len(shapes)} tie-free shapes, bytes and decode identical to CPU"
            + (": " + "; ".join(bad[:4]) if bad else ""))
    bad = []
    for i, (rows, n) in enumerate(shapes[:8]):
        g = torch.Generator().manual_seed(300 + i)
        x = torch.randint(-3, 4, (rows, n), generator=g).float()  # many ties at the k-th |x|
        k = c.k(n)
        kept = [c.compress_rows(t)[:, 4 * k:].contiguous().view(torch.float32).abs()
                .sort(dim=1)[0].cpu() for t in (x, x.to(device))]
        if not torch.equal(kept[0], kept[1]):
            bad.append(f"{rows}x{n}")
    ex.that(not bad, f"topk with ties: same multiset of kept |values| per row on CPU and {device} "
            f"(which tied element wins may differ)" + (": differ for " + ", ".join(bad) if bad else ""))


def _ef_step(ef, key, g, c, dp, rank, commit):
    """What CompressedReduceScatter does with the error-feedback state, without the network."""
    grad = g.clone()
    owed = ef.owed(key, grad).view(dp, -1)
    payload = c.compress_rows(owed)
    ef.stage(key, grad, payload, rank, c)
    shard = grad.numel() // dp
    grad[rank * shard:(rank + 1) * shard].fill_(123.0)  # the reduce-scatter overwrites it
    (ef.commit if commit else ef.discard)()
    return payload


def check_error_feedback_cuda(ex: Expect, device: str = "cuda") -> None:
    import torch

    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.error_feedback import ErrorFeedback

    n, dp, steps = 8 * 5000, 8, 12
    for name in ("int4", "int8"):
        c = build_compressor(name, 256)
        ef_cpu, ef_dev = ErrorFeedback(), ErrorFeedback()
        sent = torch.zeros(n, dtype=torch.float64)
        true = torch.zeros(n, dtype=torch.float64)
        mismatches, discard_ok, on_device = [], True, True
        for t in range(steps):
            g = torch.randn(n, generator=torch.Generator().manual_seed(10 + t)) * (1 + t / 10)
            commit = t % 4 != 3  # every 4th step is skipped (non-finite elsewhere): discard
            before = ef_dev.residual("b")
            before = before.clone() if before is not None else None
            p_cpu = _ef_step(ef_cpu, "b", g, c, dp, t % dp, commit)
            p_dev = _ef_step(ef_dev, "b", g.to(device), c, dp, t % dp, commit)
            if not torch.equal(p_cpu, p_dev.cpu()):
                mismatches.append(f"step {t}: payload bytes")
            r_cpu, r_dev = ef_cpu.residual("b"), ef_dev.residual("b")
            if (r_cpu is None) != (r_dev is None) or (r_cpu is not None and not _same_bits(r_cpu, r_dev)):
                mismatches.append(f"step {t}: residual")
            if r_dev is not None and r_dev.device.type != torch.device(device).type:
                on_device = False
            if commit:
                sent += c.decompress_rows(p_dev, n // dp).view(-1).double().cpu()
                true += g.double()
            elif before is not None and not _same_bits(before, r_dev):
                discard_ok = False
        ex.that(not mismatches, f"{name}: {steps} steps (3 discarded), payloads and residuals on "
                f"{device} bit-identical to CPU" + (": " + ", ".join(mismatches[:4]) if mismatches else ""))
        ex.that(discard_ok and on_device, f"{name}: discard leaves the {device} residual "
                f"bit-identical; residual stays on {device}")
        expect = true - ef_dev.residual("b").double().cpu()
        rel = float((sent - expect).norm() / expect.norm())
        ex.that(rel < 1e-5, f"{name}: identity sum D(q) = sum g - r on {device}: rel err {rel:.2e} "
                f"(< 1e-5)")
    # A checkpointed residual comes back on the CPU; the next owed() moves it to the device.
    c = build_compressor("int4", 256)
    ef = ErrorFeedback()
    _ef_step(ef, "k", torch.randn(n).to(device), c, dp, 0, True)
    state = ef.state_dict()
    ef2 = ErrorFeedback()
    ef2.load_state_dict(state)
    grad = torch.zeros(n, device=device)
    ef2.owed("k", grad)
    ex.that(ef2.residual("k").device.type == torch.device(device).type
            and _same_bits(grad, state["residuals"]["k"]),
            f"state_dict on CPU -> load -> owed() moves the residual to {device}, bits kept")


def check_importance_cuda(ex: Expect, device: str = "cuda") -> None:
    import torch

    from megatron_grpo.importance import ImportanceTracker

    cuda = torch.device(device).type == "cuda"
    counts = [2, 3, 1]
    shapes = [[(256, 128), (128,)], [(512, 64), (64,), (3, 5, 7)], [(1000, 33)]]
    g0 = torch.Generator().manual_seed(7)
    steps = []
    for t in range(3):
        grads = [[torch.randn(s, generator=g0) * (1 + t) for s in b] for b in shapes]
        weights = [[torch.randn(s, generator=g0).to(torch.bfloat16) for s in b] for b in shapes]
        steps.append((grads, weights))
    steps[2][0][1][0].view(-1)[3] = float("inf")  # non-finite measurement: score must not move
    trackers = {"cpu": ImportanceTracker(3, counts, 0.9, "cpu"),
                device: ImportanceTracker(3, counts, 0.9, device)}
    side = torch.cuda.Stream() if cuda else None
    sync_ok, sync_err = True, ""
    before_inf = None
    for t, (grads, weights) in enumerate(steps):
        for where, tr in trackers.items():
            gs = [[x.to(where) for x in b] for b in grads]
            ws = [[x.to(where) for x in b] for b in weights]
            if where == device and t == 2:
                before_inf = tr.scores_tensor().clone()
            if where == device and cuda:
                torch.cuda.synchronize()
                side.wait_stream(torch.cuda.current_stream())
                try:
                    # Raises on any host sync (the tracker promises none: it runs in backward).
                    torch.cuda.set_sync_debug_mode("error")
                    with torch.cuda.stream(side):
                        for b in range(3):
                            tr.observe(b, gs[b], ws[b])
                    torch.cuda.current_stream().wait_stream(side)
                    tr.commit()
                except RuntimeError as exc:
                    sync_ok, sync_err = False, str(exc).splitlines()[0][:200]
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                if not sync_ok:
                    break
            else:
                for b in range(3):
                    tr.observe(b, gs[b], ws[b])
                tr.commit()
    if cuda:
        ex.that(sync_ok, "observe (on a side stream) and commit issue no host sync "
                "(torch.cuda.set_sync_debug_mode('error'))" + (f": {sync_err}" if sync_err else ""))
        if not sync_ok:
            return
    s_cpu, s_dev = trackers["cpu"].scores_tensor(), trackers[device].scores_tensor().cpu()
    rel = float(((s_cpu - s_dev).abs() / s_cpu.abs().clamp(min=1e-30)).max())
    ex.that(rel < 1e-4, f"EMA scores on {device} match CPU: max rel diff {rel:.2e} (< 1e-4; "
            f"reduction order differs)")
    # Reference for parameter 0 after 3 steps, in float64.
    def score(t):
        g, w = steps[t][0][0][0].double(), steps[t][1][0][0].double()
        return float((g.abs() * w.abs()).sum())
    ref = score(0) * 0.81 + score(1) * 0.09 + score(2) * 0.1
    got = float(s_dev[0])
    ex.that(abs(got - ref) <= 1e-4 * ref, f"parameter 0 score {got:.6g} = float64 EMA of "
            f"sum|g||w| {ref:.6g}")
    inf_idx = trackers[device].bucket_slice(1).start  # bucket 1, parameter 0 had the inf
    ex.that(bool(torch.isfinite(s_dev).all()) and float(s_dev[inf_idx]) == float(before_inf[inf_idx]),
            "a non-finite measurement leaves its parameter's score unchanged on the device")
    tr = trackers[device]
    a, b = tr.bucket_scores(), tr.bucket_scores()
    ex.that(torch.equal(a, b) and a.dtype == torch.float64 and a.device.type == torch.device(device).type,
            f"bucket_scores float64 on {device}, identical call to call: {[round(float(v), 3) for v in a]}")


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

    from megatron_grpo.timing import IntervalTimer

    if torch.device(device).type != "cuda":
        ex.skip("needs CUDA events")
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
    ex.headline(f"timer {total_ms:.2f} ms vs reference {expected:.2f} ms")
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

    def __init__(self, module, groups) -> None:
        self.module = module
        self.bucket_groups = groups


def build_test_controller(device: str, units: int = 4, numel: int = 1 << 16):
    """A GRPOController over ``units`` one-parameter buckets (fp32, main_grad set) on a 1-rank
    process group (gloo: a world of one issues no collective). Returns (controller, params)."""
    import torch
    import torch.distributed as dist

    from megatron_grpo.config import GRPOConfig
    from megatron_grpo.controller import GRPOController

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

    if torch.device(device).type != "cuda":
        ex.skip("needs CUDA streams")
    from megatron_grpo.megatron.bucket_group import GRPOBucketGroup

    ctrl, params = build_test_controller(device)
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
    ex.headline(f"side {at['s1'] - at['s0']:.1f} ms || main {at['m1'] - at['m0']:.1f} ms: "
                f"overlap {overlap:.1f} ms, step {at['end']:.1f} ms (serial {serial:.0f})")
    ctrl.end_step()
    scores = ctrl.importance.bucket_scores()
    ref = float((params[0].main_grad.double().abs() * params[0].detach().double().abs()).sum())
    ex.that(abs(float(scores[0]) - ref) <= 1e-3 * ref and float(scores[1]) == 0.0,
            f"end_step commits the side-stream measurement: unit 0 score {float(scores[0]):.6g} "
            f"(float64 reference {ref:.6g}), unobserved unit 1 stays 0")


def check_cpu_mode_noop(ex: Expect, device: str = "cuda") -> None:
    import torch

    if os.environ.get("MEGATRON_GRPO_FORCE_CPU"):
        ex.skip("MEGATRON_GRPO_FORCE_CPU is set in the environment")
    before = {"Tensor.type": torch.Tensor.type, "cuda.is_available": torch.cuda.is_available,
              "cuda.Stream": torch.cuda.Stream, "cuda.Event": torch.cuda.Event,
              "cuda.synchronize": torch.cuda.synchronize, "Tensor.cuda": torch.Tensor.cuda}
    from megatron_grpo.platform import cpu_mode_active, enable_cpu_mode, select_platform

    enabled = enable_cpu_mode()
    ex.that(enabled is False and not cpu_mode_active(),
            f"enable_cpu_mode() -> {enabled!r}, cpu_mode_active() -> {cpu_mode_active()}")
    after = {"Tensor.type": torch.Tensor.type, "cuda.is_available": torch.cuda.is_available,
             "cuda.Stream": torch.cuda.Stream, "cuda.Event": torch.cuda.Event,
             "cuda.synchronize": torch.cuda.synchronize, "Tensor.cuda": torch.Tensor.cuda}
    changed = [k for k in before if before[k] is not after[k]]
    ex.that(not changed, "torch functions untouched: " + (", ".join(changed) + " replaced"
                                                         if changed else ", ".join(before)))
    ex.that(torch.cuda.is_available(), "torch.cuda.is_available() still True")
    platform = select_platform()
    ex.info(f"platform: {platform}")
    ex.that(platform.device.type == "cuda" and platform.backend == "nccl" and not platform.cpu_mode,
            f"select_platform() -> {platform.device}, {platform.backend}, cpu_mode={platform.cpu_mode}")
    x = torch.zeros(4, device="cuda")
    y = torch.zeros(4).cuda()
    ex.that(x.is_cuda and y.is_cuda and torch.zeros(4).device.type == "cpu"
            and x.type() == "torch.cuda.FloatTensor" and torch.zeros(1).type() == "torch.FloatTensor",
            "device='cuda' and .cuda() give CUDA tensors, CPU tensors stay CPU, type() strings real")
    ex.that(type(torch.cuda.Stream()).__module__.startswith("torch.cuda"),
            "torch.cuda.Stream() is a real CUDA stream")


def check_pinned_offload_worker(ex: Expect, device: str = "cuda") -> None:
    """Run only when megatron_grpo/offload exists: pinned host buffers and copies that overlap
    compute (what an offload tier needs), then the module's own ``gpu_self_check()``."""
    import importlib

    import torch

    mod = importlib.import_module("megatron_grpo.offload")
    ex.that(True, f"import megatron_grpo.offload ({getattr(mod, '__file__', '?')})")
    n = 32 << 20
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    ex.that(host.is_pinned(), "torch.empty(pin_memory=True) is pinned")
    src = torch.randn(n, device=device)
    rate = _cycles_per_ms()
    copy_stream = torch.cuda.Stream()
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("t0", "c0", "c1", "m1")}
    torch.cuda.synchronize()
    ev["t0"].record()
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        ev["c0"].record()
        host.copy_(src, non_blocking=True)
        ev["c1"].record()
    torch.cuda._sleep(int(40 * rate))
    ev["m1"].record()
    torch.cuda.current_stream().wait_stream(copy_stream)
    torch.cuda.synchronize()
    copy_ms = ev["c0"].elapsed_time(ev["c1"])
    main_ms = ev["t0"].elapsed_time(ev["m1"])
    total = max(main_ms, ev["t0"].elapsed_time(ev["c1"]))
    ex.that(total < main_ms + 0.5 * copy_ms + 1.0, f"D2H copy of 128 MiB into pinned memory "
            f"({copy_ms:.2f} ms) overlaps 40 ms of compute: both done at {total:.2f} ms")
    ex.that(torch.equal(host[:1024], src[:1024].cpu()), "the copied bytes arrived")
    hook = getattr(mod, "gpu_self_check", None)
    ex.that(callable(hook), "megatron_grpo.offload.gpu_self_check() exists (the memory tier's own "
            "device check; add it with the tier, this script calls it)")
    if callable(hook):
        out = hook()
        ex.that(out is None or bool(out), f"megatron_grpo.offload.gpu_self_check() -> {out!r}")


WORKERS: Dict[str, Callable] = {
    "cpu_mode_noop": check_cpu_mode_noop,
    "compress_cuda": check_compress_cuda,
    "error_feedback_cuda": check_error_feedback_cuda,
    "importance_cuda": check_importance_cuda,
    "interval_timer_cuda": check_interval_timer_cuda,
    "side_stream_overlap": check_side_stream_overlap,
    "pinned_offload": check_pinned_offload_worker,
}

