"""Training runs of the device check: the run record, the shared context (budget, folders, the
corpus) and the pool that runs them side by side.

Every rank is its own process, ``python tools/gpu_checks/train_entry.py <training flags>``
with RANK / WORLD_SIZE / MASTER_* set here (no torchrun: two ranks on one device both need
LOCAL_RANK=0), started in a session of its own so a timeout kills all it started. The runs of
phases b, c and d are independent and small, so they share the device at once (``slots``
processes at a time); phase e times steps and runs alone. A run that outlives its cap, or the
budget, is killed; a run whose rank failed has its other ranks killed after a short grace
(they would wait on a collective until the distributed timeout).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_grpo.platform.ports import free_port

from .common import ROOT, STRICT_ENV, kill_group, run_command, tail_lines

ENTRY = os.path.join(ROOT, "tools", "gpu_checks", "train_entry.py")
FAILED_RANK_GRACE_S = 20.0


@dataclass
class TrainRun:
    """One training run (``nproc`` ranks) and, once run, what it left."""

    name: str
    phase: str
    args: List[str]
    nproc: int = 1
    optimizer: str = ""
    """'' (megatron's own pick) or a tools/gpu_checks/fused_adam.py kind."""
    env: Dict[str, str] = field(default_factory=dict)
    cap_s: float = 240.0
    rcs: List[Optional[int]] = field(default_factory=list)
    timed_out: bool = False
    started: bool = False
    elapsed_s: float = 0.0
    records: List[Dict] = field(default_factory=list)
    opt_dumps: List[Dict] = field(default_factory=list)
    platform: Optional[str] = None
    spec: Optional[str] = None
    log_tail: str = ""

    @property
    def train_iters(self) -> int:
        return int(self.args[len(self.args) - 1 - self.args[::-1].index("--train-iters") + 1])

    @property
    def ok(self) -> bool:
        return (self.started and not self.timed_out and len(self.rcs) == self.nproc
                and all(rc == 0 for rc in self.rcs) and len(self.records) == self.train_iters)

    def describe(self) -> str:
        if not self.started:
            return f"{self.name}: not started (budget spent or corpus missing)"
        how = "timed out" if self.timed_out else f"rc {self.rcs}"
        return (f"{self.name}: {how}, {len(self.records)}/{self.train_iters} iterations logged "
                f"in {self.elapsed_s:.0f} s")

    @property
    def losses(self) -> List[float]:
        return [r.get("loss") for r in self.records]


class Context:
    """The budget, the folders and the corpus shared by the phases."""

    def __init__(self, out: str, work: str, data_dir: str, cpu: bool, budget_s: float,
                 started: float, slots: int) -> None:
        self.out, self.work, self.data_dir = out, work, data_dir
        self.cpu, self.budget_s, self.started, self.slots = cpu, budget_s, started, max(1, slots)
        self.deadline = started + budget_s
        self.site: Optional[str] = None  # where phase a installed the wheels
        self.data_error = ""
        self._data: Optional[bool] = None
        self.facts: Dict[str, object] = {}  # what phase a found (TE, apex, GPU name)
        os.makedirs(out, exist_ok=True)
        os.makedirs(work, exist_ok=True)

    def remaining(self) -> float:
        return self.deadline - time.time()

    def limit(self, cap_s: float) -> float:
        return max(1.0, min(cap_s, self.remaining() - 5.0))

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        e = dict(os.environ)
        e.pop("MEGATRON_GRPO_FORCE_CPU", None)
        e.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        if self.site:
            e["PYTHONPATH"] = self.site + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        e.update(extra or {})
        return e

    @property
    def data_prefix(self) -> str:
        return os.path.join(self.data_dir, "stdlib")

    def ensure_data(self) -> bool:
        """The default corpus (CPython stdlib text, byte tokenizer), built once."""
        if self._data is not None:
            return self._data
        prefix = self.data_prefix
        if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
            self._data = True
            return True
        os.makedirs(self.data_dir, exist_ok=True)
        cmd = run_command([sys.executable, "launch/preprocess_data.py", "--default-corpus",
                           "--output-prefix", prefix], os.path.join(self.work, "preprocess.log"),
                          self.limit(90), self.env())
        self._data = cmd.rc == 0
        if not self._data:
            self.data_error = f"building the corpus failed (rc {cmd.rc}): {cmd.tail(3)}"
        return self._data


# ------------------------------------------------------------------------------------ the pool
@dataclass
class _Active:
    run: TrainRun
    procs: List[subprocess.Popen]
    logs: List[str]
    files: List
    t0: float
    deadline: float
    failed_at: Optional[float] = None


def _start(ctx: Context, run: TrainRun) -> Optional[_Active]:
    if not ctx.ensure_data() or ctx.remaining() < 20:
        return None
    port = free_port()
    metrics = os.path.join(ctx.work, f"{run.name}.jsonl")
    for path in [metrics] + [os.path.join(ctx.work, f"{run.name}.opt.rank{r}.json") for r in range(run.nproc)]:
        if os.path.exists(path):
            os.remove(path)
    argv = [sys.executable, ENTRY, *run.args, "--data-path", ctx.data_prefix,
            "--metrics-file", metrics, "--run-name", run.name] + (["--cpu"] if ctx.cpu else [])
    procs, logs, files = [], [], []
    for rank in range(run.nproc):
        env = ctx.env({"RANK": str(rank), "WORLD_SIZE": str(run.nproc), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(run.nproc), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
        if run.optimizer:
            env["GPU_CHECK_OPTIMIZER"] = run.optimizer
            env["GPU_CHECK_OPT_DUMP"] = os.path.join(ctx.work, f"{run.name}.opt.rank{rank}.json")
        if run.nproc > 1:
            env["GPU_CHECK_COALESCE_SHIM"] = "1"
            if not ctx.cpu:
                env["GPU_CHECK_GLOO_CUDA"] = "1"
        if "--grpo" in run.args:
            env[STRICT_ENV] = "1"  # every tensor GRPO hands to a collective is on the device
        env.update(run.env)
        log = os.path.join(ctx.work, f"{run.name}.rank{rank}.log")
        fh = open(log, "w")
        fh.write("$ " + " ".join(argv) + "\n")
        fh.flush()
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
        logs.append(log)
        files.append(fh)
    run.started = True
    now = time.time()
    return _Active(run, procs, logs, files, now, now + ctx.limit(run.cap_s))


def _finish(ctx: Context, act: _Active) -> None:
    run = act.run
    for fh in act.files:
        fh.close()
    run.elapsed_s = time.time() - act.t0
    run.rcs = [p.returncode for p in act.procs]
    metrics = os.path.join(ctx.work, f"{run.name}.jsonl")
    if os.path.exists(metrics):
        from megatron_grpo.training.metrics_log import read_metrics  # one record per iteration, headers skipped

        run.records = read_metrics(metrics)
    for rank in range(run.nproc):
        path = os.path.join(ctx.work, f"{run.name}.opt.rank{rank}.json")
        if os.path.exists(path):
            with open(path) as fh:
                run.opt_dumps.append(json.load(fh))
    try:
        with open(act.logs[0], errors="replace") as fh:
            m = re.search(r"platform=(\S+) spec=(\S+)", fh.read())
        run.platform, run.spec = (m.group(1), m.group(2)) if m else (None, None)
    except OSError:
        pass
    keep = 12 if run.ok else 60
    parts = [f"---- run {run.describe()}; platform {run.platform}"]
    for rank, log in enumerate(act.logs):
        if rank == 0 or not run.ok:
            parts.append(f"[rank {rank} log, last {keep} lines]")
            parts.extend(tail_lines(log, keep))
    run.log_tail = "\n".join(parts)
    print(f"  run {run.describe()}, platform {run.platform}", flush=True)


def run_pool(ctx: Context, runs: List[TrainRun], slots: Optional[int] = None) -> None:
    """Run ``runs`` with at most ``slots`` rank processes at a time (a run larger than the
    slots runs alone), in list order."""
    slots = slots or ctx.slots
    pending, active = list(runs), []
    while pending or active:
        used = sum(a.run.nproc for a in active)
        while pending and (not active or used + pending[0].nproc <= slots):
            run = pending.pop(0)
            act = _start(ctx, run)
            if act is None:
                run.log_tail = f"---- run {run.describe()} {ctx.data_error}"
                print(f"  run {run.describe()} {ctx.data_error}", flush=True)
                continue
            active.append(act)
            used += run.nproc
        time.sleep(0.2)
        now = time.time()
        for act in list(active):
            codes = [p.poll() for p in act.procs]
            if all(c is not None for c in codes):
                _finish(ctx, act)
                active.remove(act)
                continue
            if any(c not in (None, 0) for c in codes) and act.failed_at is None:
                act.failed_at = now
            late = act.failed_at is not None and now - act.failed_at > FAILED_RANK_GRACE_S
            if now > act.deadline or late:
                act.run.timed_out = now > act.deadline
                for p in act.procs:
                    if p.poll() is None:
                        kill_group(p)
                _finish(ctx, act)
                active.remove(act)
