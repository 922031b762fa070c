"""launch/gpu_check.sh + launch/gpu_check.py, checked on a CPU machine: what can be checked
without a GPU (syntax, the list of checks, the "no CUDA device" exit, the assertion logic on
synthetic metrics and on CPU tensors, timeouts). The GPU itself is exercised only on a device
machine (bash launch/gpu_check.sh)."""

import argparse
import importlib.util
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT_SH = os.path.join(REPO, "launch", "gpu_check.sh")
SCRIPT_PY = os.path.join(REPO, "launch", "gpu_check.py")

EXPECTED = {  # the checks 1-6, split where one check asserts several things
    "cpu_mode_noop", "compress_cuda", "error_feedback_cuda", "importance_cuda",
    "interval_timer_cuda", "bench_compress", "side_stream_overlap", "grpo_run_timing",
    "bf16_baseline_vs_grpo", "te_spec", "pinned_offload", "runtime_budget",
}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


def _load():
    spec = importlib.util.spec_from_file_location("launch_gpu_check", SCRIPT_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


gc = _load()


def _env(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               GPU_CHECK_NO_WHEELS="1", PYTHONWARNINGS="ignore")
    env.pop("MEGATRON_GRPO_FORCE_CPU", None)
    return env


def test_shell_script_syntax():
    proc = subprocess.run(["bash", "-n", SCRIPT_SH], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("argv", [[sys.executable, SCRIPT_PY, "--list"], ["bash", SCRIPT_SH, "--list"]])
def test_list_names_every_check(argv, tmp_path):
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert names == [c.name for c in gc.CHECKS]
    assert set(names) == EXPECTED


def test_every_check_has_its_function():
    for check in gc.CHECKS:
        table = gc.WORKERS if check.kind == "worker" else gc.HOST
        assert callable(table.get(check.name)), check.name
        assert check.cap_s > 0
    assert callable(gc.WORKERS["pinned_offload"])  # the worker part host_pinned_offload starts


@no_cuda
@pytest.mark.parametrize("how", ["python", "shell"])
def test_no_cuda_device_exits_2_with_a_message(how, tmp_path):
    env = _env(tmp_path)
    argv = [sys.executable, SCRIPT_PY, "--out", env["OUT"]] if how == "python" else ["bash", SCRIPT_SH]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == gc.EXIT_NOTHING_CHECKED == 2, out
    assert "no CUDA device" in out and "Traceback" not in out
    with open(os.path.join(env["OUT"], "summary.txt")) as fh:
        assert "no CUDA device" in fh.read()


def test_skip_is_never_a_pass_and_no_assertion_is_a_fail():
    ex = gc.Expect(echo=False)
    assert ex.status() == "FAIL"  # nothing asserted
    ex = gc.Expect(echo=False)
    ex.that(True, "a")
    ex.that(False, "b")
    assert ex.status() == "FAIL" and ex.failures == ["b"]
    with pytest.raises(gc.CheckSkipped):
        ex.skip("reason")


def _ctx(tmp_path, budget_s=60.0):
    return gc.Context(argparse.Namespace(out=str(tmp_path), data_dir=str(tmp_path / "data"),
                                         started_at=None, budget_s=budget_s))


def test_offload_skips_with_the_reason_until_the_memory_tier_exists(tmp_path):
    if os.path.isdir(os.path.join(REPO, "megatron_grpo", "offload")):
        pytest.skip("megatron_grpo/offload exists: the check runs on the device machine")
    res = gc.run_host(_ctx(tmp_path), gc.CHECK_BY_NAME["pinned_offload"])
    assert res.status == "SKIP" and "memory tier not built yet (issue 10)" in res.summary


def test_command_timeout_is_capped_by_the_budget_and_kills_the_group(tmp_path):
    ctx = _ctx(tmp_path, budget_s=4.0)  # 1 s left for the command after the 3 s reserve
    t0 = time.time()
    cmd = ctx.command("sleeper", ["bash", "-c", "sleep 30 & sleep 30"], cap_s=100)
    assert cmd.timed_out and cmd.rc is None and time.time() - t0 < 20
    assert cmd.limit_s <= 2.0


def test_a_check_that_cannot_start_in_the_budget_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc, "cuda_status", lambda: (True, "pretend CUDA"))
    rc = gc.main(["--out", str(tmp_path), "--only", "compress_cuda", "--budget-s", "5"])
    out = capsys.readouterr().out
    assert rc == gc.EXIT_FAIL
    assert re.search(r"^2a\s+compress_cuda\s+FAIL\s.*budget", out, re.M), out
    assert "runtime_budget" in out and os.path.isfile(tmp_path / "results.json")


# --------------------------------------------------------------- the assertions on metrics
def _records(n=20, timing="cuda_events", interval=2, ru=0.98, grpo=True, loss0=6.0, drop=0.1,
             tier_map="ccdsdd"):
    recs = []
    for i in range(1, n + 1):
        r = {"iteration": i, "loss": loss0 - drop * i, "step_time_s": 0.05, "skipped": False,
             "peak_device_bytes": 1 << 30}
        if grpo:
            r.update(grpo_timing=timing, grpo_ru=ru, grpo_wait_time_s=0.001,
                     grpo_importance_time_s=0.002 if i % interval == 0 else 0.0,
                     grpo_tier_map=tier_map)
        recs.append(r)
    recs[-1]["val_loss"] = recs[-1]["loss"]
    return recs


def _run(name, records, grpo=True, interval=2, platform="nccl/cuda:0"):
    args = ["--train-iters", str(len(records))]
    if grpo:
        args += ["--grpo", "--grpo-importance-interval", str(interval)]
    run = gc.Run(name, args, grpo, 10)
    run.cmd = gc.Command(0, False, 1.0, "/dev/null", 10)
    run.records, run.platform, run.spec = records, platform, "local"
    return run


def test_grpo_timing_passes_a_good_run_and_fails_each_defect():
    ex = gc.Expect(echo=False)
    gc.analyze_grpo_timing(ex, _run("g", _records()))
    assert ex.status() == "PASS", ex.failures
    defects = {
        "grpo_timing": _run("g", _records(timing="host")),
        "importance_time_s > 0": _run("g", [dict(r, grpo_importance_time_s=0.0) for r in _records()]),
        "== 0 on the": _run("g", [dict(r, grpo_importance_time_s=0.002) for r in _records()]),
        "grpo_ru": _run("g", _records(ru=1.5)),
        "platform": _run("g", _records(), platform="gloo/cpu"),
    }
    for what, run in defects.items():
        ex = gc.Expect(echo=False)
        gc.analyze_grpo_timing(ex, run)
        assert ex.status() == "FAIL" and any(what in f for f in ex.failures), (what, ex.failures)


def test_baseline_vs_grpo_passes_a_good_pair_and_fails_each_defect():
    base = _run("b", _records(grpo=False), grpo=False)
    ex = gc.Expect(echo=False)
    gc.analyze_pair(ex, "tiny", base, _run("g", _records()))
    assert ex.status() == "PASS", ex.failures
    assert math.isclose(ex.numbers["tiny_step_ratio"], 1.0)
    bad_loss = _records()
    bad_loss[3]["loss"] = float("nan")
    defects = {
        "finite": _run("g", bad_loss),
        "loss decreases": _run("g", _records(drop=-0.1)),
        "tier map": _run("g", _records(tier_map="cccddd")),
        "peak_device_bytes": _run("g", [{k: v for k, v in r.items() if k != "peak_device_bytes"}
                                        for r in _records()]),
    }
    for what, run in defects.items():
        ex = gc.Expect(echo=False)
        gc.analyze_pair(ex, "tiny", base, run)
        assert ex.status() == "FAIL" and any(what in f for f in ex.failures), (what, ex.failures)


def test_unfinished_run_fails(tmp_path):
    ctx = _ctx(tmp_path)
    ex = gc.Expect(echo=False)
    run = _run("g", _records()[:7])  # 7 of 20 iterations: killed or crashed
    run.args[1] = "20"
    assert not ctx.expect_run(ex, run) and ex.status() == "FAIL"
    ex = gc.Expect(echo=False)
    assert not ctx.expect_run(ex, gc.Run("never", ["--train-iters", "5"], True, 10))
    assert "budget" in ex.failures[0]


BENCH_DP = """
| bucket | comp | old t(dp=512) / t(dp=8) | batched t(dp=512) / t(dp=8) | goal batched <= 1.5 |
|---:|---|---:|---:|---|
| 40,000 | int4 | 12.71 | 0.14 | met |
| 40,000 | int8 | 1.35 | 2.58 | missed |
| 40,000 | topk | 4.63 | 1.12 | met |
"""
BENCH_BUCKET = """torch 2.13.0, NVIDIA H200, threads 2, numel 33554432 (128 MiB fp32), chunk 256
name      ratio  payload MiB  rel err  compress ms  decompress ms   sum ms  EF step ms
int4     7.7574        0.049   0.1266          0.4            0.1      0.5         0.4
int8     3.9384        0.097   0.0070          0.2            0.0      0.2         0.2
topk    10.0000        0.038   0.8487          6.2            4.8     11.0        19.9
"""


def test_bench_output_parsers():
    assert gc.parse_bench_goal(BENCH_DP) == [(40000, "int4", 12.71, 0.14), (40000, "int8", 1.35, 2.58),
                                             (40000, "topk", 4.63, 1.12)]
    rows = gc.parse_bench_bucket(BENCH_BUCKET)
    assert set(rows) == {"int4", "int8", "topk"} and rows["int8"]["rel_err"] == 0.007


# --------------------------------------------------------------- tensor checks, CPU vs CPU
def test_tensor_checks_run_on_cpu_against_themselves():
    """The CUDA checks' logic, with the device set to the CPU (a trivially equal comparison):
    catches a check that crashes or asserts nothing before it reaches a device machine."""
    for name, kwargs in (("compress_cuda", {"shapes": [(1, 1), (1, 1000), (3, 777), (64, 300)]}),
                         ("error_feedback_cuda", {}), ("importance_cuda", {})):
        ex = gc.Expect(echo=False)
        gc.WORKERS[name](ex, "cpu", **kwargs)
        assert ex.status() == "PASS", (name, ex.failures)
    for name in ("interval_timer_cuda", "side_stream_overlap"):
        with pytest.raises(gc.CheckSkipped):
            gc.WORKERS[name](gc.Expect(echo=False), "cpu")
