"""Metrics sinks: JSONL file (an append-only log: metrics_log.py), TensorBoard, and a rank-0
progress line.

Call sites log through ``MetricsLogger`` without branches: ranks that do not write metrics get
sinks that do nothing.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Dict, List, Optional

from megatron_grpo.training.metrics_log import JsonlLog


def wire_fields(wire: Dict) -> Dict:
    """A step's traffic as the metrics record holds it, from WireCounter.reset()'s snapshot:
    the project's loop and the Megatron-LM runner write the same fields."""
    by_op = wire["by_op"]
    return {
        "wire_bytes": wire["total"],
        "wire_bytes_grad_reduce": by_op.get("reduce_scatter_tensor", 0) + by_op.get("_reduce_scatter_base", 0),
        "wire_bytes_param_gather": by_op.get("all_gather_into_tensor", 0) + by_op.get("_all_gather_base", 0),
        "wire_bytes_logging": wire["by_tag"].get("logging", 0),
        "wire_bytes_inter_node": wire["by_link"].get("inter_node", 0),
        "wire_calls": wire["calls"],
    }


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def step_peak_rss_bytes() -> Optional[int]:
    """Peak resident set size since the previous call (Linux VmHWM, then reset through
    /proc/self/clear_refs), so a step's peak is seen even after an earlier, larger one; the
    whole-run peak is the running maximum. None where /proc does not offer it."""
    try:
        with open("/proc/self/status") as fh:
            hwm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return hwm
    except (OSError, StopIteration, ValueError):
        return None


class MetricsSink:
    """Does nothing; subclasses write somewhere."""

    def write(self, record: Dict) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardSink(MetricsSink):
    """Every numeric field of a record becomes a scalar at step ``iteration``.

    One Summary event per record holds all of them: a GRPO record has ~70 fields, and
    SummaryWriter.add_scalar builds an event per field (~80 µs each, 5 ms a step on rank 0,
    which every rank then waits for at the next collective); one event costs ~0.5 ms.
    TensorBoard reads the values as the same scalars."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard.writer import FileWriter

        self._writer = FileWriter(log_dir)

    def write(self, record: Dict) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in record.items()
                  if key != "iteration" and not isinstance(value, bool)
                  and isinstance(value, (int, float)) and math.isfinite(value)]
        self._writer.add_summary(Summary(value=values), record.get("iteration", 0))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """Fans records out to sinks and prints a progress line every ``log_interval`` iterations."""

    def __init__(self, sinks: List[MetricsSink], log_interval: int, total_iters: int,
                 print_progress: bool, run_name: str = "run") -> None:
        self.sinks = sinks
        self.log_interval = log_interval
        self.total_iters = total_iters
        self.print_progress = print_progress
        self.run_name = run_name
        self._started = time.perf_counter()
        self._first_iter: Optional[int] = None

    @classmethod
    def create(cls, enabled: bool, metrics_file: Optional[str], tensorboard_dir: Optional[str],
               log_interval: int, total_iters: int, run_name: str,
               start_iteration: int = 0) -> "MetricsLogger":
        """``start_iteration``: where this run starts (0, or the checkpoint it resumed from):
        the JSONL file gets a run_start or a resume header (metrics_log.py)."""
        sinks: List[MetricsSink] = []
        if enabled and metrics_file:
            sinks.append(JsonlLog(metrics_file, start_iteration, label=run_name,
                                  header={"run_name": run_name, "train_iters": total_iters}))
        if enabled and tensorboard_dir:
            sinks.append(TensorBoardSink(tensorboard_dir))
        return cls(sinks, log_interval, total_iters, enabled, run_name)

    def log(self, record: Dict) -> None:
        for sink in self.sinks:
            sink.write(record)
        it = record["iteration"]
        if self._first_iter is None:
            self._first_iter = it - 1
        if self.print_progress and (it % self.log_interval == 0 or it == self.total_iters
                                    or "val_loss" in record):
            self._progress(record)

    def _progress(self, r: Dict) -> None:
        it = r["iteration"]
        done = it - self._first_iter
        elapsed = time.perf_counter() - self._started
        eta = elapsed / max(done, 1) * (self.total_iters - it)
        parts = [f"[{self.run_name}] iter {it:>5}/{self.total_iters}",
                 f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}",
                 f"{r['step_time_s'] * 1000:.0f} ms/it", f"{r['tokens_per_s']:.0f} tok/s",
                 f"wire {r['wire_bytes'] / 1e6:.3f} MB"]
        if "val_loss" in r:
            parts.append(f"val {r['val_loss']:.4f}")
        parts.append(f"ETA {eta:.0f}s")
        print(" | ".join(parts), flush=True, file=sys.stdout)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
