"""The --metrics-file JSONL is an append-only log: a resumed run marks its
segment, a fresh run appends after a run header instead of truncating, a rotation by
copytruncate or rename leaves no NUL bytes and loses nothing, and a full disk drops records with
one WARNING naming the path while training goes on."""

import errno
import json
import os

import pytest

from megatron_grpo.bench import runner
from megatron_grpo.training.metrics import MetricsLogger
from megatron_grpo.training.metrics_log import JsonlLog, MetricsFileError, read_entries, read_logged, read_metrics


def rec(i, loss=1.0):
    return {"iteration": i, "loss": loss}


def lines(path):
    return [json.loads(line) for line in open(path)]


def strip(entries):
    """Headers without their time/host/pid (which vary), records as they are."""
    return [{k: v for k, v in e.items() if k not in ("time", "host", "pid")} for e in entries]


def log_run(path, start, iters, loss=1.0, label="r"):
    log = JsonlLog(str(path), start, label=label)
    for i in iters:
        log.write(rec(i, loss))
    log.close()


def test_a_resumed_segment_is_marked_and_readers_take_its_records(tmp_path):
    # A run killed after logging 26 resumes from checkpoint 20 and logs 21..30 again.
    path = tmp_path / "m.jsonl"
    log_run(path, 0, range(1, 27), loss=1.0)
    log_run(path, 20, range(21, 31), loss=2.0)
    assert strip(lines(path)) == [{"event": "run_start"}, *[rec(i, 1.0) for i in range(1, 27)],
                                  {"event": "resume", "from_iteration": 20},
                                  *[rec(i, 2.0) for i in range(21, 31)]]
    # One record per iteration: the resumed segment's from 21 on (the weights came from it).
    assert read_metrics(str(path)) == [rec(i, 1.0) for i in range(1, 21)] + [rec(i, 2.0) for i in range(21, 31)]
    # As logged (what tests/harness.read_metrics gives): both segments, in file order.
    assert [r["iteration"] for r in read_logged(str(path))] == [*range(1, 27), *range(21, 31)]
    assert runner.read_records(str(path)) == read_metrics(str(path))


def test_a_fresh_run_appends_after_a_run_header_instead_of_truncating(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    log_run(path, 0, range(1, 6), loss=1.0)
    before = path.read_bytes()
    log_run(path, 0, range(1, 4), loss=3.0)
    assert path.read_bytes().startswith(before)  # the earlier run is still there, byte for byte
    assert strip(lines(path))[len(before.splitlines()):] == [{"event": "run_start"},
                                                             *[rec(i, 3.0) for i in range(1, 4)]]
    assert read_metrics(str(path)) == read_logged(str(path)) == [rec(i, 3.0) for i in range(1, 4)]
    assert runner.read_records(str(path)) == [rec(i, 3.0) for i in range(1, 4)]
    assert (f"[r] --metrics-file {path} holds {len(before)} bytes of earlier runs: appending this run "
            f"after a run_start record (readers take the last run's records)") in capsys.readouterr().out


def test_the_logger_writes_run_and_resume_headers(tmp_path):
    path = tmp_path / "m.jsonl"
    for start in (0, 7):
        logger = MetricsLogger.create(True, str(path), None, 1000, 1000, "tiny", start_iteration=start)
        logger.close()
    assert strip(lines(path)) == [{"event": "run_start", "run_name": "tiny", "train_iters": 1000},
                                  {"event": "resume", "from_iteration": 7, "run_name": "tiny", "train_iters": 1000}]


def test_copytruncate_rotation_leaves_no_nul_bytes(tmp_path):
    path = tmp_path / "m.jsonl"
    log = JsonlLog(str(path), 0)
    for i in range(1, 6):
        log.write(rec(i))
    rotated = tmp_path / "m.jsonl.1"
    rotated.write_bytes(path.read_bytes())  # logrotate copytruncate: copy, then truncate in place
    os.truncate(path, 0)
    for i in range(6, 9):
        log.write(rec(i))
    log.close()
    nuls = path.read_bytes().count(b"\0")
    assert nuls == 0, f"{nuls} NUL bytes"
    assert strip(lines(path)) == [{"event": "continued", "reason": "the file was truncated in place "
                                   "(copytruncate rotation)"}, *[rec(i) for i in range(6, 9)]]
    assert read_metrics(str(path)) == [rec(i) for i in range(6, 9)]
    assert read_metrics(str(rotated)) == [rec(i) for i in range(1, 6)]


def test_rename_rotation_reopens_the_path(tmp_path):
    path = tmp_path / "m.jsonl"
    log = JsonlLog(str(path), 0)
    log.write(rec(1))
    os.rename(path, tmp_path / "m.jsonl.1")  # logrotate's default: rename, the writer goes on
    log.write(rec(2))
    log.close()
    assert read_metrics(str(tmp_path / "m.jsonl.1")) == [rec(1)]
    assert strip(lines(path)) == [{"event": "continued", "reason": "the file was renamed or removed "
                                   "(rotation); this run continues in a new one"}, rec(2)]


def test_nul_bytes_and_a_torn_line_left_by_an_older_writer_are_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\0" * 100 + json.dumps(rec(6)).encode() + b"\n" + b'{"iteration": 7, "lo')
    log_run(path, 6, [7])  # the killed run's torn line is ended before the header
    assert path.read_bytes().count(b'{"iteration": 7, "lo\n') == 1
    assert read_metrics(str(path)) == [rec(6), rec(7)]
    assert [e.get("event") for e in read_entries(str(path))] == [None, "resume", None]


class FullDisk:
    """A file object on a disk that fills up: while ``full``, write() raises ENOSPC (after
    writing ``partial`` bytes of the first call, as a real short write does)."""

    def __init__(self, real, partial=0):
        self.real, self.full, self.partial = real, False, partial

    def write(self, data):
        if self.full:
            if self.partial:
                n, self.partial = self.partial, 0
                return self.real.write(data[:n])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("partial", [0, 7])
def test_a_full_disk_drops_records_with_one_warning_and_training_goes_on(tmp_path, capsys, partial):
    path = tmp_path / "m.jsonl"
    log = JsonlLog(str(path), 0, label="tiny")
    disk = log._file = FullDisk(log._file, partial)
    log.write(rec(1))
    disk.full = True
    for i in range(2, 5):
        log.write(rec(i))  # no exception: training continues
    assert log.dropped == 3
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1, err
    assert (f"[tiny] WARNING: --metrics-file {path}: writing failed ([Errno 28] No space left on "
            f"device); training continues without metrics: records are dropped (and counted) until "
            f"a write succeeds again") in err
    disk.full = False
    log.write(rec(5))
    log.close()
    # No torn line from the short write; the gap is recorded where it happened.
    assert strip(lines(path)) == [{"event": "run_start"}, rec(1),
                                  {"event": "dropped", "records": 3, "first_iteration": 2, "last_iteration": 4},
                                  rec(5)]
    assert read_metrics(str(path)) == [rec(1), rec(5)]
    assert (f"[tiny] --metrics-file {path}: writing works again; 3 record(s) were dropped "
            f"(iterations 2..4), noted in the file as a 'dropped' record") in capsys.readouterr().err


def test_a_disk_still_full_at_the_end_says_how_many_records_are_missing(capsys):
    log = JsonlLog("/dev/full", 0, label="tiny")  # every write: ENOSPC, from the kernel
    for i in range(1, 4):
        log.write(rec(i))
    log.close()
    err = capsys.readouterr().err
    assert err.count("writing failed ([Errno 28] No space left on device)") == 1
    assert ("[tiny] WARNING: --metrics-file /dev/full: 3 record(s) could not be written "
            "(iterations 1..3); the file lacks them") in err


def test_a_real_full_tmpfs_then_freed(tmp_path, tmpfs, capsys):
    disk = tmp_path / "disk"
    with tmpfs(disk, "64k"):
        path = disk / "m.jsonl"
        log = JsonlLog(str(path), 0, label="tiny")
        log.write(rec(1))
        filler = disk / "filler"
        with pytest.raises(OSError):
            with open(filler, "wb") as fh:
                fh.write(b"x" * (1 << 20))
        for i in range(2, 300):  # each ~30 bytes: the file's last block fills, then ENOSPC
            log.write(rec(i))
        assert log.dropped > 0 and "No space left on device" in capsys.readouterr().err
        filler.unlink()
        log.write(rec(300))
        log.close()
        got = [r["iteration"] for r in read_metrics(str(path))]
        dropped = [e for e in read_entries(str(path)) if e.get("event") == "dropped"]
        assert len(dropped) == 1 and got[-1] == 300
        first, last = dropped[0]["first_iteration"], dropped[0]["last_iteration"]
        assert got == [*range(1, first), 300] and last == 299 and dropped[0]["records"] == 300 - first


def test_an_unopenable_path_is_refused_naming_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MetricsFileError) as err:
        JsonlLog(str(blocker / "m.jsonl"), 0)
    assert str(err.value).startswith(f"--metrics-file {blocker}/m.jsonl: cannot open it for appending (")
    assert str(err.value).endswith("Point --metrics-file at a file in a writable directory, or drop the flag.")
