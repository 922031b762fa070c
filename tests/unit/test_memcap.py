"""The largest-model search (planner_capacity), the capped benchmark's pieces (cgroup, search,
dd) and launch/plan.py --largest-model. The cgroup tests make a real memory cgroup (root and
cgroup v1 needed, as on this project's machines) and run real processes in it."""

import dataclasses
import os
import subprocess
import sys

import pytest

from harness import load_script

from megatron_grpo.bench import cgroup
from megatron_grpo.bench.memcap import find_largest, parse_dd
from megatron_grpo.bench.runner import BenchError
from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.offload.config import OffloadConfig
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec
from megatron_grpo.planner.capacity import largest_model, model_params, rank_peak_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ModelSpec(num_layers=1, hidden=768, heads=12, vocab=258, seq_length=128, bf16=False)
CLUSTER = ClusterSpec(nodes=1, gpus_per_node=2)
GRPO = GRPOConfig(enabled=True, bucket_mb=16)
SSD = OffloadConfig(target="ssd", offload_dir="x")


def _peak(layers, which, offload=None, reserve=0):
    return rank_peak_bytes(dataclasses.replace(MODEL, num_layers=layers), CLUSTER, GRPO, which,
                           reserve, 4_000_000, offload)


@pytest.mark.parametrize("which,offload", [("baseline", None), ("grpo", None), ("grpo", SSD)])
def test_largest_model_is_the_boundary_of_the_budget(which, offload):
    budget, reserve = int(1.8e9), int(0.5e9)
    cap = largest_model(MODEL, CLUSTER, GRPO, budget, which, reserve_bytes=reserve,
                        bucket_size=4_000_000, offload=offload)
    assert cap.layers > 1
    assert cap.peak_bytes == _peak(cap.layers, which, offload, reserve) <= budget
    assert cap.next_peak_bytes == _peak(cap.layers + 1, which, offload, reserve) > budget
    assert cap.params == model_params(dataclasses.replace(MODEL, num_layers=cap.layers), CLUSTER)


def test_compact_residuals_and_the_memory_tier_fit_more_layers_and_a_reserve_costs_layers():
    kw = dict(reserve_bytes=int(0.5e9), bucket_size=4_000_000)
    base = largest_model(MODEL, CLUSTER, GRPO, int(1.8e9), "baseline", **kw).layers
    grpo = largest_model(MODEL, CLUSTER, dataclasses.replace(GRPO, residual_dtype="fp32"),
                         int(1.8e9), "grpo", **kw).layers
    int8 = largest_model(MODEL, CLUSTER, GRPO, int(1.8e9), "grpo", **kw).layers  # the default
    ssd = largest_model(MODEL, CLUSTER, GRPO, int(1.8e9), "grpo", offload=SSD, **kw).layers
    # fp32 error-feedback residuals (two per unit during backward) cost layers, int8 ones a
    # quarter of that; the tier moves state out.
    assert grpo < int8 < base <= ssd
    more = largest_model(MODEL, CLUSTER, GRPO, int(1.8e9), "baseline", reserve_bytes=int(0.9e9),
                         bucket_size=4_000_000).layers
    assert more < base


def test_nothing_fits_and_pipeline_multiples_and_bad_input():
    assert largest_model(MODEL, CLUSTER, GRPO, int(1e6), "baseline").layers == 0
    pp = ClusterSpec(nodes=1, gpus_per_node=4, pp=2)
    cap = largest_model(dataclasses.replace(MODEL, num_layers=2), pp, GRPO, int(1.5e9), "baseline")
    assert cap.layers % 2 == 0 and cap.layers >= 2
    with pytest.raises(ValueError, match="which must be one of"):
        largest_model(MODEL, CLUSTER, GRPO, int(1e9), "megatron")
    with pytest.raises(ValueError, match="budget_bytes must be positive"):
        largest_model(MODEL, CLUSTER, GRPO, 0, "baseline")


def test_plan_cli_prints_the_largest_model_and_refuses_a_reserve_above_the_memory(capsys):
    cli = load_script("launch/plan.py", "plan_cli")
    flags = ["--config", os.path.join(REPO, "launch", "configs", "mem100m.yaml"), "--nodes", "1",
             "--gpus-per-node", "2", "--gpu-memory-gb", "1.8", "--vocab-size", "258",
             "--attention", "unfused", "--largest-model", "--reserve-gb", "0.5"]
    assert cli.main(flags) == 0
    out = capsys.readouterr().out
    expected = largest_model(dataclasses.replace(MODEL, num_layers=12), CLUSTER,
                             GRPOConfig(enabled=False), int(1.8e9), "baseline",
                             reserve_bytes=int(0.5e9), bucket_size=4_000_000)
    assert f"baseline  {expected.layers:5d} layers" in out
    assert cli.main(flags[:-1] + ["2"]) == 2
    assert "--reserve-gb must be >= 0 and below --gpu-memory-gb" in capsys.readouterr().err


def test_find_largest_walks_to_the_boundary_trying_each_size_once():
    tried = []

    def fits(n):
        tried.append(n)
        return n <= 7

    assert find_largest(fits, 5) == 7 and tried == [5, 6, 7, 8]
    tried.clear()
    assert find_largest(fits, 9) == 7 and tried == [9, 8, 7]
    assert find_largest(lambda n: False, 2) == 0
    with pytest.raises(BenchError, match="no boundary within 3 sizes"):
        find_largest(lambda n: True, 1, max_probes=3)


def test_parse_dd_reads_bytes_and_seconds_and_names_an_unreadable_summary():
    text = ("128+0 records in\n128+0 records out\n"
            "536870912 bytes (537 MB, 512 MiB) copied, 0.291 s, 1.8 GB/s\n")
    assert parse_dd(text) == (536870912, 0.291)
    with pytest.raises(BenchError, match="cannot read dd's summary"):
        parse_dd("dd: failed to open 'x': Permission denied")


needs_cgroup = pytest.mark.skipif(cgroup.unavailable() is not None,
                                  reason=str(cgroup.unavailable()))


@needs_cgroup
def test_a_process_over_the_cap_is_oom_killed_and_one_under_it_is_not():
    touch = "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096])"
    with cgroup.MemoryCgroup(f"grpo-test-{os.getpid()}", 120 << 20) as group:
        ok = subprocess.run(group.command([sys.executable, "-c", touch, "20"]))
        assert ok.returncode == 0 and group.oom_kills() == 0
        assert 20 << 20 <= group.max_usage_bytes() <= 120 << 20
        over = subprocess.run(group.command([sys.executable, "-c", touch, "300"]))
        assert over.returncode == -9 and group.oom_kills() == 1
        assert group.max_usage_bytes() <= 120 << 20
        path = group.path
    assert not os.path.exists(path)  # removed on exit


def test_cgroup_unavailable_names_what_is_missing(tmp_path):
    assert "no cgroup v1 memory controller" in cgroup.unavailable(str(tmp_path))
    with pytest.raises(ValueError, match="limit_bytes must be positive"):
        cgroup.MemoryCgroup("x", 0, root=str(tmp_path))


def test_memcap_suite_tabulates_the_boundaries_and_holds_the_planner_to_them(tmp_path, monkeypatch):
    """The suite with its runs faked: each contender fits up to a fixed size; the table shows the
    measured boundary, the ratio to the baseline's parameters, the planner's layers given the
    measured reserve, the disk note, and the suite refuses a non-OOM failure."""
    from megatron_grpo.bench import __main__ as cli
    from megatron_grpo.bench import memcap
    from megatron_grpo.bench.memcap import Probe

    limits = {"baseline": 13, "megatron-recompute": 15, "grpo": 13, "grpo-fp32-residuals": 9,
              "grpo-ssd": 25, "grpo-ssd-recompute": 27}
    calls = []

    def fake_probe(self, contender, layers):
        calls.append((contender.name, layers))
        ok = layers <= limits[contender.name]
        return Probe(layers, ok, 0 if ok else 1, 0 if ok else -9, int(3.9e9),
                     rank_peak_bytes=int(1.8e9), before_model_bytes=int(0.5e9),
                     offload_gbps={"write": 0.9, "read": 1.2} if contender.name == "grpo-ssd" else {})

    monkeypatch.setattr(memcap.Prober, "__call__", fake_probe)
    monkeypatch.setattr(memcap, "disk_rates", lambda d: {"write": 1.8, "read": 1.5})
    monkeypatch.setattr(cgroup, "unavailable", lambda root=cgroup.ROOT: None)
    args = cli.parser().parse_args(["memcap", "--out", str(tmp_path)], namespace=cli.BenchArgs())
    args.extra = []
    res = memcap.run(args, "python -m megatron_grpo.bench memcap")
    rows = {r[0]: r for r in res.rows}
    assert [rows[n][1] for n in limits] == ["13", "15", "13", "9", "25", "27"]
    for name, layers in limits.items():  # each size tried once; the boundary and one above it
        tried = [n for c, n in calls if c == name]
        assert len(tried) == len(set(tried)) and layers in tried and layers + 1 in tried
    base = memcap._params(args.spec(memcap.DEFAULT_CONFIG, "memcap"),
                          memcap.contenders(str(tmp_path))[0], 13)
    assert rows["baseline"][2] == f"{base / 1e6:.1f}" and rows["baseline"][3] == "1.00x"
    # Calibrated on the baseline's largest run: budget = its peak, reserve = peak - model.
    spec = args.spec(memcap.DEFAULT_CONFIG, "memcap")
    baseline = memcap.contenders(str(tmp_path))[0]
    assert res.data["budget_bytes"] == int(1.8e9)
    assert res.data["reserve_bytes"] == int(1.8e9) - memcap._model_peak(spec, baseline, 13, 0)
    assert rows["baseline"][5] == "13 (calibration)"
    # Each row is also held to megatron's best (here full recompute's 15 layers).
    best = memcap._params(spec, memcap.contenders(str(tmp_path))[1], 15)
    assert rows["megatron-recompute"][4] == "1.00x"
    assert rows["grpo-ssd-recompute"][4] == (
        f"{memcap._params(spec, memcap.contenders(str(tmp_path))[-1], 27) / best:.2f}x")
    assert rows["baseline"][4] == f"{base / best:.2f}x" != "1.00x"
    planned = res.data["contenders"]["grpo-ssd"]["planner"]
    assert planned["peak_bytes"] <= int(1.8e9) < planned["next_peak_bytes"]
    assert rows["grpo-ssd"][5] == str(planned["layers"])
    assert any("write 0.90 GB/s per copy in training vs dd 1.80 GB/s (50 %)" in n for n in res.notes)



@needs_cgroup
def test_prober_runs_the_command_in_the_cap_and_tells_oom_from_a_crash(tmp_path, monkeypatch):
    """The Prober with the training command replaced by small scripts: one that logs every
    iteration fits; one that allocates past the cap is an OOM; one that exits 1 is an error."""
    import json

    from megatron_grpo.bench import memcap
    from megatron_grpo.bench.runner import Contender, Runner, RunSpec

    spec = RunSpec(out=str(tmp_path), config=memcap.DEFAULT_CONFIG, data_path="x", reuse=True)
    runner = Runner("memcap", spec, 0)
    records = [{"iteration": i, "peak_rss_bytes": 1000 + i, "memory_before_model_bytes": 7}
               for i in range(1, memcap.ITERS + 1)]
    scripts = {
        "fits": f"import json; open({str(tmp_path / 'fits-L3.jsonl')!r}, 'w').write("
                f"''.join(json.dumps(r) + chr(10) for r in {records!r}))",
        "oom": "b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096])",
        "crash": "raise SystemExit(1)",
    }
    monkeypatch.setattr(Runner, "command", lambda self, name, c, extra=():
                        [sys.executable, "-c", scripts[c.name], *c.flags, *extra])
    prober = memcap.Prober(runner, 150 << 20, reuse=True)
    fit = prober(Contender("fits", []), 3)
    assert fit.ok and fit.rank_peak_bytes == 1000 + memcap.ITERS and fit.before_model_bytes == 7
    saved = json.loads((tmp_path / "fits-L3.probe.json").read_text())
    assert saved["probe"]["ok"] is True and saved["key"]["cap"] == 150 << 20
    assert prober(Contender("fits", []), 3) == fit  # reused, not rerun
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "grpo-offload-rank00000.bin").write_bytes(b"x")  # what a killed rank leaves
    oom = prober(Contender("oom", ["--grpo-offload-dir", str(offload)]), 3)
    assert not oom.ok and oom.oom_kills == 1
    assert list(offload.iterdir()) == []
    with pytest.raises(BenchError, match="oom-L3|crash-L3 failed .exit 1. without an OOM kill"):
        prober(Contender("crash", []), 3)
