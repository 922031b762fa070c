"""launch/plan.py --largest-model --search: megatron's and GRPO's best settings on one node."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from harness import load_script

from megatron_grpo.grpo.config import GRPOConfig
from megatron_grpo.offload.config import OffloadConfig
from megatron_grpo.planner.activations import layer_activation_bytes, stage_activation_bytes
from megatron_grpo.planner.plan import ClusterSpec, ModelSpec, plan, stage_param_numels
from megatron_grpo.planner.search_format import format_search
from megatron_grpo.planner.search import (Node, Setting, fits, largest, search, settings, step_time,
                                          usage)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A small Llama-style shape whose searches take well under a second per setting.
MODEL = ModelSpec(num_layers=4, hidden=1024, heads=16, num_query_groups=4, ffn_hidden=2816,
                  vocab=32000, seq_length=2048, micro_batch_size=1, flash_attention=True,
                  swiglu=True, rmsnorm=True, rope=True, bias_linear=False, global_batch_size=16)
NODE = Node(gpus=4, gpu_memory_gb=4.0, host_memory_gb=40.0, host_reserve_gb=4.0, nvme_gb=200.0)
GRPO = GRPOConfig(enabled=True, bucket_mb=16)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallel_splits_korthikantis_replicated_terms_over_tp(tp):
    # Korthikanti eq. 2 -> eq. 4: the 10 sbh replicated bytes (two norm inputs, QKV's and fc1's
    # inputs, two dropout masks) and the norms' fp32 stats are divided by t.
    m = ModelSpec(num_layers=1, hidden=1024, heads=16, seq_length=2048, micro_batch_size=2,
                  bf16=True, dropout=True, softmax_in_fp32=False)
    s, b, h = 2048, 2, 1024
    sp = dataclasses.replace(m, sequence_parallel=True)
    replicated = 10 * s * b * h + 16 * s * b
    assert layer_activation_bytes(m, tp) - layer_activation_bytes(sp, tp) == \
        pytest.approx(replicated * (1 - 1 / tp), abs=8)
    # Full recompute keeps each layer's input: split over TP with sequence parallelism.
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    cluster = ClusterSpec(nodes=1, gpus_per_node=8, tp=tp)
    kept = [stage_activation_bytes(dataclasses.replace(x, num_layers=4, **full), cluster, 0)
            for x in (m, sp)]
    # Four chunks' inputs (2-byte activations) and the recomputed layer's replicated terms, at least.
    assert kept[0] - kept[1] >= 4 * s * b * h * 2 * (1 - 1 / tp) + replicated * (1 - 1 / tp) - 8


def test_distributed_optimizer_usage_is_the_planners_baseline_and_bf16_grads_halve_the_buffer():
    s = Setting(2, 1, False, None, "distributed-optimizer", 4)
    cluster = ClusterSpec(nodes=1, gpus_per_node=4, gpu_memory_gb=4.0, tp=2)
    assert usage(MODEL, NODE, s, GRPO).gpu == plan(MODEL, cluster, GRPO).baseline_peak
    half = usage(MODEL, NODE, dataclasses.replace(s, grad_bytes=2), GRPO).gpu
    grads = plan(MODEL, cluster, GRPO).baseline_memory.grads
    assert usage(MODEL, NODE, s, GRPO).gpu - half == grads // 2


def test_cpu_offload_takes_the_smallest_fraction_that_fits_and_bills_the_host():
    s = Setting(1, 1, False, "full", "cpu-offload", 4)
    big = dataclasses.replace(MODEL, num_layers=40, recompute_granularity="full",
                              recompute_method="uniform", recompute_num_layers=1)
    u = usage(big, NODE, s)
    opt = usage(big, NODE, dataclasses.replace(s, option="distributed-optimizer"))
    assert 0 < u.offload_fraction <= 1 and round(u.offload_fraction * 20) == u.offload_fraction * 20
    assert u.gpu <= NODE.gpu_memory_gb * 1e9 < opt.gpu  # the whole state on the GPU does not fit
    # One step of 0.05 less would not fit: the fraction is the smallest.
    saved = opt.gpu - u.gpu  # = fraction x the optimizer state
    state = saved / u.offload_fraction
    assert opt.gpu - (u.offload_fraction - 0.05) * state > NODE.gpu_memory_gb * 1e9
    # Host: that share of masters, moments and an fp32 gradient copy (16 B per element) on
    # every rank.
    assert u.host == pytest.approx(u.offload_fraction * state / 12 * 16 * NODE.gpus, rel=1e-6)
    small = usage(dataclasses.replace(big, num_layers=2), NODE, s)
    assert small.offload_fraction == 0 and small.host == 0


def test_largest_is_the_boundary_and_names_the_limit():
    s = Setting(2, 2, True, "full", "cpu-offload", 2)
    shaped = lambda n: dataclasses.replace(  # noqa: E731
        MODEL, num_layers=n, sequence_parallel=True, recompute_granularity="full",
        recompute_method="uniform", recompute_num_layers=1)
    layers, u, bound = largest(NODE, s, lambda n: usage(shaped(n), NODE, s))
    assert layers % 2 == 0 and layers > 0
    assert fits(usage(shaped(layers), NODE, s), NODE) is None
    assert fits(usage(shaped(layers + 2), NODE, s), NODE) == bound != "max_layers"
    tight = dataclasses.replace(NODE, host_memory_gb=5.0)
    _, _, bound = largest(tight, s, lambda n: usage(shaped(n), tight, s))
    assert bound == "host"


def test_search_beats_the_config_layout_and_prices_what_each_setting_adds():
    r = search(MODEL, NODE, GRPO, OffloadConfig(), bucket=None)
    assert len(r.winners) == len(settings(MODEL, NODE, GRPO))
    kept = next(w for w in r.winners if w.setting == Setting(1, 1, False, None, "distributed-optimizer", 4))
    assert r.megatron.params >= max(w.params for w in r.winners if w.setting.system == "megatron")
    assert r.megatron.params > kept.params  # the search finds more than the config's layout
    assert r.grpo.params == max(w.params for w in r.winners if w.setting.system == "grpo")
    assert r.ratio == r.grpo.params / r.megatron.params
    for w in r.winners:
        if not w.layers:
            continue
        parts = w.step_parts
        assert parts["step"] == pytest.approx(sum(v for k, v in parts.items() if k != "step"))
        if w.setting.option == "cpu-offload" and w.usage.offload_fraction:
            assert parts["host_adam"] > 0 and parts["pcie"] > 0
        if w.setting.option == "grpo-offload-ssd":
            assert w.usage.nvme > 0 and w.usage.host == 0
    # Full recompute costs a third more compute than none on the same model and layout.
    a = Setting(1, 1, False, None, "distributed-optimizer", 4)
    b = dataclasses.replace(a, recompute="full")
    ua = usage(MODEL, NODE, a)
    assert step_time(MODEL, NODE, b, ua)["compute"] == pytest.approx(
        step_time(MODEL, NODE, a, ua)["compute"] * 4 / 3, rel=1e-3)
    # At megatron's largest both sides report their fastest setting that fits it (or none).
    assert r.both["megatron"].params == r.megatron.params
    assert r.both["megatron"].step_s <= r.megatron.step_s
    text = format_search(r)
    assert f"{r.megatron.params / 1e9:8.2f} B parameters ({r.megatron.layers} layers)" in text
    assert f"ratio     {r.ratio:.2f}x megatron's searched best" in text
    assert " ".join(r.grpo.setting.flags()) in text


def _cli():
    return load_script("launch/plan.py", "plan_cli")


def test_plan_cli_search_json_and_refusals(capsys):
    cli = _cli()
    argv = ["--config", os.path.join(REPO, "launch", "configs", "small.yaml"), "--gpus-per-node", "2",
            "--gpu-memory-gb", "0.5", "--host-memory-gb", "3", "--host-reserve-gb", "0.5",
            "--nvme-gb", "10", "--vocab-size", "258", "--largest-model", "--search", "--grpo"]
    assert cli.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for side in ("megatron", "grpo"):
        assert out[side]["params"] > 0 and out[side]["step_s"] > 0
        assert out[side]["config"]["tp"] * out[side]["config"]["pp"] * out[side]["config"]["dp"] == 2
    assert out["ratio"] == pytest.approx(out["grpo"]["params"] / out["megatron"]["params"])
    assert cli.main(argv[:-3] + ["--search"]) == 2
    assert "--search goes with --largest-model" in capsys.readouterr().err
    assert cli.main(argv + ["--nodes", "2"]) == 2
    assert "--search sizes one node" in capsys.readouterr().err
    assert cli.main(argv + ["--host-memory-gb", "0.4"]) == 2
    assert "--host-reserve-gb" in capsys.readouterr().err
    assert cli.main(argv + ["--host-adam-rate", "0"]) == 2  # named by its flag, not its field
    assert "--host-adam-rate must be > 0, got 0.0" in capsys.readouterr().err


def test_host_accumulation_and_streamed_core_leave_the_device_and_bill_the_host():
    many = dataclasses.replace(MODEL, num_layers=8, global_batch_size=32)  # 16 micro-batches at dp 2
    dev = Setting(2, 1, True, "full", "grpo-offload-cpu", 4)
    host = dataclasses.replace(dev, option="grpo-offload-cpu-host-accum")
    core = dataclasses.replace(dev, option="grpo-offload-cpu-core-host-accum")
    cluster = ClusterSpec(nodes=1, gpus_per_node=4, gpu_memory_gb=4.0, tp=2)
    off = OffloadConfig(target="cpu")
    u = {s.option: usage(dataclasses.replace(many, sequence_parallel=True, recompute_granularity="full",
                                             recompute_method="uniform", recompute_num_layers=1),
                         NODE, s, GRPO, off) for s in (dev, host, core)}
    # Host accumulation: the device's gradient peak is the one-micro-batch figure.
    one = plan(dataclasses.replace(many, global_batch_size=2), cluster, GRPO, offload=off).grpo_memory
    accum = plan(many, cluster, dataclasses.replace(GRPO, grad_accumulation="host"), offload=off).grpo_memory
    assert accum.grad_peaks == one.grad_peaks
    assert u[host.option].gpu < u[dev.option].gpu
    elements = sum(stage_param_numels(many, cluster, 0))
    assert u[host.option].host - u[dev.option].host >= 4 * elements * NODE.gpus
    # Streaming the core tier too moves its 12 bytes per shard element off the device.
    assert u[core.option].gpu < u[host.option].gpu and u[core.option].host > u[host.option].host
    assert "--grpo-grad-accumulation host" in host.flags()
    assert "--grpo-offload-core" in core.flags() and "--grpo-offload cpu" in core.flags()
    parts = step_time(many, NODE, host, u[host.option], GRPO)
    assert parts["grad_accum_pcie"] == pytest.approx(16 * 4 * elements / (NODE.pcie_gbs * 1e9))
    assert parts["host_add"] == pytest.approx(15 * elements * NODE.gpus / NODE.host_add_per_s)
