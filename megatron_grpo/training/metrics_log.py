"""The --metrics-file JSONL as an append-only log: the writer and the readers.

One JSON object per line. Records with an ``iteration`` key are the per-iteration metrics;
records with an ``event`` key are headers the writer adds:

  {"event": "run_start", ...}              a run that starts at iteration 0. An existing file
                                           is appended to, never truncated: readers take the
                                           records after the last run_start.
  {"event": "resume", "from_iteration": N} a run resumed from checkpoint N. A killed run may
                                           have logged iterations after N already; the resumed
                                           run logs them again, after this header, and readers
                                           that want one record per iteration take the newer.
  {"event": "continued", "reason": ...}    the file was rotated (renamed away, removed, or
                                           truncated in place) and this run writes on in it.
  {"event": "dropped", "records": n, "first_iteration": a, "last_iteration": b}
                                           n records could not be written (disk full, ...);
                                           written once writing works again.

Why append-only: the file is the record of every job that wrote it (requeued SLURM jobs write
one file), and an external tool (logrotate copytruncate, tail -f) must be able to share it.
The file is opened O_APPEND, so a write after an external truncation lands at the new end (no
hole of NUL bytes), and it is reopened when the path names another file (rename rotation).

A failed write never stops training: the first failure prints one WARNING naming the path and
the error, records are dropped and counted until a write succeeds again, then a ``dropped``
header says how many. Opening the file at start is different: a path that cannot be opened is
a configuration error (MetricsFileError), before the first iteration.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Dict, List, Optional

RUN_START, RESUME, CONTINUED, DROPPED = "run_start", "resume", "continued", "dropped"


class MetricsFileError(ValueError):
    """--metrics-file cannot be opened for appending (the entry prints it as a one-line error)."""


class JsonlLog:
    """Appends one JSON line per record to ``path`` (flushed to the OS per record, so a killed
    run keeps what it logged). ``start_iteration``: 0 writes a run_start header, N > 0 a resume
    header naming N. ``label`` prefixes the warnings (the run name); ``flag`` is the flag its
    messages name (the Megatron-LM runner's is --grpo-metrics-file)."""

    def __init__(self, path: str, start_iteration: int, label: str = "run",
                 header: Optional[Dict] = None, flag: str = "--metrics-file") -> None:
        self.path, self.label, self.flag = path, label, flag
        self.dropped, self._dropped_iters = 0, []
        self._warned = False
        self._pending: List[Dict] = []  # headers still to write (a failed write keeps them)
        self._file = None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._open()
        except OSError as exc:
            raise MetricsFileError(f"{flag} {path}: cannot open it for appending ({exc}). "
                                   f"Point {flag} at a file in a writable directory, or drop "
                                   f"the flag.") from None
        # A killed writer can leave a torn last line: end it, so our first line stays whole.
        self._newline = self._size > 0 and self._last_byte() != b"\n"
        base = dict(header or {}, time=round(time.time(), 3), host=socket.gethostname(),
                    pid=os.getpid())
        if start_iteration > 0:
            self._pending.append(dict(base, event=RESUME, from_iteration=int(start_iteration)))
        else:
            self._pending.append(dict(base, event=RUN_START))
            if self._size > 0:
                print(f"[{label}] {flag} {path} holds {self._size} bytes of earlier runs: "
                      f"appending this run after a run_start record (readers take the last run's "
                      f"records)", flush=True)
        self._flush_pending()

    # -- file handling -----------------------------------------------------------------------
    def _open(self) -> None:
        # O_APPEND (mode "a"): every write goes to the file's current end, whoever truncated it.
        self._file = open(self.path, "ab", buffering=0)
        st = os.fstat(self._file.fileno())
        self._ident, self._size = (st.st_dev, st.st_ino), st.st_size

    def _last_byte(self) -> bytes:
        with open(self.path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1)

    def _check_rotation(self) -> None:
        """Reopen when ``path`` is no longer our file (renamed or removed by a rotation); note a
        truncation in place (copytruncate), which O_APPEND already survives."""
        try:
            st = os.stat(self.path)
            moved = (st.st_dev, st.st_ino) != self._ident
        except FileNotFoundError:
            moved = True
        if moved:
            self._file.close()
            self._open()
            self._pending.insert(0, {"event": CONTINUED, "reason": "the file was renamed or removed "
                                     "(rotation); this run continues in a new one", "time": round(time.time(), 3)})
        elif st.st_size < self._size:
            self._size = st.st_size
            self._pending.insert(0, {"event": CONTINUED, "reason": "the file was truncated in place "
                                     "(copytruncate rotation)", "time": round(time.time(), 3)})

    def _append(self, record: Dict) -> None:
        data = (json.dumps(record, sort_keys=True) + "\n").encode()
        if self._newline:
            data = b"\n" + data
        start, done = self._size, 0
        try:
            while done < len(data):  # a short write (a disk filling up) is continued or fails
                done += self._file.write(data[done:])
        except OSError:
            if done:  # take back the torn part; if even that fails, the next line starts anew
                try:
                    os.ftruncate(self._file.fileno(), start)
                except OSError:
                    self._newline = True
            raise
        self._newline = False
        self._size = start + len(data)

    def _flush_pending(self) -> bool:
        try:
            self._check_rotation()
            while self._pending:
                self._append(self._pending[0])
                self._pending.pop(0)
            if self.dropped:
                dropped = {"event": DROPPED, "records": self.dropped, "first_iteration": self._dropped_iters[0],
                           "last_iteration": self._dropped_iters[-1], "time": round(time.time(), 3)}
                self._append(dropped)
                print(f"[{self.label}] {self.flag} {self.path}: writing works again; {self.dropped} "
                      f"record(s) were dropped (iterations {self._dropped_iters[0]}..{self._dropped_iters[-1]}), "
                      f"noted in the file as a 'dropped' record", file=sys.stderr, flush=True)
                self.dropped, self._dropped_iters, self._warned = 0, [], False
            return True
        except OSError as exc:
            self._failed(exc)
            return False

    def _failed(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            print(f"[{self.label}] WARNING: {self.flag} {self.path}: writing failed ({exc}); "
                  f"training continues without metrics: records are dropped (and counted) until a "
                  f"write succeeds again", file=sys.stderr, flush=True)

    # -- the sink ----------------------------------------------------------------------------
    def write(self, record: Dict) -> None:
        if self._flush_pending():
            try:
                self._append(record)
                return
            except OSError as exc:
                self._failed(exc)
        self.dropped += 1
        self._dropped_iters.append(record.get("iteration"))

    def close(self) -> None:
        if self.dropped or self._pending:
            self._flush_pending()
        if self.dropped:
            print(f"[{self.label}] WARNING: {self.flag} {self.path}: {self.dropped} record(s) could "
                  f"not be written (iterations {self._dropped_iters[0]}..{self._dropped_iters[-1]}); "
                  f"the file lacks them", file=sys.stderr, flush=True)
        if self._file is not None:
            self._file.close()
            self._file = None


# -- readers -----------------------------------------------------------------------------------

def read_entries(path: str) -> List[Dict]:
    """Every record and header of the file's last run (from its last run_start on), in file
    order. Lines that do not parse (a torn last line of a killed run; NUL bytes an older writer
    left after a truncation, stripped first) are skipped."""
    entries: List[Dict] = []
    with open(path, "rb") as fh:
        for raw in fh:
            line = raw.decode("utf-8", errors="replace").strip("\x00 \t\r\n")
            if not line:
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(entry, dict):
                continue
            if entry.get("event") == RUN_START:
                entries = []
            entries.append(entry)
    return entries


def read_logged(path: str) -> List[Dict]:
    """The last run's per-iteration records in the order they were logged: a resumed segment
    repeats the iterations its killed predecessor logged after the checkpoint."""
    return [e for e in read_entries(path) if "iteration" in e and "event" not in e]


def read_metrics(path: str) -> List[Dict]:
    """One record per iteration, in iteration order, of the file's last run: a resumed
    segment's records replace those its predecessor logged after the checkpoint it resumed
    from (the newer are the ones the final weights came from)."""
    records: List[Dict] = []
    for entry in read_entries(path):
        if entry.get("event") == RESUME:
            n = int(entry.get("from_iteration", 0))
            records = [r for r in records if r["iteration"] <= n]
        elif "iteration" in entry and "event" not in entry:
            records.append(entry)
    return records
