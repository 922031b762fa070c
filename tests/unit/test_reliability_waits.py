"""The reliability suite waits on events, not on wall-clock budgets: a job
that keeps writing is waited for however long load makes it; one that writes nothing for the
stall limit is a hang, killed and reported with its output."""

import os
import subprocess
import sys
import time
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))

from reliability_harness import JOB_ENV, Running, job_processes  # noqa: E402


def _start(tmp_path, code):
    job_id = uuid.uuid4().hex
    files = (open(tmp_path / "job0.out", "w"), open(tmp_path / "job0.err", "w"))
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, **{JOB_ENV: job_id}),
                            stdout=files[0], stderr=files[1], start_new_session=True)
    return Running(proc, str(tmp_path), job_id, time.monotonic(), files)


def test_a_slow_job_that_keeps_writing_is_waited_for_past_the_stall_limit(tmp_path):
    # 8 lines 0.4 s apart: 3.2 s in all, more than twice the 1.5 s stall limit.
    running = _start(tmp_path, "import time\nfor i in range(8):\n    print(i, flush=True); time.sleep(0.4)")
    t0 = time.monotonic()
    running.wait_progressing(lambda: running.proc.poll() is not None, "the job's end", stall_s=1.5)
    job = running.finish(timeout=0)
    assert job.rc == 0 and job.out.split() == [str(i) for i in range(8)]
    assert time.monotonic() - t0 > 3.0


def test_an_event_written_to_a_watched_file_ends_the_wait(tmp_path):
    marker = tmp_path / "probe" / "fault.json"
    running = _start(tmp_path, f"import os, time\nos.makedirs({str(marker.parent)!r})\ntime.sleep(1)\n"
                               f"open({str(marker)!r}, 'w').write('{{}}')\ntime.sleep(30)")
    running.wait_progressing(marker.exists, "its fault", stall_s=10)
    assert running.proc.poll() is None  # the job is still running: the event, not its end
    job = running.finish(timeout=0)
    assert job.rc is None and job.leftovers


def test_a_silent_job_is_a_hang_killed_after_the_stall_limit(tmp_path):
    running = _start(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:
        running.wait_progressing(lambda: False, "its fault", stall_s=1.5)
    assert 1.5 < time.monotonic() - t0 < 10
    said = str(err.value)
    assert said.startswith("gave up waiting for its fault (nothing written for 2 s; ") and "started" in said, said
    assert running.proc.wait(timeout=10) == -9 and job_processes(running.job_id) == []  # SIGKILLed


def test_a_job_that_ends_before_its_event_is_reported(tmp_path):
    running = _start(tmp_path, "import sys\nprint('bye', flush=True)\nsys.exit(3)")
    with pytest.raises(AssertionError, match=r"^job ended \(rc 3\) before its fault:\nbye"):
        running.wait_progressing(lambda: False, "its fault")
    running.finish(timeout=0)
