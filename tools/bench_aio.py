"""DeepSpeed async_io (DeepNVMe aio_handle) write / cold-read benchmark on CPU: the peer the
memory tier's chunk store was measured against (docs/offload.md, "What was not used").

DeepSpeed is not a dependency of this project; install it beside, not into, the environment:
    apt-get install -y libaio-dev
    .venv/bin/pip install --no-deps --target /tmp/dsaio/pkgs deepspeed hjson ninja py-cpuinfo msgpack
    PATH=/tmp/dsaio/pkgs/bin:$PATH PYTHONPATH=/tmp/dsaio/pkgs DS_BUILD_OPS=0 \
        .venv/bin/python tools/bench_aio.py /tmp/dsaio/aio locked:8M:8:2 locked:1M:8:1 plain:8M:32:2

512 MiB fp32 (torch.randn), 4 chunks of 128 MiB written with async_pwrite at 4 offsets of one
file (like the project's single slot file), wait(), then fsync; drop the file's page cache
(POSIX_FADV_DONTNEED); cold read with async_pread of the 4 chunks, wait(), torch.equal.

Buffers:
  locked -- the I/O tensor is allocated by h.new_cpu_locked_tensor (DeepSpeed's page-aligned,
            mlock'ed allocator); aio then does O_DIRECT straight from/into it (no bounce copy).
            The randn data is copied into it *before* the write timer starts.
  plain  -- the plain torch.randn tensor itself; it is neither torch-pinned nor DeepSpeed-managed,
            so cpu_op_desc_t allocates a page-locked bounce buffer per op and copies through it
            (copy in on write, copy out in wait() on read); that cost is inside the timer.

Usage: bench.py DIR CONFIG [CONFIG...]   CONFIG = buf:block_size:queue_depth:intra_op[:prealloc|fresh]
e.g.   bench.py /tmp/dsaio/aio locked:1M:8:1 locked:8M:32:2 plain:8M:32:2
MB/s uses MB = 10**6 bytes.
"""
import os
import sys
import time

import torch

try:
    from deepspeed.ops.op_builder import AsyncIOBuilder
except ImportError as exc:  # not a dependency: say how to get it
    sys.exit(f"tools/bench_aio.py needs DeepSpeed ({exc}); see this file's docstring for the "
             f"install beside the project's environment")

TOTAL_MIB, CHUNK_MIB = 512, 128
SINGLE_SUBMIT, OVERLAP_EVENTS = False, True  # DeepSpeed's ZeRO aio config defaults


def size(s):
    return int(s[:-1]) << 20 if s.endswith("M") else int(s)


def timed_ops(h, op, chunks, path, offsets) -> float:
    """Seconds for one async op per chunk at its offset, submitted together, until wait()."""
    start = time.perf_counter()
    for c, off in zip(chunks, offsets):
        assert op(c, path, off) == 0
    done = h.wait()
    seconds = time.perf_counter() - start
    assert done == len(chunks), done
    return seconds


def run(directory, spec, op, reference):
    parts = spec.split(":")
    buf, bs, qd, iop = parts[0], size(parts[1]), int(parts[2]), int(parts[3])
    mode = parts[4] if len(parts) > 4 else "prealloc"
    h = op.aio_handle(bs, qd, SINGLE_SUBMIT, OVERLAP_EVENTS, iop)
    numel = reference.numel()
    per = numel * CHUNK_MIB // TOTAL_MIB
    total_bytes = reference.nbytes
    if buf == "locked":
        data = h.new_cpu_locked_tensor(numel, reference)
        data.copy_(reference)
    else:
        data = reference.clone()
    assert h.is_pinned(data) == (buf == "locked")
    path = os.path.join(directory, f"aio_{buf}_{bs >> 20}M_{qd}_{iop}.bin")
    if os.path.exists(path):
        os.unlink(path)
    if mode == "prealloc":  # the project's store posix_fallocate's its file up front
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, total_bytes)
        os.fsync(fd)
        os.close(fd)
    chunks = [data[i * per:(i + 1) * per] for i in range(TOTAL_MIB // CHUNK_MIB)]
    offsets = [i * per * 4 for i in range(len(chunks))]

    write_s = timed_ops(h, h.async_pwrite, chunks, path, offsets)
    fd = os.open(path, os.O_RDONLY)
    t = time.perf_counter()
    os.fsync(fd)
    fsync_s = time.perf_counter() - t
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert os.path.getsize(path) == total_bytes

    data.zero_()
    read_s = timed_ops(h, h.async_pread, chunks, path, offsets)
    ok = torch.equal(data, reference)
    mb = total_bytes / 1e6
    print(f"aio {buf:6s} bs={bs >> 20}M qd={qd:2d} iop={iop} {mode:8s} "
          f"write {mb / write_s:7.0f} MB/s (incl fsync {mb / (write_s + fsync_s):7.0f})  "
          f"cold read {mb / read_s:6.0f} MB/s  equal={ok}", flush=True)
    if buf == "locked":
        h.free_cpu_locked_tensor(data)
    del chunks, data, h
    os.unlink(path)
    if not ok:
        sys.exit("torch.equal failed")


def main():
    directory, specs = sys.argv[1], sys.argv[2:]
    os.makedirs(directory, exist_ok=True)
    op = AsyncIOBuilder().load(verbose=False)
    torch.manual_seed(0)
    reference = torch.randn(TOTAL_MIB << 18)
    for spec in specs:
        run(directory, spec, op, reference)


if __name__ == "__main__":
    main()
