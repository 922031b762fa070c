"""Cases of test_triton_codec.py that run the Triton kernels under Triton's interpreter.

The interpreter is chosen when a kernel is defined (``@triton.jit`` reads TRITON_INTERPRET as
comm/triton_codec.py is imported), so these run in a child process started with
TRITON_INTERPRET=1: ``python triton_codec_cases.py`` prints one JSON line, case -> "ok" or the
failure. The parent lists CASES without importing triton. Sizes are small: the interpreter
runs each program in Python.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from megatron_grpo.comm.compress import Int4Compressor, Int8Compressor
from megatron_grpo.comm.compress_base import _MIN_CHUNK_MAX
from megatron_grpo.comm.error_feedback import ErrorFeedback

CODECS = {"int4": Int4Compressor, "int8": Int8Compressor}
# (rows, row length, payload chunk): odd lengths, N < chunk, N = 1, N a multiple of the chunk
SHAPES = [(1, 1, 8), (3, 5, 8), (2, 21, 8), (4, 16, 8), (3, 37, 16), (2, 9, 4)]
# (dp, shard, payload chunk, residual chunk): residual chunks across shard ends, shard < chunk,
# a residual chunk spanning several shards, chunks that differ, a short last residual chunk
FEEDBACK = [(2, 16, 8, 8), (3, 12, 8, 8), (5, 3, 8, 8), (3, 20, 8, 6), (2, 11, 4, 16),
            (1, 1, 8, 8), (4, 7, 2, 5)]
EXACT = torch.tensor([0, 5, 6, 13])  # elements sent exactly (replicated), whose residual stays 0
SUM_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 33]


def values(rows: int, numel: int, chunk: int, seed: int, special: bool = True) -> torch.Tensor:
    """Gaussian rows; with ``special``, chunk k (counted over all rows) gets pattern k % 7:
    plain, a NaN, all zero, tiny (below _MIN_CHUNK_MAX), +-inf, large, just above the minimum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, numel, generator=g) * 1e-3
    if not special:
        return x
    n_c = -(-numel // chunk)
    for r in range(rows):
        for j in range(n_c):
            part = x[r, j * chunk:(j + 1) * chunk]
            kind = (r * n_c + j) % 7
            if kind == 1:
                part[len(part) // 2] = float("nan")
            elif kind == 2:
                part.zero_()
            elif kind == 3:
                part.mul_(_MIN_CHUNK_MAX / 10)
            elif kind == 4:
                part[0] = float("inf")
                part[-1] = -float("inf") if len(part) > 1 else part[-1]
            elif kind == 5:
                part.mul_(1e33)
            elif kind == 6:
                part.mul_(_MIN_CHUNK_MAX * 4 / part.abs().max().clamp_min(1e-30))
    return x


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN matches any NaN (see docs/compression.md)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


# ---- the cases ---------------------------------------------------------------------------

def encode(fmt: str, shape: int, special: bool) -> None:
    from megatron_grpo.comm import fused_codec as fc
    rows, numel, chunk = SHAPES[shape]
    comp = CODECS[fmt](chunk)
    x = values(rows, numel, chunk, seed=shape, special=special)
    want = comp.compress_rows(x)
    got = fc.encode_rows(comp, x)
    assert torch.equal(got, want), f"payload bytes differ at {(got != want).nonzero().tolist()[:8]}"


def delta(fmt: str, dtype: str) -> None:
    """prepare_param_delta's master - copy, the copy in the parameter's dtype."""
    from megatron_grpo.comm import fused_codec as fc
    comp = CODECS[fmt](8)
    master = values(1, 29, 8, seed=3, special=False).view(-1)
    copy = (master + values(1, 29, 8, seed=4, special=False).view(-1)).to(getattr(torch, dtype))
    want = comp.compress_rows((master - copy.float()).view(1, -1))
    assert torch.equal(fc.encode_rows(comp, master.view(1, -1), copy.view(1, -1)), want)


def _eager_step(ef: ErrorFeedback, g: torch.Tensor, dp: int, comp, zero=None) -> torch.Tensor:
    grad = g.clone()
    send = comp.compress_rows(ef.owed("b", grad).view(dp, -1))
    ef.stage("b", grad, send, 0, comp, zero)
    return send


def feedback(fmt: str, case: int, special: bool, exact: bool = False) -> None:
    """Two steps (no residual yet, then the committed int8 one): payload and residual bytes;
    ``exact``: with elements whose residual is zeroed (as the caller zeroed their gradient)."""
    from megatron_grpo.comm import fused_codec as fc
    dp, shard, chunk, rchunk = FEEDBACK[case]
    comp = CODECS[fmt](chunk)
    ef = ErrorFeedback("int8", rchunk)
    zero = EXACT[EXACT < dp * shard] if exact else None
    for step in range(2):
        g = values(dp, shard, chunk, seed=10 * case + step, special=special and step == 1).view(-1)
        if zero is not None:
            g[zero] = 0.0
        residual = ef.stored("b")
        send, new = fc.encode_feedback(g.clone(), dp, comp, residual, rchunk,
                                       fc._zero_mask(zero, g.numel()))
        want = _eager_step(ef, g, dp, comp, zero)
        assert torch.equal(send, want), f"step {step}: payload bytes differ"
        assert torch.equal(new.payload, ef.staged("b").payload), f"step {step}: residual bytes differ"
        ef.commit()


def decode_sum(fmt: str, rows: int) -> None:
    from megatron_grpo.comm import fused_codec as fc
    numel, chunk = 37, 8
    comp = CODECS[fmt](chunk)
    payload = comp.compress_rows(values(rows, numel, chunk, seed=rows, special=rows % 2 == 1))
    want = comp.decompress_rows_sum(payload, numel)
    out = torch.full((numel,), 5.0)
    got = fc.decode_sum(comp, payload, numel, out)
    assert got is out and same_floats(got, want), "decoded sums differ"


def decode_add(fmt: str, dtype: str) -> None:
    from megatron_grpo.comm import fused_codec as fc
    comp = CODECS[fmt](8)
    payload = comp.compress_rows(values(3, 21, 8, seed=7, special=False))
    rows = values(3, 21, 8, seed=8, special=False).to(getattr(torch, dtype))
    want = rows.clone().add_(comp.decompress_rows(payload, 21).to(rows.dtype))
    fc.decode_add(comp, payload, rows)
    assert torch.equal(rows, want), "parameter copies differ"


ALLOWED_OPS = {"empty.memory_format", "empty_strided.default", "view.default", "view.dtype",
               "_unsafe_view.default", "alias.default", "as_strided.default", "slice.Tensor",
               "select.int", "detach.default"}


def launch_budget() -> None:
    """The fused reduce-scatter path of one bucket (compress_with_feedback with an int8 residual
    and exact elements, then sum_rows on what arrives) forced on CPU tensors: at most 3 kernel launches, and no torch
    op but allocations and views; its payload and staged residual are the eager ones."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_grpo.comm import fused_codec as fc

    class Ops(TorchDispatchMode):
        paused = False

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused:
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    dp, shard, comp = 4, 24, Int4Compressor(8)
    ef, ref = ErrorFeedback("int8", 8), ErrorFeedback("int8", 8)
    for e in (ef, ref):
        _eager_step(e, values(dp, shard, 8, seed=1, special=False).view(-1), dp, comp)
        e.commit()
    g = values(dp, shard, 8, seed=2).view(-1)
    g[EXACT] = 0.0  # replicated elements: zeroed in the gradient, their residual kept at 0
    fc._zero_mask(EXACT, g.numel())  # made once per bucket, at its first step
    launches, mode = [], Ops()
    real, enabled = fc._launch, fc.fused_enabled

    def counted(kernel, grid, *args, **meta):
        launches.append(kernel.__name__)
        mode.paused = True  # the interpreter's own copies are no kernel's torch ops
        try:
            real(kernel, grid, *args, **meta)
        finally:
            mode.paused = False

    fc._launch, fc.fused_enabled = counted, lambda *tensors: True
    try:
        grad = g.clone()
        with mode:
            send = fc.compress_with_feedback("b", grad, dp, ef, comp, 0, EXACT)
            total = fc.sum_rows(comp, send, shard)
    finally:
        fc._launch, fc.fused_enabled = real, enabled
    assert launches == ["encode_feedback_kernel", "decode_sum_kernel"], launches
    other = sorted({op for op in mode.seen if op not in ALLOWED_OPS})
    assert not other, f"eager ops on the fused path: {other}"
    want = _eager_step(ref, g, dp, comp, EXACT)
    assert torch.equal(send, want) and torch.equal(ef.staged("b").payload, ref.staged("b").payload)
    assert same_floats(total, comp.decompress_rows_sum(want, shard))


def dynamic_tier(fmt: str) -> None:
    """comm/dynamic.py's reduce-scatter and parameter gather (one rank, gloo) with the fused
    path forced on CPU tensors: the same shard, residual and parameters as the eager path."""
    import tempfile

    import torch.distributed as dist

    from megatron_grpo.comm import dynamic
    from megatron_grpo.comm import fused_codec as fc

    comp, dp_shard = CODECS[fmt](8), 21
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            results, real, launch, launched = [], fc.fused_enabled, fc._launch, []
            fc._launch = lambda kernel, *a, **k: (launched.append(kernel.__name__), launch(kernel, *a, **k))
            for fused in (False, True):
                fc.fused_enabled = (lambda *t: True) if fused else real
                try:
                    ef = ErrorFeedback("int8", 8)
                    shards = []
                    for step in range(2):
                        grad = values(1, dp_shard, 8, seed=20 + step, special=step == 1).view(-1)
                        out = torch.empty(dp_shard)
                        dynamic.CompressedReduceScatter("b", grad, out, ef, comp, None, False)
                        shards.append(out)
                        ef.commit()
                    param = values(1, dp_shard, 8, seed=30, special=False).view(-1).to(torch.bfloat16)
                    master = values(1, dp_shard, 8, seed=31, special=False).view(-1)
                    dynamic.compressed_param_gather(param, master, comp, None)
                    results.append((shards, ef.stored("b").payload, param))
                finally:
                    fc.fused_enabled = real
                assert sorted(set(launched)) == ([] if not fused else [
                    "decode_add_kernel", "decode_sum_kernel", "encode_feedback_kernel",
                    "encode_rows_kernel"]), launched
        finally:
            fc._launch = launch
            dist.destroy_process_group()
    (eager_shards, eager_res, eager_param), (shards, res, param) = results
    assert all(same_floats(a, b) for a, b in zip(shards, eager_shards)), "reduced shards differ"
    assert torch.equal(res, eager_res), "residual bytes differ"
    assert torch.equal(param, eager_param), "parameter copies differ"


CASES = {}
for _fmt in CODECS:
    for _i in range(len(SHAPES)):
        for _special in (False, True):
            CASES[f"encode-{_fmt}-{SHAPES[_i]}-{'special' if _special else 'plain'}"] = \
                (encode, (_fmt, _i, _special))
    for _dtype in ("float32", "bfloat16"):
        CASES[f"delta-{_fmt}-{_dtype}"] = (delta, (_fmt, _dtype))
        CASES[f"decode_add-{_fmt}-{_dtype}"] = (decode_add, (_fmt, _dtype))
    for _i in range(len(FEEDBACK)):
        for _special in (False, True):
            CASES[f"feedback-{_fmt}-{FEEDBACK[_i]}-{'special' if _special else 'plain'}"] = \
                (feedback, (_fmt, _i, _special))
        CASES[f"feedback-{_fmt}-{FEEDBACK[_i]}-exact-elements"] = (feedback, (_fmt, _i, True, True))
    for _rows in SUM_ROWS:
        CASES[f"decode_sum-{_fmt}-dp{_rows}"] = (decode_sum, (_fmt, _rows))
    CASES[f"dynamic_tier-{_fmt}"] = (dynamic_tier, (_fmt,))
CASES["launch_budget"] = (launch_budget, ())


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels() imports it)
    torch.set_num_threads(1)
    results, times = {}, {}
    for name, (fn, args) in CASES.items():
        start = time.perf_counter()
        try:
            fn(*args)
            results[name] = "ok"
        except Exception:  # reported per case to the parent test
            results[name] = traceback.format_exc(limit=4)
        times[name] = round(time.perf_counter() - start, 3)
    print(json.dumps({"results": results, "seconds": times}))


if __name__ == "__main__":
    sys.exit(main())
