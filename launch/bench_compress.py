"""Time compress + decompress of one 128 MB fp32 bucket for each dynamic-tier compressor.

    python launch/bench_compress.py [--numel 33554432] [--threads 2] [--repeats 3] [--device cuda]

Prints, per compressor: compression ratio, payload size, relative L2 error of one round trip,
and the best-of-``repeats`` wall time of compress, decompress and error-feedback compress
(which adds a decompress to update the residual). Best-of rather than mean because the
question is the cost of the code, not of whatever else the machine was doing.
"""

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_grpo.comm.compress import COMPRESSOR_NAMES, ErrorFeedback, build_compressor  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_ms(fn, repeats):
    fn()  # warm-up: first-touch page faults and allocator growth are not the steady state
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()  # GPU kernels are asynchronous: time them to completion
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=33_554_432)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--topk-ratio", type=float, default=0.05)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(args.device)
    where = torch.cuda.get_device_name() if x.is_cuda else (platform.processor() or platform.machine())
    print(f"torch {torch.__version__}, {where}, "
          f"threads {torch.get_num_threads()}, numel {args.numel} ({4 * args.numel / 2**20:.0f} MiB fp32), "
          f"chunk {args.chunk}, topk ratio {args.topk_ratio}")
    print(f"{'name':6} {'ratio':>8} {'payload MiB':>12} {'rel err':>8} {'compress ms':>12} "
          f"{'decompress ms':>14} {'sum ms':>8} {'EF step ms':>11}")
    for name in COMPRESSOR_NAMES:
        c = build_compressor(name, args.chunk, args.topk_ratio)
        payload = c.compress(x)
        err = float((c.decompress(payload, x.numel()) - x).norm() / x.norm())
        t_c = best_ms(lambda: c.compress(x), args.repeats)
        t_d = best_ms(lambda: c.decompress(payload, x.numel()), args.repeats)
        ef = ErrorFeedback()
        t_ef = best_ms(lambda: ef.compress(0, x, c, 1), args.repeats)
        print(f"{name:6} {c.ratio(x.numel()):8.4f} {payload.numel() / 2**20:12.3f} {err:8.4f} "
              f"{t_c:12.1f} {t_d:14.1f} {t_c + t_d:8.1f} {t_ef:11.1f}")


if __name__ == "__main__":
    main()
