"""GPU check with assertions (issue 8 item 5): one CUDA device, under 8 minutes, exit 1 on any FAIL.

    bash launch/gpu_check.sh                  # the usual entry (installs .whl/*.whl if present)
    python launch/gpu_check.py [--out DIR] [--only NAME ...] [--skip NAME ...] [--budget-s 480]
    python launch/gpu_check.py --list         # the checks, one per line: NAME  NUMBER  TITLE

Every check prints PASS or FAIL with its numbers, or SKIP with the reason when a prerequisite is
missing (transformer-engine not importable, no memory tier yet); a SKIP is never a PASS. The
final table is printed and written to OUT/summary.txt (OUT/results.json for machines); logs of
every command are under OUT (default /tmp/gpu_out, or $OUT).

Exit status: 0 when no check failed, 1 when one did, 2 when nothing could be checked (no CUDA
device: torch.cuda.is_available() is False; or bad arguments).

Checks that only need tensors run each in a subprocess of their own (``--worker NAME``), so a
crash or a hung kernel costs that check alone and is cut off by its timeout. The training runs
(torchrun, one process) and the compressor benchmark are subprocesses with timeouts too; each
command's timeout is its own cap or what is left of the budget, whichever is smaller, and a
check that cannot start within the budget is a FAIL, not a SKIP.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BUDGET_S = 480.0  # the "under 8 minutes on one CUDA device"
EXIT_OK, EXIT_FAIL, EXIT_NOTHING_CHECKED = 0, 1, 2
STRICT_ENV = "MEGATRON_GRPO_STRICT_COMM"  # megatron_grpo.comm.wire.STRICT_ENV
DP_GOAL = 1.5  # batched host time per bucket, t(dp=512) / t(dp=8) (issue 7 item 5)
OFFLOAD_SKIP = "memory tier not built yet (issue 10): no megatron_grpo/offload module"


class CheckSkipped(Exception):
    """A prerequisite of the check is missing; the message is the reason."""


class Expect:
    """Collects the assertions of one check: every one is printed, all are evaluated."""

    def __init__(self, echo: bool = True) -> None:
        self.lines: List[str] = []
        self.failures: List[str] = []
        self.asserted = 0
        self.numbers: Dict[str, object] = {}
        self.heads: List[str] = []
        self.echo = echo

    def _say(self, line: str) -> None:
        self.lines.append(line)
        if self.echo:
            print(line, flush=True)

    def that(self, ok: bool, what: str) -> bool:
        self.asserted += 1
        if not ok:
            self.failures.append(what)
        self._say(f"  {'ok  ' if ok else 'FAIL'} {what}")
        return bool(ok)

    def info(self, what: str) -> None:
        self._say(f"  info {what}")

    def number(self, key: str, value) -> None:
        self.numbers[key] = value

    def headline(self, what: str) -> None:
        """A figure for the summary table (printed as info too)."""
        self.heads.append(what)
        self.info(what)

    def summary(self) -> str:
        if self.failures:
            return "; ".join(self.failures)[:500]
        return "; ".join(self.heads)[:500] or f"{self.asserted} assertions ok"

    @staticmethod
    def skip(reason: str) -> None:
        raise CheckSkipped(reason)

    def status(self) -> str:
        if self.failures:
            return "FAIL"
        if not self.asserted:  # a check that asserted nothing must not read as a PASS
            self.failures.append("no assertion was made")
            return "FAIL"
        return "PASS"


@dataclass
class Result:
    name: str
    status: str
    elapsed_s: float
    summary: str
    lines: List[str] = field(default_factory=list)
    numbers: Dict[str, object] = field(default_factory=dict)


@dataclass
class Check:
    name: str
    number: str
    title: str
    kind: str  # "worker": subprocess of this script; "host": runs commands from the orchestrator
    cap_s: float


CHECKS = [
    Check("cpu_mode_noop", "1", "CPU mode is a no-op where CUDA exists", "worker", 60),
    Check("compress_cuda", "2a", "compressors on CUDA: int4/int8/topk bytes and decode identical "
          "to CPU", "worker", 120),
    Check("error_feedback_cuda", "2b", "ErrorFeedback staged commit/discard on CUDA, bit-identical "
          "to CPU", "worker", 60),
    Check("importance_cuda", "2c", "ImportanceTracker on CUDA: scores, no host sync, side stream",
          "worker", 60),
    Check("interval_timer_cuda", "2d", "IntervalTimer with torch.cuda.Event measures a known "
          "sleep kernel", "worker", 60),
    Check("bench_compress", "2e", f"bench_compress --device cuda (one bucket; --dp 8 64 512): "
          f"batched t(dp=512) <= {DP_GOAL}x t(dp=8)", "host", 200),
    Check("side_stream_overlap", "3a", "importance on the controller's side stream overlaps the "
          "main stream (CUDA events)", "worker", 90),
    Check("grpo_run_timing", "3b", "GRPO runs on 1 GPU, strict comm: grpo_timing cuda_events, "
          "importance > 0, 0 < RU <= 1", "host", 330),
    Check("bf16_baseline_vs_grpo", "4a", "bf16 baseline vs GRPO (tiny, ~330M): finish, finite "
          "decreasing loss, tiers d+s; peak memory, step time", "host", 330),
    Check("te_spec", "4b", "the bf16 runs use the transformer-engine spec when it is importable",
          "host", 60),
    Check("pinned_offload", "5", "pinned-memory offload (memory tier)", "host", 60),
    Check("runtime_budget", "6", f"whole check under {BUDGET_S / 60:.0f} minutes", "host", 5),
]
CHECK_BY_NAME = {c.name: c for c in CHECKS}


# ====================================================================== tensor checks (workers)
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


def worker_main(name: str, result_path: str) -> int:
    """``--worker NAME``: run one tensor check in this process, write its result as JSON."""
    ex = Expect()
    status, reason = "FAIL", ""
    try:
        import torch

        if not torch.cuda.is_available():  # the orchestrator saw one: not a missing prerequisite
            raise RuntimeError("this worker process sees no CUDA device")
        WORKERS[name](ex, "cuda")
        status = ex.status()
    except CheckSkipped as exc:
        status, reason = "SKIP", str(exc)
    except Exception as exc:  # a crash is a FAIL with its traceback in the log
        traceback.print_exc()
        ex.failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    with open(result_path, "w") as fh:
        json.dump({"status": status, "reason": reason, "failures": ex.failures,
                   "lines": ex.lines, "numbers": ex.numbers, "summary": ex.summary()}, fh)
    return 0


# ====================================================================== orchestrator
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Command:
    rc: Optional[int]
    timed_out: bool
    elapsed_s: float
    log: str
    limit_s: float

    def tail(self, n: int = 5) -> str:
        try:
            with open(self.log, errors="replace") as fh:
                lines = [l.rstrip() for l in fh.readlines() if l.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])[-600:]


@dataclass
class Run:
    name: str
    args: List[str]
    grpo: bool
    cap_s: float
    cmd: Optional[Command] = None
    records: List[Dict] = field(default_factory=list)
    spec: Optional[str] = None
    platform: Optional[str] = None

    @property
    def train_iters(self) -> int:
        return int(self.args[self.args.index("--train-iters") + 1])

    @property
    def importance_interval(self) -> int:
        if "--grpo-importance-interval" in self.args:
            return int(self.args[self.args.index("--grpo-importance-interval") + 1])
        return 1  # GRPOConfig.importance_interval

    @property
    def ok(self) -> bool:
        return self.cmd is not None and self.cmd.rc == 0 and len(self.records) == self.train_iters


TINY = ["--config", "launch/configs/tiny.yaml", "--bf16", "--train-iters", "100",
        "--eval-interval", "100", "--eval-iters", "4", "--log-interval", "50"]
# The old script's 24-layer hidden-1024 GPT (~330M parameters with the byte vocabulary).
BIG = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
       "--seq-length", "1024", "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16",
       "--train-iters", "40", "--eval-interval", "40", "--eval-iters", "2", "--log-interval", "20",
       "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "10"]
BIG_GRPO = ["--grpo", "--grpo-bucket-mb", "16", "--grpo-warmup-iters", "10",
            "--grpo-retier-interval", "10", "--grpo-stable-interval", "5"]
RUNS = {
    # importance every 2nd step in the tiny run: the other steps must report 0 (timer reset)
    "tiny_grpo": (TINY + ["--grpo", "--grpo-importance-interval", "2"], True, 150),
    "big_grpo": (BIG + BIG_GRPO, True, 200),
    "tiny_base": (TINY, False, 150),
    "big_base": (BIG, False, 200),
}
PAIRS = (("tiny", "tiny_base", "tiny_grpo"), ("~330M", "big_base", "big_grpo"))


class Context:
    def __init__(self, args) -> None:
        self.out = os.path.abspath(args.out)
        self.data_dir = os.path.abspath(args.data_dir)
        self.started = args.started_at if args.started_at else time.time()
        self.deadline = self.started + args.budget_s
        self.budget_s = args.budget_s
        self.runs: Dict[str, Run] = {}
        self.data_ready: Optional[bool] = None
        self.data_error = ""
        self.te: Optional[tuple] = None
        self.results: List[Result] = []

    def remaining(self) -> float:
        return self.deadline - time.time()

    def command(self, name: str, argv: List[str], cap_s: float, env: Optional[Dict] = None) -> Command:
        """Run ``argv`` from the repository root with a timeout (its cap, or what is left of the
        budget), stdout and stderr to OUT/name.log; a timeout kills its whole process group."""
        log = os.path.join(self.out, f"{name}.log")
        limit = max(1.0, min(cap_s, self.remaining() - 3.0))
        full_env = dict(os.environ)
        full_env.pop("MEGATRON_GRPO_FORCE_CPU", None)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        full_env.update(env or {})
        t0 = time.time()
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(argv) + "\n")
            fh.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                    env=full_env, start_new_session=True)
            try:
                rc: Optional[int] = proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=10)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        return Command(rc, timed_out, time.time() - t0, log, limit)

    # -- the shared training runs --------------------------------------------------------------
    def ensure_data(self) -> bool:
        if self.data_ready is not None:
            return self.data_ready
        prefix = os.path.join(self.data_dir, "stdlib")
        if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
            self.data_ready = True
            return True
        cmd = self.command("preprocess_data", [sys.executable, "launch/preprocess_data.py",
                                               "--default-corpus", "--output-prefix", prefix], 90)
        self.data_ready = cmd.rc == 0
        if not self.data_ready:
            self.data_error = (f"building the default corpus failed (rc {cmd.rc}"
                               f"{', timed out' if cmd.timed_out else ''}): {cmd.tail(2)}")
        return self.data_ready

    def run(self, name: str) -> Run:
        """The training run ``name`` of RUNS (torchrun, one process), once per script."""
        if name in self.runs:
            return self.runs[name]
        args, grpo, cap = RUNS[name]
        run = Run(name, args, grpo, cap)
        self.runs[name] = run
        if not self.ensure_data():
            return run
        if self.remaining() < 30:
            return run  # cmd stays None: "not started, budget spent"
        metrics = os.path.join(self.out, f"{name}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                "launch/pretrain_gpt.py", "--data-path", os.path.join(self.data_dir, "stdlib"),
                "--metrics-file", metrics, "--run-name", name] + args
        # Strict comm: every tensor GRPO hands to a collective must be on the device (NCCL).
        env = {STRICT_ENV: "1"} if grpo else {}
        run.cmd = self.command(name, argv, cap, env)
        if os.path.exists(metrics):
            with open(metrics) as fh:
                run.records = [json.loads(line) for line in fh if line.strip()]
        with open(run.cmd.log, errors="replace") as fh:
            m = re.search(r"platform=(\S+) spec=(\S+)", fh.read())
        if m:
            run.platform, run.spec = m.group(1), m.group(2)
        print(f"  run {name}: rc {run.cmd.rc}{' (timed out)' if run.cmd.timed_out else ''}, "
              f"{len(run.records)}/{run.train_iters} records, {run.cmd.elapsed_s:.1f} s, "
              f"platform {run.platform}, spec {run.spec}", flush=True)
        return run

    def expect_run(self, ex: Expect, run: Run) -> bool:
        """Assert the run finished; False (with a FAIL) when it did not."""
        if run.cmd is None:
            why = self.data_error or f"not started: {self.budget_s:.0f} s budget spent"
            return ex.that(False, f"{run.name}: {why}")
        ok = run.ok
        ex.that(ok, f"{run.name}: rc {run.cmd.rc}"
                f"{f' (timed out after {run.cmd.limit_s:.0f} s)' if run.cmd.timed_out else ''}, "
                f"{len(run.records)}/{run.train_iters} iterations logged in {run.cmd.elapsed_s:.0f} s"
                + ("" if ok else f"; log {run.cmd.log}: {run.cmd.tail()}"))
        return ok


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else math.nan


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def analyze_grpo_timing(ex: Expect, run: Run) -> None:
    """Metrics of a finished GRPO run on CUDA: device timing, importance, RU."""
    recs = run.records
    interval = run.importance_interval
    ex.that(run.platform is not None and run.platform.startswith("nccl/cuda"),
            f"{run.name}: platform {run.platform} (nccl/cuda expected)")
    timing = sorted({str(r.get("grpo_timing")) for r in recs})
    ex.that(timing == ["cuda_events"], f"{run.name}: grpo_timing {timing} (cuda_events on every step)")
    imp_steps = [r for r in recs if r["iteration"] % interval == 0]
    other = [r for r in recs if r["iteration"] % interval != 0]
    bad = [r["iteration"] for r in imp_steps if not (_finite(r.get("grpo_importance_time_s"))
                                                     and r["grpo_importance_time_s"] > 0)]
    ex.that(imp_steps and not bad, f"{run.name}: grpo_importance_time_s > 0 on all "
            f"{len(imp_steps)} importance steps (interval {interval})"
            + (f"; not on iterations {bad[:8]}" if bad else ""))
    if other:
        nonzero = [r["iteration"] for r in other if r.get("grpo_importance_time_s") != 0]
        ex.that(not nonzero, f"{run.name}: grpo_importance_time_s == 0 on the {len(other)} other "
                f"steps (device timer reset per step)" + (f"; not on {nonzero[:8]}" if nonzero else ""))
    ru = [r.get("grpo_ru") for r in recs]
    bad_ru = [(r["iteration"], r.get("grpo_ru")) for r in recs
              if not (_finite(r.get("grpo_ru")) and 0 < r["grpo_ru"] <= 1)]
    ex.that(not bad_ru, f"{run.name}: 0 < grpo_ru <= 1 on every step (median {_median(ru):.4f}, "
            f"min {min((v for v in ru if _finite(v)), default=math.nan):.4f})"
            + (f"; bad {bad_ru[:5]}" if bad_ru else ""))
    bad_wait = [r["iteration"] for r in recs if not (_finite(r.get("grpo_wait_time_s"))
                                                    and r["grpo_wait_time_s"] >= 0)]
    ex.that(not bad_wait, f"{run.name}: grpo_wait_time_s finite and >= 0 "
            f"(median {1e3 * _median([r.get('grpo_wait_time_s') for r in recs]):.3f} ms)")
    tail = recs[5:] or recs
    share = _median([r["grpo_importance_time_s"] / r["step_time_s"] for r in tail
                     if r["iteration"] % interval == 0 and r.get("step_time_s")])
    imp_ms = 1e3 * _median([r["grpo_importance_time_s"] for r in tail if r["iteration"] % interval == 0])
    ex.headline(f"{run.name}: importance {imp_ms:.3f} ms/step = {100 * share:.2f}% of the step, "
                f"RU {_median(ru):.4f}")
    ex.number(f"{run.name}_importance_share", share)


def analyze_pair(ex: Expect, label: str, base: Run, grpo: Run) -> None:
    """Baseline vs GRPO: both finished, finite and decreasing losses, tiers d and s; figures."""
    for run in (base, grpo):
        losses = [r.get("loss") for r in run.records]
        ex.that(all(_finite(v) for v in losses), f"{run.name}: all {len(losses)} losses finite")
        skipped = [r["iteration"] for r in run.records if r.get("skipped")]
        ex.that(not skipped, f"{run.name}: no skipped (non-finite) steps" +
                (f"; skipped {skipped[:8]}" if skipped else ""))
        first, last = _median(losses[:5]), _median(losses[-5:])
        ex.that(_finite(first) and _finite(last) and last < first,
                f"{run.name}: loss decreases, median of first 5 {first:.4f} -> last 5 {last:.4f}")
        vals = [r["val_loss"] for r in run.records if "val_loss" in r]
        ex.that(bool(vals) and all(_finite(v) for v in vals), f"{run.name}: val_loss {vals[-1:]} finite")
    tier_map = grpo.records[-1].get("grpo_tier_map", "") if grpo.records else ""
    ex.that("d" in tier_map and "s" in tier_map, f"{grpo.name}: final tier map {tier_map!r} has "
            f"dynamic (d) and stable (s) units")
    peaks = {}
    for run in (base, grpo):
        vals = [r.get("peak_device_bytes") for r in run.records]
        ok = bool(vals) and all(isinstance(v, int) and v > 0 for v in vals)
        ex.that(ok, f"{run.name}: peak_device_bytes reported on every step")
        peaks[run.name] = max((v for v in vals if isinstance(v, int)), default=0)
    steps = {run.name: _median([r["step_time_s"] for r in (run.records[5:] or run.records)])
             for run in (base, grpo)}
    pb, pg = peaks[base.name], peaks[grpo.name]
    sb, sg = steps[base.name], steps[grpo.name]
    for run in (base, grpo):
        ex.info(f"{run.name}: loss {run.records[0]['loss']:.3f} -> {run.records[-1]['loss']:.3f}, "
                f"val {run.records[-1].get('val_loss')}, spec {run.spec}")
    line = (f"{label}: peak device memory base {pb / 2**30:.3f} GiB, GRPO {pg / 2**30:.3f} GiB "
            f"(x{pg / pb if pb else math.nan:.3f}); median step base {1e3 * sb:.1f} ms, GRPO "
            f"{1e3 * sg:.1f} ms (x{sg / sb if sb else math.nan:.3f})")
    ex.headline(line)
    ex.number(f"{label}_peak_ratio", pg / pb if pb else None)
    ex.number(f"{label}_step_ratio", sg / sb if sb else None)


def host_grpo_run_timing(ex: Expect, ctx: Context) -> None:
    for name in ("tiny_grpo", "big_grpo"):
        run = ctx.run(name)
        if ctx.expect_run(ex, run):
            analyze_grpo_timing(ex, run)


def host_bf16_baseline_vs_grpo(ex: Expect, ctx: Context) -> None:
    for label, base_name, grpo_name in PAIRS:
        base, grpo = ctx.run(base_name), ctx.run(grpo_name)
        ok_b, ok_g = ctx.expect_run(ex, base), ctx.expect_run(ex, grpo)
        if ok_b and ok_g:
            analyze_pair(ex, label, base, grpo)


def _probe_te(ctx: Context) -> tuple:
    """(importable, detail): transformer_engine imported in a child (it initialises CUDA)."""
    if ctx.te is None and importlib.util.find_spec("transformer_engine") is None:
        ctx.te = (False, "no module named transformer_engine")
    if ctx.te is None:
        cmd = ctx.command("te_probe", [sys.executable, "-c", "import transformer_engine as te; "
                                       "print('transformer_engine', getattr(te, '__version__', '?'))"], 60)
        ctx.te = (cmd.rc == 0, cmd.tail(1))
    return ctx.te


def host_te_spec(ex: Expect, ctx: Context) -> None:
    importable, detail = _probe_te(ctx)
    names = [n for _, b, g in PAIRS for n in (b, g)]
    if not importable:
        specs = {n: ctx.runs[n].spec for n in names if n in ctx.runs}
        ex.skip(f"transformer_engine not importable ({detail[-160:]}); the runs used megatron's "
                f"local spec: {specs}")
    ex.info(detail)
    for n in names:
        run = ctx.run(n)
        ex.that(run.spec == "transformer_engine", f"{n}: spec {run.spec} (transformer_engine "
                f"expected: importable here)")
        if run.spec == "transformer_engine":
            ctx.expect_run(ex, run)


def parse_bench_goal(text: str) -> List[tuple]:
    """Rows of bench_compress --dp's goal table: (bucket, compressor, old ratio, batched ratio)."""
    rows, in_table = [], False
    for line in text.splitlines():
        if "goal batched <=" in line:
            in_table = True
            continue
        if not in_table:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1] in ("int4", "int8", "topk"):
            rows.append((int(cells[0].replace(",", "")), cells[1], float(cells[2]), float(cells[3])))
        elif rows and not line.strip():
            in_table = False
    return rows


def parse_bench_bucket(text: str) -> Dict[str, Dict[str, float]]:
    """bench_compress default mode rows: name -> ratio, rel err, compress ms, decompress ms."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[0] in ("int4", "int8", "topk"):
            try:
                vals = [float(p) for p in parts[1:]]
            except ValueError:
                continue
            out[parts[0]] = {"ratio": vals[0], "rel_err": vals[2], "compress_ms": vals[3],
                             "decompress_ms": vals[4]}
    return out


def host_bench_compress(ex: Expect, ctx: Context) -> None:
    bench = [sys.executable, "launch/bench_compress.py", "--device", "cuda"]
    cmd = ctx.command("bench_compress_bucket", bench + ["--repeats", "5"], 60)
    text = open(cmd.log, errors="replace").read()
    rows = parse_bench_bucket(text)
    ex.that(cmd.rc == 0 and set(rows) == {"int4", "int8", "topk"},
            f"one 128 MiB bucket: rc {cmd.rc}{' (timed out)' if cmd.timed_out else ''}, "
            f"rows {sorted(rows)}" + ("" if cmd.rc == 0 else f": {cmd.tail()}"))
    for name, r in sorted(rows.items()):
        ex.that(_finite(r["rel_err"]) and r["rel_err"] < 1.0,
                f"{name}: ratio {r['ratio']:.4f}, rel err {r['rel_err']:.4f} (< 1), compress "
                f"{r['compress_ms']:.2f} ms, decompress {r['decompress_ms']:.2f} ms")
    goal = []
    for numel, repeats, cap in (("40000", "10", 60), ("33554432", "3", 120)):
        cmd = ctx.command(f"bench_compress_dp_{numel}", bench + [
            "--dp", "8", "64", "512", "--bucket-numel", numel, "--repeats", repeats], cap)
        found = parse_bench_goal(open(cmd.log, errors="replace").read())
        ex.that(cmd.rc == 0 and len(found) == 3, f"--dp 8 64 512 --bucket-numel {numel}: rc "
                f"{cmd.rc}{' (timed out)' if cmd.timed_out else ''}, {len(found)}/3 goal rows, "
                f"{cmd.elapsed_s:.0f} s" + ("" if cmd.rc == 0 else f": {cmd.tail()}"))
        goal.extend(found)
    for bucket, name, r_old, r_new in goal:
        ex.that(r_new <= DP_GOAL, f"bucket {bucket:,} {name}: batched t(dp=512)/t(dp=8) "
                f"{r_new:.2f} (goal <= {DP_GOAL}; per-shard loop {r_old:.2f})")
        ex.number(f"dp_ratio_{bucket}_{name}", r_new)
    if goal:
        ex.headline("batched t(dp=512)/t(dp=8): " + ", ".join(
            f"{b:,} {n} {r:.2f}" for b, n, _, r in goal))


def host_pinned_offload(ex: Expect, ctx: Context) -> None:
    if not os.path.isdir(os.path.join(ROOT, "megatron_grpo", "offload")):
        ex.skip(OFFLOAD_SKIP)
    res = run_worker(ctx, CHECK_BY_NAME["pinned_offload"])
    ex.lines.extend(res.lines)
    if res.status == "SKIP":
        ex.skip(res.summary)
    ex.that(res.status == "PASS", f"offload worker: {res.status} {res.summary}")


def host_runtime_budget(ex: Expect, ctx: Context) -> None:
    total = time.time() - ctx.started
    ex.number("total_s", total)
    for r in ctx.results:
        ex.info(f"{r.name}: {r.elapsed_s:.1f} s")
    ex.headline(f"{total:.1f} s in all")
    ex.that(total < ctx.budget_s, f"whole check {total:.1f} s (< {ctx.budget_s:.0f} s, "
            f"including setup since the shell script started)")


HOST: Dict[str, Callable] = {
    "bench_compress": host_bench_compress,
    "grpo_run_timing": host_grpo_run_timing,
    "bf16_baseline_vs_grpo": host_bf16_baseline_vs_grpo,
    "te_spec": host_te_spec,
    "pinned_offload": host_pinned_offload,
    "runtime_budget": host_runtime_budget,
}


def run_worker(ctx: Context, check: Check) -> Result:
    path = os.path.join(ctx.out, f"{check.name}.result.json")
    if os.path.exists(path):
        os.remove(path)
    t0 = time.time()
    cmd = ctx.command(check.name, [sys.executable, os.path.abspath(__file__), "--worker",
                                   check.name, "--result", path], check.cap_s)
    elapsed = time.time() - t0
    if not os.path.exists(path):
        why = (f"timed out after {cmd.limit_s:.0f} s" if cmd.timed_out
               else f"worker died (rc {cmd.rc}) without a result")
        return Result(check.name, "FAIL", elapsed, f"{why}; log {cmd.log}: {cmd.tail()}")
    with open(path) as fh:
        data = json.load(fh)
    for line in data["lines"]:
        print(line, flush=True)
    summary = data["reason"] if data["status"] == "SKIP" else data["summary"]
    return Result(check.name, data["status"], elapsed, summary, data["lines"], data["numbers"])


def run_host(ctx: Context, check: Check) -> Result:
    ex = Expect()
    t0 = time.time()
    try:
        HOST[check.name](ex, ctx)
        status = ex.status()
        summary = ex.summary()
    except CheckSkipped as exc:
        status, summary = "SKIP", str(exc)
    except Exception as exc:
        traceback.print_exc()
        status, summary = "FAIL", f"{type(exc).__name__}: {exc}"[:500]
    return Result(check.name, status, time.time() - t0, summary, ex.lines, ex.numbers)


def summary_table(results: List[Result], total_s: float) -> str:
    lines = [f"{'#':4} {'check':24} {'status':6} {'time s':>7}  result", "-" * 100]
    for r in results:
        c = CHECK_BY_NAME[r.name]
        lines.append(f"{c.number:4} {r.name:24} {r.status:6} {r.elapsed_s:7.1f}  {r.summary[:300]}")
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines.append("-" * 100)
    lines.append(f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in "
                 f"{total_s:.1f} s")
    return "\n".join(lines)


def cuda_status() -> tuple:
    """(available, description) of this machine's CUDA, without building anything."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not importable ({exc})"
    built = torch.version.cuda
    if not torch.cuda.is_available():
        return False, (f"torch {torch.__version__} (CUDA build: {built or 'none, a CPU-only build'}): "
                       f"torch.cuda.is_available() is False")
    return True, (f"torch {torch.__version__}, CUDA {built}, {torch.cuda.device_count()} device(s), "
                  f"device 0: {torch.cuda.get_device_name(0)}")


def list_checks() -> str:
    return "\n".join(f"{c.name:24} {c.number:4} {c.title}" for c in CHECKS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the checks and exit")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_out",
                   help="logs, metrics and the summary (default $OUT or /tmp/gpu_out)")
    p.add_argument("--data-dir", default="/tmp/gpu_check_data",
                   help="where the default corpus is built (kept out of --out: 24 MB)")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(CHECK_BY_NAME),
                   help="run these checks only (runtime_budget always runs)")
    p.add_argument("--skip", nargs="+", metavar="NAME", choices=list(CHECK_BY_NAME), default=[],
                   help="leave these checks out")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="whole-check budget in seconds")
    p.add_argument("--started-at", type=float, default=None,
                   help="epoch seconds the budget counts from (gpu_check.sh passes its start)")
    p.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.list:
        print(list_checks())
        return EXIT_OK
    if args.worker:
        if not args.result:
            p.error("--worker needs --result")
        return worker_main(args.worker, args.result)

    os.makedirs(args.out, exist_ok=True)
    ok, where = cuda_status()
    header = f"gpu_check: {where}"
    print(header, flush=True)
    if not ok:
        message = (f"gpu_check: no CUDA device: {where}. Nothing was checked; run this on a "
                   f"machine with one CUDA GPU (exit status {EXIT_NOTHING_CHECKED}).")
        print(message, file=sys.stderr, flush=True)
        with open(os.path.join(args.out, "summary.txt"), "w") as fh:
            fh.write(message + "\n")
        return EXIT_NOTHING_CHECKED
    try:
        import megatron.core as mc

        print(f"gpu_check: megatron-core {mc.__version__}", flush=True)
    except ImportError as exc:
        print(f"gpu_check: megatron-core not importable ({exc}); the checks that need it fail",
              flush=True)

    ctx = Context(args)
    selected = [c for c in CHECKS if (not args.only or c.name in args.only or
                                      c.name == "runtime_budget") and c.name not in args.skip]
    for check in selected:
        print(f"\n=== [{check.number}] {check.name}: {check.title}", flush=True)
        if check.name != "runtime_budget" and ctx.remaining() < 10:
            res = Result(check.name, "FAIL", 0.0, f"not started: the {ctx.budget_s:.0f} s budget "
                         f"is spent ({time.time() - ctx.started:.0f} s elapsed)")
        elif check.kind == "worker":
            res = run_worker(ctx, check)
        else:
            res = run_host(ctx, check)
        ctx.results.append(res)
        print(f"--- [{check.number}] {check.name}: {res.status} ({res.elapsed_s:.1f} s) "
              f"{res.summary[:300]}", flush=True)

    total = time.time() - ctx.started
    table = summary_table(ctx.results, total)
    print("\n" + table, flush=True)
    with open(os.path.join(args.out, "summary.txt"), "w") as fh:
        fh.write(header + "\n\n" + table + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"where": where, "total_s": total,
                   "results": [vars(r) for r in ctx.results]}, fh, indent=1, default=str)
    return EXIT_FAIL if any(r.status == "FAIL" for r in ctx.results) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
