"""python -m megatron_grpo.bench end to end on a few iterations: real runs side by side, the
JSON and plots it writes, reuse of complete runs, and a failing run named in the error."""

import json
import subprocess
import sys

from harness import REPO, SMALL_MODEL, env

FAST = ["--train-iters", "6", "--seeds", "3", "--", *SMALL_MODEL, "--grpo-bucket-mb", "0.02",
        "--grpo-warmup-iters", "2", "--grpo-retier-interval", "2", "--grpo-stable-interval", "2",
        "--grpo-gvr-interval", "1", "--eval-interval", "3", "--eval-iters", "1"]


def _bench(tmp_path, *argv, data):
    cmd = [sys.executable, "-m", "megatron_grpo.bench", *argv[:1], "--out", str(tmp_path / "out"),
           "--data-path", data, *argv[1:]]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)


def test_quality_suite_runs_side_by_side_writes_json_and_plots_and_reuses(tmp_path, stdlib_data):
    proc = _bench(tmp_path, "quality", *FAST, data=stdlib_data)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out" / "quality"
    res = json.loads((out / "quality.json").read_text())
    assert res["suite"] == "quality" and len(res["rows"]) == 1 and res["rows"][0][0] == 3
    d = res["data"]["seed3"]
    assert d["baseline"]["iterations"] == 6 == d["grpo"]["iterations"]
    # GRPO tiered after its 2-step warm-up: fewer bytes than the baseline over the same window.
    assert 0 < d["compare"]["steady_wire_ratio"] < 0.9, d["compare"]
    assert [i for i, _ in d["compare"]["val_diff_curve"]] == [3, 6]
    for png in ("loss_s3.png", "val_diff.png", "wire.png", "tier_map.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    assert "[bench quality] run 1/2: baseline-s3" in proc.stdout and "ETA" in proc.stdout
    again = _bench(tmp_path, "quality", *FAST, data=stdlib_data)
    assert again.returncode == 0 and again.stdout.count("reusing the complete run") == 2, again.stdout[-2000:]


def test_a_failing_run_is_named_and_nothing_is_reused(tmp_path, stdlib_data):
    proc = _bench(tmp_path, "comm", *FAST, "--hidden-size", "-5", data=stdlib_data)
    assert proc.returncode == 1
    assert "run 'baseline-s3' failed with exit code" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out" / "comm" / "baseline-s3.cmd.json").exists()
