"""Tensor checks of phase b (each a function ``(ex: Expect, device)``): the compressors, error
feedback and the importance tracker on ``device`` against the same code on the CPU, bit for
bit where the arithmetic is the same (payload bytes, decoded values, residuals), and CPU mode
as a no-op where CUDA exists.

tools/gpu_check.py runs them in a worker process of their own (``--worker tensors``), so a
crash costs that worker alone. With ``device="cpu"`` (the CPU dry run) the same logic runs
against itself: a trivially equal comparison that still catches a check which crashes or no
longer matches the package's API.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List

from .common import CheckSkipped, Expect


def _bits(t):
    """fp32 tensor as int32 bits (NaN-safe bitwise comparison), on the CPU, every NaN as the one
    pattern 0x7fc00000: a NaN's payload is the device's choice (0 * inf is 0xffc00000 on an x86
    CPU and 0x7fffffff on an H200, seen in the first GPU check), and only NaN-ness carries
    meaning (megatron's NaN check); every other value is compared bit for bit."""
    import torch

    t = t.detach().to("cpu", copy=True).contiguous()
    t[torch.isnan(t)] = float("nan")
    return t.view(torch.int32)


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

    from megatron_grpo.grpo.importance import ImportanceTracker

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



def check_cpu_mode_noop(ex: Expect, device: str = "cuda") -> None:
    import torch

    if torch.device(device).type != "cuda":
        raise CheckSkipped("needs CUDA: checks that CPU mode leaves a CUDA machine alone")
    if os.environ.get("MEGATRON_GRPO_FORCE_CPU"):
        raise CheckSkipped("MEGATRON_GRPO_FORCE_CPU is set in the environment")
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


CHECKS: Dict[str, Callable] = {
    "compress": check_compress_cuda,
    "error_feedback": check_error_feedback_cuda,
    "importance": check_importance_cuda,
    "cpu_mode_noop": check_cpu_mode_noop,
}
