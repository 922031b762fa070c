"""Run contenders through the real training entry and read their per-iteration records back.

Every run is ``launch/pretrain_gpt.py`` under torchrun (gloo ranks on CPU, NCCL on a GPU node),
so a benchmark measures exactly what a user's run does. A run whose metrics file is complete
and whose command and training code (a fingerprint) are unchanged is reused (``--reuse``), so an interrupted ``bench all`` resumes
where it stopped instead of retraining finished runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from megatron_grpo.platform.ports import free_port as _free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(REPO, "launch", "pretrain_gpt.py")
CONFIGS = os.path.join(REPO, "launch", "configs")


class BenchError(RuntimeError):
    """A benchmark run failed; the message names the run, its log and what to do."""


@dataclasses.dataclass
class Contender:
    """One side of a side-by-side comparison: a name and the training flags that make it."""

    name: str
    """Short label used in tables, plots and file names (no spaces)."""
    flags: List[str]
    """Training flags added to the suite's common flags (e.g. ``["--grpo"]``)."""
    about: str = ""
    """One line saying what this contender is, for the table and docs."""
    skip: Optional[str] = None
    """When set, the contender is not run and this reason is reported instead (never faked)."""


@dataclasses.dataclass
class RunSpec:
    """Where and how the contenders of one suite run."""

    out: str
    """Directory for metrics (``<name>.jsonl``), commands, plots and the suite's JSON."""
    config: str
    """YAML model/training config (launch/configs/*.yaml)."""
    data_path: str
    """Dataset prefix (``.bin``/``.idx``); the default corpus is built there when missing."""
    nproc: int = 2
    """Ranks per run (one node)."""
    common: List[str] = dataclasses.field(default_factory=list)
    """Flags every contender of the suite gets (seed, iterations, extra user flags)."""
    reuse: bool = True
    """Reuse a complete run with the same command instead of training it again."""
    timeout_s: float = 4 * 3600
    """Wall-clock limit of one run; a run over it is killed and reported."""
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    """Environment every run of the suite gets on top of the bench's own (memory: glibc's
    mmap threshold, so freed host memory returns to the OS and shows in the RSS)."""


def config_value(config: str, key: str, flags: Sequence[str] = ()):
    """The value a run gets for ``key`` (flag name without dashes): last flag, else the YAML."""
    flag = "--" + key
    for i in range(len(flags) - 1, -1, -1):
        if flags[i] == flag and i + 1 < len(flags):
            return flags[i + 1]
    import yaml

    with open(config) as fh:
        return (yaml.safe_load(fh) or {}).get(key)


def code_fingerprint() -> str:
    """sha256 of the training code (this package and the entry script): a run made by other code
    is not reused, even with the same command line."""
    import hashlib

    h = hashlib.sha256()
    pkg = os.path.join(REPO, "megatron_grpo")
    paths = [ENTRY] + sorted(os.path.join(d, f) for d, _, fs in os.walk(pkg) for f in fs
                             if f.endswith(".py") and os.sep + "bench" + os.sep not in d + os.sep)
    for path in paths:
        h.update(os.path.relpath(path, REPO).encode())
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def ensure_data(data_path: str) -> None:
    if not os.path.exists(data_path + ".idx"):
        from megatron_grpo.data import build_default_dataset

        build_default_dataset(data_path)


def read_records(path: str) -> List[Dict]:
    """Per-iteration records of a metrics JSONL, one per iteration, of the file's last run
    (metrics_log.read_metrics: headers and a torn line of a killed run are skipped)."""
    from megatron_grpo.training.metrics_log import read_metrics

    return read_metrics(path)


# Flags that name where a run writes, not what it trains: two commands that differ only in these
# train the same model bit for bit (same code, same machine), so one run can serve both.
OUTPUT_FLAGS = ("--metrics-file", "--run-name", "--tensorboard-dir")


def training_key(cmd: Sequence[str]) -> str:
    """Hash of what a command trains: the command without its output flags (and without the
    torchrun port), plus the training code's fingerprint."""
    import hashlib

    kept, skip = [], False
    for i, c in enumerate(cmd):
        if skip:
            skip = False
            continue
        if c in OUTPUT_FLAGS or (c == "--master_port" and i + 1 < len(cmd)):
            skip = True
            continue
        kept.append(c)
    blob = json.dumps({"command": kept, "code": code_fingerprint()})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class Runner:
    """Runs a suite's contenders one after another and prints a progress line with ETA.

    Complete runs are indexed by :func:`training_key` in ``<out>/../runs-index`` (next to the
    suites' directories), so a contender another suite already trained with the same flags
    (the baseline and GRPO defaults of ``ablation`` and ``front``, say) is copied, not retrained.
    """

    def __init__(self, suite: str, spec: RunSpec, total_runs: int) -> None:
        self.suite, self.spec, self.total = suite, spec, total_runs
        self.done = 0
        self.trained_s: List[float] = []
        self.loads: Dict[str, List[float]] = {}
        """Run name -> the machine's load averages (1, 5, 15 min) when the run ended: timings
        taken with the load above the core count are not comparable, and the notes say so."""
        self.started = time.perf_counter()
        os.makedirs(spec.out, exist_ok=True)
        self.index = os.path.join(os.path.dirname(os.path.abspath(spec.out)), "runs-index")

    def command(self, run_name: str, contender: Contender, extra: Sequence[str] = ()) -> List[str]:
        metrics = os.path.join(self.spec.out, f"{run_name}.jsonl")
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                str(self.spec.nproc), "--master_addr", "127.0.0.1", "--master_port", "{port}",
                ENTRY, "--config", self.spec.config, "--data-path", self.spec.data_path,
                "--metrics-file", metrics, "--run-name", run_name,
                "--tensorboard-dir", os.path.join(self.spec.out, "tensorboard", run_name),
                *self.spec.common, *contender.flags, *extra]

    @staticmethod
    def argv(cmd: Sequence[str]) -> List[str]:
        """The command with a free torchrun port in place of its ``{port}``."""
        port = str(_free_port())
        return [c.replace("{port}", port) for c in cmd]

    def run_env(self, env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """The environment of a run: one thread per rank, the suite's and the run's own."""
        return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                    PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", **self.spec.env, **(env or {}))

    def _eta(self) -> str:
        if not self.trained_s:
            return "ETA unknown until the first run ends"
        per_run = sum(self.trained_s) / len(self.trained_s)
        return f"ETA {per_run * (self.total - self.done) / 60:.1f} min for the suite"

    def run(self, run_name: str, contender: Contender, extra: Sequence[str] = (),
            env: Optional[Dict[str, str]] = None) -> List[Dict]:
        """Train one run (or reuse it) and return its records."""
        cmd = self.command(run_name, contender, extra)
        metrics = os.path.join(self.spec.out, f"{run_name}.jsonl")
        cmd_file = os.path.join(self.spec.out, f"{run_name}.cmd.json")
        iters = int(config_value(self.spec.config, "train-iters", cmd))
        shown = " ".join(c for c in cmd[cmd.index(ENTRY):])
        self.done += 1
        print(f"[bench {self.suite}] run {self.done}/{self.total}: {run_name} ({iters} iterations)"
              f" | {self._eta()}", flush=True)
        if self.spec.reuse and self._complete(metrics, cmd_file, cmd, iters):
            print(f"[bench {self.suite}] {run_name}: reusing the complete run in {metrics}",
                  flush=True)
            with open(cmd_file) as fh:
                self.loads[run_name] = json.load(fh).get("load", [])
            self._add_to_index(cmd, metrics, cmd_file)
            return read_records(metrics)
        if self.spec.reuse and self._copy_from_index(run_name, cmd, metrics, cmd_file, iters):
            return read_records(metrics)
        argv = self.argv(cmd)
        run_env = self.run_env(env)
        print(f"[bench {self.suite}] {shown}", flush=True)
        if os.path.exists(cmd_file):  # the old run's record goes with the old run's metrics
            os.remove(cmd_file)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=REPO, env=run_env, timeout=self.spec.timeout_s)
        except subprocess.TimeoutExpired:
            raise BenchError(f"bench {self.suite}: run '{run_name}' exceeded {self.spec.timeout_s:.0f} s"
                             f" and was killed; its metrics so far are in {metrics}") from None
        if proc.returncode != 0:
            raise BenchError(f"bench {self.suite}: run '{run_name}' failed with exit code "
                             f"{proc.returncode}; its output is above, its metrics in {metrics}. "
                             f"Fix the cause and rerun: complete runs are reused")
        self.trained_s.append(time.perf_counter() - t0)
        with open(cmd_file + ".tmp", "w") as fh:
            self.loads[run_name] = list(os.getloadavg())
            json.dump({"command": cmd, "iterations": iters, "code": code_fingerprint(),
                       "load": self.loads[run_name]}, fh)
        os.replace(cmd_file + ".tmp", cmd_file)
        records = read_records(metrics)
        if not records or records[-1]["iteration"] != iters:
            raise BenchError(f"bench {self.suite}: run '{run_name}' exited 0 but {metrics} ends at "
                             f"iteration {records[-1]['iteration'] if records else 0} of {iters}")
        self._add_to_index(cmd, metrics, cmd_file)
        return records

    def _add_to_index(self, cmd: List[str], metrics: str, cmd_file: str) -> None:
        os.makedirs(self.index, exist_ok=True)
        entry = os.path.join(self.index, training_key(cmd) + ".json")
        with open(entry + ".tmp", "w") as fh:
            json.dump({"metrics": os.path.abspath(metrics), "cmd_file": os.path.abspath(cmd_file)}, fh)
        os.replace(entry + ".tmp", entry)

    def _copy_from_index(self, run_name: str, cmd: List[str], metrics: str, cmd_file: str,
                         iters: int) -> bool:
        """Copy a complete run of the same training key (another suite's) into this run's files."""
        import shutil

        try:
            with open(os.path.join(self.index, training_key(cmd) + ".json")) as fh:
                entry = json.load(fh)
            with open(entry["cmd_file"]) as fh:
                saved = json.load(fh)
        except (OSError, json.JSONDecodeError, KeyError):
            return False
        if not self._complete(entry["metrics"], entry["cmd_file"], saved.get("command", []), iters) \
                or training_key(saved["command"]) != training_key(cmd):
            return False
        shutil.copyfile(entry["metrics"], metrics + ".tmp")
        os.replace(metrics + ".tmp", metrics)
        with open(cmd_file + ".tmp", "w") as fh:
            json.dump({**saved, "command": cmd, "copied_from": entry["metrics"]}, fh)
        os.replace(cmd_file + ".tmp", cmd_file)
        self.loads[run_name] = saved.get("load", [])
        print(f"[bench {self.suite}] same training as {entry['metrics']}: copied, not retrained",
              flush=True)
        return True

    def load_note(self) -> str:
        """One line on how busy the machine was while the suite's runs trained."""
        loads = [v[1] for v in self.loads.values() if len(v) > 1]  # 5-minute averages
        if not loads:
            return "machine load: not recorded for these runs"
        cores = os.cpu_count() or 1
        note = (f"machine load (5-min average at the end of each run): {min(loads):.1f}-"
                f"{max(loads):.1f} on {cores} cores")
        if max(loads) > cores:
            # The run's own ranks and their helper threads count too: a 2-rank run alone
            # measured ~3 on 2 cores, so a high load does not by itself mean another job.
            note += ("; above the core count, so threads waited for a core (the runs' own or "
                     "other jobs') and step times are not comparable between runs (bytes and "
                     "losses are unaffected)")
        return note

    @staticmethod
    def _complete(metrics: str, cmd_file: str, cmd: List[str], iters: int) -> bool:
        try:
            with open(cmd_file) as fh:
                saved = json.load(fh)
            records = read_records(metrics)
        except (OSError, json.JSONDecodeError):
            return False
        return (saved.get("command") == cmd and saved.get("code") == code_fingerprint()
                and bool(records) and records[-1]["iteration"] == iters)
