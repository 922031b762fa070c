"""The codec check (tools/gpu_checks/codec.py, ``bash tools/gpu_check.sh --codec``) on a CPU
machine: its dry run end to end, so the script a device session runs cannot rot between loans,
and its assertions held to failing.

The dry run (``--codec --cpu``: an 8 Ki-element bucket, the small model, 6 iterations, the three
training runs side by side) takes about 25 s on 2 idle cores, 40 s on a loaded machine: it starts
six processes (versions probe, corpus, codec worker, three runs), most of it their imports. On the
CPU its fused path is the eager codec; the worker's real fused path runs here too, on CPU tensors
under Triton's interpreter (``codec_bench.py --interpret``, ~10 s), through the device's analysis.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT_SH = os.path.join(REPO, "tools", "gpu_check.sh")
TOOLS = os.path.join(REPO, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

from gpu_checks import codec, common  # noqa: E402

RUN_FIELDS = {"ok", "describe", "platform", "median_step_ms", "steady_iterations", "wire_bytes",
              "peak_device_mib", "vs_baseline"}
GRPO_FIELDS = RUN_FIELDS | {"compress", "compressed_formats", "compression_line", "importance_ms"}
PATH_FIELDS = {"path", "encode_ms", "decode_sum_ms", "bucket_ms", "bucket_gbps", "encode_traffic_gbps",
               "decode_traffic_gbps", "traffic_bytes", "traffic_gbps", "of_copy", "encode_of_copy",
               "decode_sum_of_copy", "host_us", "triton_launches", "aten_ops", "aten_op_names",
               "cuda_kernels", "cuda_memops", "profiler_note"}
EQUAL_FIELDS = {"payload_step0", "residual_step0", "sum_step0", "payload_step1", "residual_step1",
                "sum_step1", "delta_payload", "delta_decoded_bf16"}


def _env(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    env.pop("MEGATRON_GRPO_FORCE_CPU", None)
    env.pop("MEGATRON_GRPO_FUSED_CODEC", None)
    return env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("codec_check")
    env = _env(tmp)
    proc = subprocess.run(["bash", SCRIPT_SH, "--codec", "--cpu", "--work", str(tmp / "work"),
                           "--data-dir", str(tmp / "data")], capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(tmp))
    with open(os.path.join(env["OUT"], "codec.json")) as fh:
        doc = json.load(fh)
    return proc, doc, sorted(os.listdir(env["OUT"]))


def test_cpu_dry_run_passes_end_to_end_with_every_field(dry_run):
    proc, doc, files = dry_run
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert files == ["codec.json", "codec.log", "codec.txt"]  # the device machine returns at most 8
    assert doc["status"] == "PASS" and doc["complete"] is True
    assert [p["phase"] for p in doc["parts"]] == doc["parts_asked"] == list(codec.PARTS)
    assert all(p["status"] == "PASS" for p in doc["parts"]), doc["parts"]
    assert doc["cpu"] is True and doc["fused_path"].startswith("eager codec")
    assert doc["versions"]["megatron_core"] and doc["versions"]["torch"] == torch.__version__
    # the codec: both formats, both paths, every figure; the fused path said to be the eager one
    c = doc["codec"]
    assert (c["numel"], c["dp"], c["chunk"], c["errors"]) == (8192, 8, 256, {})
    assert set(c["copy"]) == {"bytes", "ms", "gbps", "traffic_gbps"}
    for fmt in codec.FORMATS:
        got = c["formats"][fmt]
        assert got["fused_speedup"] > 0 and got["payload_bytes"] > 0
        for path in ("eager", "fused"):
            assert set(got[path]) == PATH_FIELDS, path
            assert got[path]["cuda_kernels"] is None and got[path]["triton_launches"] == 0
            assert got[path]["aten_ops"] > 10  # the eager codec: tens of ops a bucket
        assert got["fused"]["path"] == "eager: fused_codec chose the eager codec for cpu tensors"
        # byte equality was checked, every comparison of both steps
        assert c["equal"][fmt] == dict.fromkeys(EQUAL_FIELDS, True)
    # the steps: three runs, figures for each, the probe not run and why
    runs = doc["steps"]["runs"]
    assert set(runs) == {"codec_base", "codec_grpo_none", "codec_grpo_all"}
    assert set(runs["codec_base"]) == RUN_FIELDS
    for name in ("codec_grpo_none", "codec_grpo_all"):
        assert set(runs[name]) == GRPO_FIELDS and runs[name]["wire_bytes"] == 0
    assert runs["codec_grpo_all"]["compressed_formats"] == ["int4", "int8"]
    assert runs["codec_grpo_none"]["compressed_formats"] == []
    assert doc["probe"]["ran"] is False and "dp 1" in doc["probe"]["why"]
    assert "nothing is communicated" in doc["steps"]["note"]
    for needle in ("fused = eager on cpu, byte for byte", "the fused path is the eager codec here",
                   "fused = eager (CPU)", "no probe ran", "link decision probe: not run"):
        assert needle in out, needle


def test_a_byte_mismatch_or_a_missing_launch_fails_the_codec_part(dry_run):
    _, doc, _ = dry_run
    res = doc["codec"]
    ok = common.Expect(echo=False)
    codec.analyze_codec(ok, res, cpu=True)
    assert ok.status() == "PASS", ok.failures
    bad = copy.deepcopy(res)
    bad["equal"]["int4"]["residual_step1"] = False
    ex = common.Expect(echo=False)
    codec.analyze_codec(ex, bad, cpu=True)
    assert ex.status() == "FAIL" and "int4: fused = eager" in ex.failures[0] and "residual_step1" in ex.failures[0]
    # On a device the fused path must have launched its two kernels a bucket (here it launched none).
    ex = common.Expect(echo=False)
    codec.analyze_codec(ex, res, cpu=False)
    assert ex.status() == "FAIL" and any("0 Triton launches per bucket" in f for f in ex.failures)
    crashed = copy.deepcopy(res)
    crashed["errors"]["int8"] = "RuntimeError: CUDA error"
    ex = common.Expect(echo=False)
    codec.analyze_codec(ex, crashed, cpu=True)
    assert ex.status() == "FAIL" and "int8: the measurement crashed" in ex.failures[0]


def test_fused_path_under_the_interpreter_passes_the_device_analysis(tmp_path):
    """The worker's fused path for real, without a GPU: CPU tensors through the Triton kernels
    under the interpreter (``--interpret``). The device's analysis must pass it: two launches a
    bucket, fused = eager byte for byte, every figure measured."""
    result = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("MEGATRON_GRPO_FUSED_CODEC", None)
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, "gpu_checks", "codec_bench.py"), "--device", "cpu",
                           "--interpret", "--numel", "2048", "--dp", "2", "--repeats", "1", "--result", str(result)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(result.read_text())
    assert res["interpreted"] and res["fused_on_this_device"]
    for fmt in codec.FORMATS:
        assert res["formats"][fmt]["fused"]["path"] == "fused: Triton kernels (interpreted)"
    res["_run"] = {"rc": 0, "elapsed_s": 1.0, "limit_s": 120.0}
    ex = common.Expect(echo=False)
    codec.analyze_codec(ex, res, cpu=False)
    assert ex.status() == "PASS", ex.failures
    assert any("int4 fused: 2 Triton launches per bucket" in line for line in ex.lines)


def test_help_and_no_cuda_device(tmp_path):
    env = _env(tmp_path)
    helped = subprocess.run(["bash", SCRIPT_SH, "--codec", "--help"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert helped.returncode == 0 and "--grpo-compress none" in helped.stdout, helped.stderr[-2000:]
    if torch.cuda.is_available():
        return
    proc = subprocess.run(["bash", SCRIPT_SH, "--codec"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(tmp_path))
    assert proc.returncode == common.EXIT_NOTHING_CHECKED, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr and "--codec --cpu" in proc.stderr
    with open(os.path.join(env["OUT"], "codec.txt")) as fh:
        assert "no CUDA device" in fh.read()
