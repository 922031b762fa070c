"""The codec measurements of the codec check (tools/gpu_checks/codec.py runs this module in a
child process of its own, so a hung kernel or a crash costs only this part, under its timeout).

One bucket as a step sends it (comm/dynamic.py's CompressedReduceScatter, without the exchange):
encode with error feedback (``fused_codec.compress_with_feedback``), then decode-and-sum of the dp
rows (``fused_codec.sum_rows``; one GPU receives nothing, so its own payload stands in for the dp
rows it would receive), then the residual commit. Both paths go through the selection the step
uses: "fused" as it stands (Triton kernels for CUDA tensors), "eager" with the switch
``MEGATRON_GRPO_FUSED_CODEC=0``, exactly what a run with the kernels turned off executes.

Per format and path:

* device time of encode and of decode-and-sum (CUDA events around each call, the median of
  ``repeats`` after two warm-up buckets that compile the kernels);
* ``bucket_gbps``: the bucket's fp32 gradient bytes over encode + decode time, the figure to
  hold against a link's rate (the codec must outrun the bytes it saves);
* ``traffic_gbps`` and ``of_copy``: the bytes the bucket must read and write at the least
  (gradient, residual read and written, payload written and read back, the summed shard) over
  its time, as a share of a device copy's rate (``dst.copy_(src)`` of the same fp32 bytes,
  counted as read + write): how close to memory-bound the codec runs;
* ``host_us``: host time to issue one bucket (no synchronisation inside): the launch overhead
  that sits on the thread running the backward's hooks;
* launches per bucket: Triton kernels (counted at fused_codec._launch), aten ops that run a
  kernel (a TorchDispatchMode; views and allocations left out) and, on CUDA, the kernels the
  profiler saw (torch.profiler with CUPTI, Triton's included).

Byte equality, fused against eager on the same device: payloads and int8 residuals (a first
step without a residual, a second with one), the decoded sum bit for bit, and the parameter
delta's payload and its decode into bf16 rows. On the CPU both paths are the eager codec
(fused_codec runs Triton only for CUDA tensors): the comparison runs, trivially equal, and the
result says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, os.path.dirname(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

FORMATS = ("int8", "int4")
CHUNK = 256  # --grpo-compress-chunk's default: elements per fp32 scale (payload and residual)
SWITCH = "MEGATRON_GRPO_FUSED_CODEC"  # comm/fused_codec.py's SWITCH
# aten ops that launch no kernel: allocations, aliases, a stream mark of the caching allocator
VIEW_OR_ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                 "alias", "lift_fresh", "record_stream"}


@contextlib.contextmanager
def eager_codec():
    """The eager codec through the same entry points (the switch is read at every call)."""
    old = os.environ.get(SWITCH)
    os.environ[SWITCH] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = old


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_ms(fn: Callable[[], None], device, repeats: int) -> float:
    """Median device time of ``fn`` in ms: CUDA events on a GPU (the kernels' time, not the
    host's), wall time on the CPU."""
    import torch

    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def _host_us(fn: Callable[[], None], device, repeats: int) -> float:
    """Median host time to issue ``fn`` in µs, the device idle at the start of each call."""
    samples = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        samples.append(1e6 * (time.perf_counter() - t0))
    _sync(device)
    return statistics.median(samples)


def count_launches(fn: Callable[[], None], device) -> Dict[str, object]:
    """Kernel launches of one call of ``fn`` (see the module docstring)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_grpo.comm import fused_codec as fc

    aten: Optional[List[str]] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not getattr(func, "is_view", False) and name not in VIEW_OR_ALLOC:
                aten.append(name)
            return func(*args, **(kwargs or {}))

    triton = [0]
    real = fc._launch

    def counted(*a, **k):
        triton[0] += 1
        return real(*a, **k)

    _sync(device)
    fc._launch = counted
    note = "no CUDA device: no kernels to count"
    try:
        try:
            with Count():
                fn()
        except Exception as exc:  # a launcher the mode disturbs: the Triton count alone, again
            note = f"aten ops not counted: {type(exc).__name__}: {exc}"[:300]
            aten, triton[0] = None, 0
            fn()
    finally:
        fc._launch = real
    _sync(device)
    out: Dict[str, object] = {"triton_launches": triton[0], "aten_ops": None if aten is None else len(aten),
                              "aten_op_names": sorted(set(aten or [])), "cuda_kernels": None,
                              "cuda_memops": None, "profiler_note": note}
    if device.type == "cuda":
        try:
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                _sync(device)
            events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            mem = [e for e in events if e.name.startswith(("Memset", "Memcpy"))]
            out.update(cuda_kernels=len(events) - len(mem), cuda_memops=len(mem),
                       profiler_note="torch.profiler (CUPTI): device events of one bucket"
                       + ("" if aten is not None else "; " + note))
        except Exception as exc:  # a profiler that cannot start here leaves the counters above
            out["profiler_note"] = f"torch.profiler failed: {type(exc).__name__}: {exc}"[:300]
    return out


def _inputs(numel: int, dp: int, device, seed: int):
    """A bucket's gradient, rows of very different magnitudes (chunk scales vary), on ``device``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(dp, numel // dp, generator=g)
    x *= torch.logspace(-6, 2, steps=dp).view(dp, 1)
    return x.view(-1).to(device)


def check_equal(fmt: str, numel: int, dp: int, device) -> Dict[str, bool]:
    """Fused against eager on ``device``: every byte and bit a step produces (module docstring)."""
    import torch

    from gpu_checks.tensor_checks import _same_bits
    from megatron_grpo.comm import fused_codec as fc
    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.error_feedback import ErrorFeedback

    comp, shard = build_compressor(fmt, CHUNK), numel // dp
    efs = {"fused": ErrorFeedback("int8", CHUNK), "eager": ErrorFeedback("int8", CHUNK)}
    got: Dict[str, bool] = {}
    for step in range(2):  # step 0: no residual yet; step 1: the residual of step 0 added
        grad = _inputs(numel, dp, device, seed=100 + step)
        sends, sums = {}, {}
        for path, ef in efs.items():
            with (eager_codec() if path == "eager" else contextlib.nullcontext()):
                sends[path] = fc.compress_with_feedback("b", grad.clone(), dp, ef, comp, 0)
                sums[path] = fc.sum_rows(comp, sends[path], shard)
        got[f"payload_step{step}"] = torch.equal(sends["fused"], sends["eager"])
        got[f"residual_step{step}"] = torch.equal(efs["fused"].staged("b").payload,
                                                  efs["eager"].staged("b").payload)
        got[f"sum_step{step}"] = _same_bits(sums["fused"], sums["eager"])
        for ef in efs.values():
            ef.commit()
    master = _inputs(shard, 1, device, seed=7)
    rows = _inputs(numel, dp, device, seed=8).to(torch.bfloat16).view(dp, shard)
    deltas, applied = {}, {}
    for path in ("fused", "eager"):
        with (eager_codec() if path == "eager" else contextlib.nullcontext()):
            deltas[path] = fc.compress_delta(comp, master, rows[0])
            applied[path] = rows.clone()
            fc.add_decoded(comp, deltas[path].expand(dp, -1).contiguous(), applied[path])
    got["delta_payload"] = torch.equal(deltas["fused"], deltas["eager"])
    got["delta_decoded_bf16"] = torch.equal(applied["fused"].view(torch.int16), applied["eager"].view(torch.int16))
    _sync(device)
    return got


def measure_format(fmt: str, numel: int, dp: int, device, repeats: int, copy_ms: float) -> Dict:
    import torch

    from megatron_grpo.comm import fused_codec as fc
    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.comm.dynamic import STATS_BLOCK_ELEMENTS
    from megatron_grpo.comm.error_feedback import ErrorFeedback

    comp, shard = build_compressor(fmt, CHUNK), numel // dp
    fp32_bytes = 4 * numel
    out: Dict[str, object] = {"payload_bytes": dp * comp.payload_bytes(shard)}
    for path in ("eager", "fused"):
        ef = ErrorFeedback("int8", CHUNK)
        grad = _inputs(numel, dp, device, seed=1)
        shard_out = torch.empty(shard, dtype=torch.float32, device=device)
        held = {}

        def encode():
            held["send"] = fc.compress_with_feedback("b", grad, dp, ef, comp, 0,
                                                     block_elements=STATS_BLOCK_ELEMENTS)
            ef.commit()

        def decode():
            fc.sum_rows(comp, held["send"], shard, out=shard_out)

        def bucket():
            encode()
            decode()

        with (eager_codec() if path == "eager" else contextlib.nullcontext()):
            for _ in range(2):  # compiles the kernels; the second bucket has a residual to add
                bucket()
            _sync(device)
            enc_ms, dec_ms = _device_ms(encode, device, repeats), _device_ms(decode, device, repeats)
            host = _host_us(bucket, device, repeats)
            launches = count_launches(bucket, device)
        residual = ef.stored("b").nbytes()
        payload = held["send"].numel()
        enc_bytes = fp32_bytes + 2 * residual + payload  # read g and r, write q and r'
        dec_bytes = payload + 4 * shard  # read the dp payload rows, write the fp32 shard
        bucket_ms = enc_ms + dec_ms
        copy_gbps = 2 * fp32_bytes / copy_ms / 1e6  # a copy reads and writes the bytes

        def rate(nbytes, ms):
            return nbytes / ms / 1e6

        if path == "eager":
            label = f"eager: {SWITCH}=0"
        elif launches["triton_launches"]:
            label = "fused: Triton kernels" + (" (interpreted)" if os.environ.get("TRITON_INTERPRET") == "1" else "")
        else:  # the selection fell back: on the CPU always (Triton runs for CUDA tensors only)
            label = f"eager: fused_codec chose the eager codec for {device.type} tensors"
        out[path] = {
            "path": label,
            "encode_ms": enc_ms, "decode_sum_ms": dec_ms, "bucket_ms": bucket_ms,
            "bucket_gbps": rate(fp32_bytes, bucket_ms),
            "encode_traffic_gbps": rate(enc_bytes, enc_ms), "decode_traffic_gbps": rate(dec_bytes, dec_ms),
            "traffic_bytes": enc_bytes + dec_bytes, "traffic_gbps": rate(enc_bytes + dec_bytes, bucket_ms),
            "of_copy": rate(enc_bytes + dec_bytes, bucket_ms) / copy_gbps,
            "encode_of_copy": rate(enc_bytes, enc_ms) / copy_gbps,
            "decode_sum_of_copy": rate(dec_bytes, dec_ms) / copy_gbps,
            "host_us": host, **launches,
        }
        # Free this path's device buffers before the next path allocates its own.
        grad = shard_out = ef = None
        held.clear()
    out["fused_speedup"] = out["eager"]["bucket_ms"] / out["fused"]["bucket_ms"]
    return out


def copy_rate(numel: int, device, repeats: int) -> Dict[str, float]:
    import torch

    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    ms = _device_ms(lambda: dst.copy_(src), device, repeats)
    return {"bytes": 4 * numel, "ms": ms, "gbps": 4 * numel / ms / 1e6, "traffic_gbps": 8 * numel / ms / 1e6}


def measure(device_name: str, numel: int, dp: int, repeats: int, formats=FORMATS) -> Dict:
    """Everything this module measures, as one JSON-able dict (errors per format kept, so a
    crash in one format leaves the others' figures)."""
    import torch

    from megatron_grpo.comm import fused_codec as fc

    device = torch.device(device_name)
    numel = max(dp, numel // dp * dp)
    res: Dict[str, object] = {
        "device": device_name, "numel": numel, "dp": dp, "shard": numel // dp, "chunk": CHUNK,
        "bucket_bytes": 4 * numel, "repeats": repeats, "residual_dtype": "int8",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton_importable": fc.kernels() is not None,
        "fused_on_this_device": bool(fc.fused_enabled(torch.zeros(1, device=device))),
        "formats": {}, "equal": {}, "errors": {}}
    res["copy"] = copy_rate(numel, device, repeats)
    for fmt in formats:
        steps = (("equal", lambda: check_equal(fmt, numel, dp, device)),
                 ("formats", lambda: measure_format(fmt, numel, dp, device, repeats, res["copy"]["ms"])))
        for key, step in steps:  # apart: a crash of one leaves the other's result
            try:
                res[key][fmt] = step()
            except Exception as exc:
                traceback.print_exc()
                res["errors"][fmt] = (res["errors"].get(fmt, "") + f"{key}: {type(exc).__name__}: {exc}; ")[:600]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":
        res["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return res


def interpret_fused_on_cpu() -> None:
    """CPU tensors through the fused kernels under Triton's interpreter (``--interpret``): how the
    tests run this module's fused path without a GPU (as tests/unit/triton_codec_cases.py does).
    Must run before the kernels are first imported: the interpreter is chosen at import."""
    os.environ["TRITON_INTERPRET"] = "1"
    from megatron_grpo.comm import fused_codec as fc

    fc.fused_enabled = lambda *tensors: os.environ.get(SWITCH, "1") != "0" and fc.kernels() is not None


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--result", required=True)
    p.add_argument("--interpret", action="store_true", help="CPU only: the fused path under Triton's "
                   "interpreter (tests)")
    args = p.parse_args(argv)
    if args.interpret:
        if args.device != "cpu":
            p.error("--interpret runs CPU tensors through the kernels: it needs --device cpu")
        interpret_fused_on_cpu()
    t0 = time.time()
    res = measure(args.device, args.numel, args.dp, args.repeats)
    res["interpreted"] = args.interpret
    res["elapsed_s"] = time.time() - t0
    with open(args.result, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"codec_bench: {args.device}, {res['numel']} elements, dp {args.dp}: "
          f"{time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
