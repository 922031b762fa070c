"""Time the dynamic-tier compressors: one 128 MB bucket, or host time per bucket against dp.

    python tools/bench_compress.py [--numel 33554432] [--threads 2] [--repeats 3] [--device cuda]
    python tools/bench_compress.py --dp 8 64 512 [--bucket-numel 40000 33554432] [--threads 2]
                                    [--repeats 5] [--compressors int4 int8 topk] [--device cuda]

Default mode prints, per compressor: compression ratio, payload size, relative L2 error of one
round trip, and the best-of-``repeats`` wall time of compress, decompress and error-feedback
compress (which adds a decompress to update the residual).

``--dp`` mode times, for each bucket size (padded up to a multiple of dp, as megatron pads its
buckets) and each dp, the host work one rank does per bucket in the dynamic tier, with the
collectives themselves left out (the received / gathered buffers are stand-ins of the right
size and content):

* ``ef``: error-feedback compress of the bucket as dp shards (compress + decompress to update
  the residual), giving the flat send buffer;
* ``recv``: decode the dp payloads received for this rank's shard and sum them;
* ``gather``: compress this rank's parameter delta, decode the dp gathered payloads and add
  them to the dp shards of the parameter buffer.

``old`` is the per-shard Python loop comm/dynamic.py ran before the batched API (error
feedback shard by shard as the former ``ErrorFeedback.compress`` did, reproduced here in
``shard_loop_ef``, then one decompress per received / gathered payload); ``batched`` is the
same work with compress_rows / decompress_rows / decompress_rows_sum on the [dp, shard] views
(decompress_rows into a [dp, shard] workspace the caller keeps: a fresh bucket-sized tensor per
call costs its page faults on the CPU, where the loop's shard-sized temporaries are reused
heap). Each stage is timed on its own and the totals are sums of the stages' best times.
Best-of rather than mean because the question is the cost of the code, not of whatever else the
machine was doing: ``--repeats`` rounds, each taking one sample of every (dp, path, stage) in
turn, a sample repeating the stage for ~20 ms so that short stages are not at the mercy of the
timer.
"""

import argparse
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_grpo.comm.compress import COMPRESSOR_NAMES, build_compressor  # noqa: E402


def shard_loop_ef(residual, grad, c, shards):
    """Error feedback shard by shard (the pre-batched hot path): residual becomes c - D(C(c))
    with c = grad + residual, one compress + decompress per shard; returns the payloads."""
    residual.add_(grad)
    shard_len = grad.numel() // shards
    payloads = []
    for s in range(shards):
        part = residual[s * shard_len:(s + 1) * shard_len]
        q = c.compress(part)
        part.sub_(c.decompress(q, shard_len))
        payloads.append(q)
    return payloads


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def best_ms(fn, repeats, device="cpu"):
    fn()  # warm-up: first-touch page faults and allocator growth are not the steady state
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)  # GPU kernels are asynchronous: time them to completion
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _where(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def bench_one_bucket(args):
    torch.set_num_threads(args.threads)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(args.device)
    print(f"torch {torch.__version__}, {_where(args.device)}, "
          f"threads {torch.get_num_threads()}, numel {args.numel} ({4 * args.numel / 2**20:.0f} MiB fp32), "
          f"chunk {args.chunk}, topk ratio {args.topk_ratio}")
    print(f"{'name':6} {'ratio':>8} {'payload MiB':>12} {'rel err':>8} {'compress ms':>12} "
          f"{'decompress ms':>14} {'sum ms':>8} {'EF step ms':>11}")
    for name in args.compressors:
        c = build_compressor(name, args.chunk, args.topk_ratio)
        payload = c.compress(x)
        err = float((c.decompress(payload, x.numel()) - x).norm() / x.norm())
        t_c = best_ms(lambda: c.compress(x), args.repeats, args.device)
        t_d = best_ms(lambda: c.decompress(payload, x.numel()), args.repeats, args.device)
        residual = torch.zeros_like(x)
        t_ef = best_ms(lambda: shard_loop_ef(residual, x, c, 1), args.repeats, args.device)
        print(f"{name:6} {c.ratio(x.numel()):8.4f} {payload.numel() / 2**20:12.3f} {err:8.4f} "
              f"{t_c:12.1f} {t_d:14.1f} {t_c + t_d:8.1f} {t_ef:11.1f}")


def _stages(c, dp, shard, device, seed):
    """(old stages, batched stages): name -> zero-argument callable doing one bucket's work."""
    g = torch.Generator().manual_seed(seed)
    n = dp * shard
    grad = (torch.randn(n, generator=g) * 1e-2).to(device)
    param = torch.randn(n, generator=g).to(device)
    master = (param[:shard] + 1e-3 * torch.randn(shard, generator=g).to(device)).contiguous()
    mine = param[:shard]  # rank 0's shard
    shard_out = torch.empty(shard, device=device)
    old_residual = torch.zeros(n, device=device)
    send = torch.cat(shard_loop_ef(old_residual, grad, c, dp))  # stand-in received / gathered
    size = send.numel() // dp
    residual = torch.zeros(n, device=device)
    work = torch.empty(dp, shard, device=device)  # decode workspace the batched caller keeps

    def old_ef():
        torch.cat(shard_loop_ef(old_residual, grad, c, dp))

    def old_recv():
        shard_out.zero_()
        for r in range(dp):
            c.decompress(send[r * size:(r + 1) * size], shard, out=shard_out, accumulate=True)

    def old_gather():
        c.compress(master - mine)
        for r in range(dp):
            view = param[r * shard:(r + 1) * shard]
            view.add_(c.decompress(send[r * size:(r + 1) * size], shard))

    def new_ef():
        residual.add_(grad)
        rows = residual.view(dp, shard)
        q = c.compress_rows(rows)
        rows.sub_(c.decompress_rows(q, shard, out=work))
        q.view(-1)  # already the flat send buffer: no cat

    def new_recv():
        c.decompress_rows_sum(send.view(dp, size), shard, out=shard_out)

    def new_gather():
        c.compress(master - mine)
        param.view(dp, shard).add_(c.decompress_rows(send.view(dp, size), shard, out=work))

    return ({"ef": old_ef, "recv": old_recv, "gather": old_gather},
            {"ef": new_ef, "recv": new_recv, "gather": new_gather})


def _sample_ms(fn, inner, device):
    _sync(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    _sync(device)  # GPU kernels are asynchronous: time them to completion
    return 1e3 * (time.perf_counter() - start) / inner


def bench_dp(args):
    torch.set_num_threads(args.threads)
    load = " ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    print(f"torch {torch.__version__}, {_where(args.device)}, threads {torch.get_num_threads()}, "
          f"chunk {args.chunk}, topk ratio {args.topk_ratio}, best of {args.repeats} rounds, "
          f"load average at start {load}; host ms per bucket (collectives not included)\n")
    print("| bucket | comp | dp | shard | old ef | old recv | old gather | **old total** "
          "| new ef | new recv | new gather | **batched total** | old / batched |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    for bucket in args.bucket_numel:
        for name in args.compressors:
            c = build_compressor(name, args.chunk, args.topk_ratio)
            # Every (dp, path, stage) gets one sample per round, rounds interleaved, best kept:
            # a burst of load from other users of the machine then slows one sample of each
            # configuration rather than all samples of one of them.
            jobs = {}
            for dp in args.dp:
                old, new = _stages(c, dp, -(-bucket // dp), args.device, seed=dp)
                jobs.update({(dp, "old", k): f for k, f in old.items()})
                jobs.update({(dp, "new", k): f for k, f in new.items()})
            inner, best = {}, {}
            for key, fn in jobs.items():  # warm-up, and calls per sample for ~20 ms samples
                first = _sample_ms(fn, 1, args.device)
                inner[key] = max(1, min(200, math.ceil(20.0 / max(first, 1e-3))))
                best[key] = math.inf
            for _ in range(args.repeats):
                for key, fn in jobs.items():
                    best[key] = min(best[key], _sample_ms(fn, inner[key], args.device))
            del jobs
            totals = {}
            for dp in args.dp:
                t_old = {k: best[(dp, "old", k)] for k in ("ef", "recv", "gather")}
                t_new = {k: best[(dp, "new", k)] for k in ("ef", "recv", "gather")}
                so, sn = sum(t_old.values()), sum(t_new.values())
                totals[dp] = (so, sn)
                print(f"| {bucket:,} | {name} | {dp} | {-(-bucket // dp):,} | {t_old['ef']:.3f} | "
                      f"{t_old['recv']:.3f} | {t_old['gather']:.3f} | **{so:.3f}** | "
                      f"{t_new['ef']:.3f} | {t_new['recv']:.3f} | {t_new['gather']:.3f} | "
                      f"**{sn:.3f}** | {so / sn:.1f}x |", flush=True)
            lo, hi = min(args.dp), max(args.dp)
            summary.append((bucket, name, lo, hi, totals[hi][0] / totals[lo][0],
                            totals[hi][1] / totals[lo][1]))
    print(f"\n| bucket | comp | old t(dp={hi}) / t(dp={lo}) | batched t(dp={hi}) / t(dp={lo}) "
          f"| goal batched <= 1.5 |")
    print("|---:|---|---:|---:|---|")
    for bucket, name, lo, hi, r_old, r_new in summary:
        print(f"| {bucket:,} | {name} | {r_old:.2f} | {r_new:.2f} | "
              f"{'met' if r_new <= 1.5 else 'missed'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=33_554_432, help="bucket of the default mode")
    parser.add_argument("--dp", type=int, nargs="+", help="dp sizes: per-bucket host time mode")
    parser.add_argument("--bucket-numel", type=int, nargs="+", default=[40_000, 33_554_432],
                        help="bucket sizes (elements) of --dp mode")
    parser.add_argument("--compressors", nargs="+", default=list(COMPRESSOR_NAMES),
                        choices=COMPRESSOR_NAMES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--topk-ratio", type=float, default=0.05)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.dp:
        bench_dp(args)
    else:
        bench_one_bucket(args)


if __name__ == "__main__":
    main()
