"""Run the real training entry (launch/pretrain_gpt.py) under torchrun from tests.

Tests drive the same script users run; results come back through its metrics JSONL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from megatron_grpo.platform.ports import free_port  # noqa: F401  (tests import it from here)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(REPO, "launch", "pretrain_gpt.py")


def load_script(relpath: str, name: str):
    """A script of the checkout (e.g. ``launch/plan.py``) imported as module ``name``, as tests
    call its ``main`` or helpers without a subprocess."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# Small enough for 2 CPU cores; hidden 96 makes megatron pad parameter starts (to 64 elements),
# so the analytic byte check exercises the padding rules.
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4",
               "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "4",
               "--ddp-bucket-size", "20000", "--log-interval", "1000", "--eval-iters", "2",
               "--seed", "7"]

# SMALL_MODEL's shape and schedule, Llama-style layers.
LLAMA_SMALL = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4",
               "--num-query-groups", "2", "--ffn-hidden-size", "256", "--swiglu", "--normalization", "RMSNorm",
               "--position-embedding-type", "rope", "--rotary-base", "500000", "--disable-bias-linear",
               "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "4", "--log-interval", "1000",
               "--eval-iters", "2", "--seed", "7"]


def env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    e.update(extra or {})
    return e


def run_training(nproc: int, args: Sequence[str], timeout: int = 300,
                 check: bool = True, extra_env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """torchrun --nproc_per_node nproc launch/pretrain_gpt.py args (standalone rendezvous);
    ``extra_env`` is added to the ranks' environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), ENTRY, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(extra_env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def read_metrics(path: str) -> List[dict]:
    """The last run's per-iteration records as logged (a resumed segment's repeated iterations
    included; headers skipped): megatron_grpo.training.metrics_log.read_logged."""
    from megatron_grpo.training.metrics_log import read_logged

    return read_logged(path)


def losses(records: List[dict]) -> List[float]:
    return [r["loss"] for r in records]


def train_and_read(tmp_path, name: str, nproc: int, args: Sequence[str],
                   timeout: int = 300, extra_env: Optional[Dict[str, str]] = None) -> List[dict]:
    metrics = os.path.join(str(tmp_path), f"{name}.jsonl")
    run_training(nproc, [*args, "--metrics-file", metrics, "--run-name", name], timeout=timeout,
                 extra_env=extra_env)
    return read_metrics(metrics)


def stop_and_resume(tmp_path, nproc: int, args: Sequence[str], full: List[dict], save_at: int,
                    extra_env: Optional[Dict[str, str]] = None):
    """The resume-and-compare pattern: ``args`` run again, saved at iteration ``save_at``, stopped
    one iteration later and resumed from the checkpoint in a new job (the same metrics file).
    Asserts the resumed job logs iterations save_at+1.. with losses bit-identical to ``full``
    (the uninterrupted run's records). Returns (resumed records, the resumed job's process)."""
    ckpt, metrics = str(tmp_path / "ck"), str(tmp_path / "resumed.jsonl")
    run_training(nproc, [*args, "--save", ckpt, "--save-interval", str(save_at), "--exit-after-iter",
                         str(save_at + 1), "--metrics-file", metrics], extra_env=extra_env)
    proc = run_training(nproc, [*args, "--load", ckpt, "--metrics-file", metrics], extra_env=extra_env)
    resumed = read_metrics(metrics)[save_at + 1:]
    assert [r["iteration"] for r in resumed] == [r["iteration"] for r in full[save_at:]]
    assert losses(resumed) == losses(full)[save_at:]
    return resumed, proc


# GRPO at test scale, with all three tiers: the former 15/65/20 split, an exact core and the
# frozen stable mode are pinned (the defaults since the quality front are core 0.15 int8, dynamic
# 0.85, no stable tier). Most multi-rank tests check what frozen units do (no wgrad, no optimizer
# work, untouched buffers) and that core is megatron's own sync; the tests of the delayed mode and
# of the int8 core pass their flags after it (the last one wins).
THREE_TIERS = ["--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.65", "--grpo-stable-share", "0.2",
               "--grpo-max-dynamic-share", "0.7", "--grpo-core-compressor", "none"]
# --grpo-compress all: these tests check the compressed path, which --grpo-compress auto does
# not take on localhost (the measured exact sync is faster there).
GRPO_SMALL = ["--grpo", "--grpo-compress", "all", "--grpo-bucket-mb", "0.04", "--grpo-warmup-iters", "6",
              "--grpo-retier-interval", "8", "--grpo-stable-interval", "4",
              "--grpo-gvr-interval", "4", "--grpo-importance-interval", "1",
              "--grpo-stable-mode", "frozen", *THREE_TIERS]


def run_probe(tmp_path, nproc: int, args: Sequence[str], timeout: int = 300) -> dict:
    """tests/multiproc/grpo_probe.py under torchrun; returns its JSON (per-rank step records)."""
    out = os.path.join(str(tmp_path), "probe.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(REPO, "tests", "multiproc", "grpo_probe.py"), out, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"probe failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as fh:
        return json.load(fh)


def replica_groups(probe: dict) -> dict:
    """The probe's per-rank records grouped by (TP rank, PP stage): the data-parallel copies of
    one model shard, which must agree bit for bit."""
    groups: dict = {}
    for rank in probe["ranks"]:
        groups.setdefault((rank[0]["tp"], rank[0]["pp"]), []).append(rank)
    return groups


def assert_copies_agree(probe: dict, tier: str, tp_replicated: bool) -> None:
    """Two model shards of two data-parallel copies each; every copy of a shard has the same
    tiers and bytes (weights and replicated elements) after every step, and holds a unit of
    ``tier`` (a one-letter code) at the end. ``tp_replicated``: the parameters every
    tensor-parallel rank holds (layernorms, row-parallel biases) are the same bytes on all ranks."""
    groups = replica_groups(probe)
    assert len(groups) == 2 and all(len(g) == 2 for g in groups.values())
    for first, other in groups.values():
        assert tier in first[-1]["tiers"]
        for a, b in zip(first, other):
            assert a["tiers"] == b["tiers"] and a["digest"] == b["digest"], a["iteration"]
            assert a["replicated_digest"] == b["replicated_digest"], a["iteration"]
    if tp_replicated:
        for step in zip(*probe["ranks"]):
            assert len({rec["replicated_digest"] for rec in step}) == 1, step[0]["iteration"]


def probe_with_metrics(tmp_path, nproc: int, args: Sequence[str], timeout: int = 300):
    """run_probe with a metrics file in ``tmp_path``: (probe JSON, the run's metric records)."""
    metrics = os.path.join(str(tmp_path), "m.jsonl")
    probe = run_probe(tmp_path, nproc, [*args, "--metrics-file", metrics], timeout=timeout)
    return probe, read_metrics(metrics)


def _run_rank(worker, rank, port, queue):
    """One spawned rank: ``worker`` and then an immediate exit once its results are flushed.

    Why not a normal interpreter exit: once (CI, stop 15) a rank that had delivered all of its
    results and destroyed its process groups died at interpreter teardown with SIGABRT
    ("terminate called without an active exception" -- a c10d/gloo C++ thread still joinable
    while static objects were destroyed). That teardown is torch's, not the code under test, and
    it turned a passing test into a failure. A worker's own failure still shows: its traceback is
    printed and the rank exits 1."""
    import traceback

    try:
        worker(rank, port, queue)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    queue.close()
    queue.join_thread()  # every result reaches the parent before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def megatron_rank(rank, port, queue, body, world_size: int = 2, timeout_s: Optional[int] = None,
                  seed: Optional[int] = None, **kwargs) -> None:
    """A spawned rank of a test that runs megatron-core on CPU: a gloo group of ``world_size``
    on loopback, megatron's parallel state (and, with ``seed``, its model-parallel RNG tracker,
    which attention forks), then ``body(rank, **kwargs)``, whose dict goes on the queue with the
    rank, or its traceback as "error" (a failing rank would otherwise leave the queue empty);
    everything torn down. Use it through ``spawn_ranks(functools.partial(megatron_rank,
    body=...))``."""
    import datetime
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.platform import select_platform

    select_platform(force_cpu=True)
    import torch.distributed as dist

    extra = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", rank=rank, world_size=world_size, **extra)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    if seed is not None:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    out = {"rank": rank}
    try:
        out.update(body(rank, **kwargs))
    except BaseException:
        out["error"] = traceback.format_exc()
    queue.put(out)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def spawn_ranks(worker, nranks: int = 2, timeout: int = 120) -> list:
    """Run ``worker(rank, port, queue)`` in ``nranks`` spawned processes (a gloo group on
    loopback); returns what each put on the queue, in arrival order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(worker, r, port, queue)) for r in range(nranks)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return results


def file_digests(root) -> Dict[str, str]:
    """relative path -> sha256 of every file under ``root``: what a test compares to show a
    checkpoint directory was left untouched."""
    import hashlib

    out = {}
    for base, _, files in os.walk(str(root)):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, str(root))] = hashlib.sha256(fh.read()).hexdigest()
    return out


def write_gathered(out_path: str, mine, **extra) -> None:
    """A probe's epilogue: every rank's ``mine`` gathered to rank 0, which writes
    ``{"ranks": [...], **extra}`` to ``out_path``; then the process group is closed."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump({"ranks": gathered, **extra}, fh)
    dist.barrier()
    dist.destroy_process_group()


def leave() -> None:
    """A probe's exit once its results are written. Once (CI, stop 17) a rank that had finished
    died at interpreter teardown with SIGABRT ("terminate called without an active exception": a
    gloo C++ thread still joinable while statics were destroyed), which is torch's teardown, not
    the code under test (_run_rank below does the same)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
