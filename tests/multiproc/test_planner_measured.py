"""The planner's predictions against real 2-rank gloo runs of megatron-core (SMALL model).

Thirteen runs of 12 iterations (three only with ``-m slow``) through
tests/multiproc/planner_probe.py (the real training loop, plus measurement of the actual
tensors): the fp32 baseline, GRPO in fp32, GRPO in bf16, GRPO with an int8 core tier, and
Llama-style layers (GQA, SwiGLU, RMSNorm, RoPE, no biases) in fp32 and bf16, with MHA in bf16
and with full recompute; full (block) and selective recompute on the GPT layers; and gradient
release with one micro-batch per step (the in-flight window applies: 2 units, and 1
with int8 residuals and delayed stable units) and without release (bf16 residuals).
GRPO_SMALL tiers the units at iteration 9; iteration 12 is a stable update step; its two
micro-batches per step keep every unit's gradient full until the last one's sync.
"""

import json
import os
import subprocess
import sys

import pytest

from harness import GRPO_SMALL, REPO, SMALL_MODEL, env, free_port, load_script, read_metrics

from megatron_grpo.planner.plan import plan, stage_activation_bytes, stage_kept_bytes

# launch/plan.py reads training flags exactly as the planner CLI does.
plan_cli = load_script("launch/plan.py", "plan_cli")

COMMON = [*SMALL_MODEL, "--train-iters", "12", "--eval-iters", "0", "--eval-interval", "12"]
# Llama-style layers on SMALL_MODEL's shape (tests/multiproc/test_llama_style.py).
LLAMA = ["--num-query-groups", "2", "--ffn-hidden-size", "256", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--disable-bias-linear"]
RUNS = {"base": [], "grpo": GRPO_SMALL, "grpo_bf16": [*GRPO_SMALL, "--bf16"],
        "grpo_core_int8": [*GRPO_SMALL, "--grpo-core-compressor", "int8"],
        "llama": [*GRPO_SMALL, *LLAMA], "llama_bf16": [*GRPO_SMALL, *LLAMA, "--bf16"],
        "llama_mha_bf16": [*GRPO_SMALL, *LLAMA[2:], "--bf16"],
        "llama_full_bf16": [*GRPO_SMALL, *LLAMA, "--bf16", "--recompute-granularity", "full",
                            "--recompute-method", "uniform", "--recompute-num-layers", "1"],
        "block": [*GRPO_SMALL, "--recompute-granularity", "full", "--recompute-method", "block",
                  "--recompute-num-layers", "1"],
        "selective": [*GRPO_SMALL, "--recompute-granularity", "selective"],
        "release_1mb": [*GRPO_SMALL, "--global-batch-size", "4"],
        "release_w1_int8": [*GRPO_SMALL, "--global-batch-size", "4", "--grpo-grad-units-in-flight", "1",
                            "--grpo-residual-dtype", "int8", "--grpo-stable-mode", "delayed"],
        "no_release_bf16": [*GRPO_SMALL, "--global-batch-size", "4", "--no-grpo-release-grads",
                            "--grpo-residual-dtype", "bf16"],
        # Two micro-batches, accumulated in host memory: the device sees one at a time.
        "host_accum": [*GRPO_SMALL, "--grpo-grad-accumulation", "host", "--grpo-grad-units-in-flight", "1"]}


def _probe(tmp, name, data, args):
    out, metrics = str(tmp / f"{name}.json"), str(tmp / f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(REPO, "tests", "multiproc", "planner_probe.py"), out, *COMMON, *args,
           "--data-path", data, "--metrics-file", metrics, "--run-name", name]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"probe {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as fh:
        return json.load(fh)["ranks"], read_metrics(metrics)


class _Runs(dict):
    """Each run made on first use, so the runs of slow-marked cases cost nothing by default."""

    def __init__(self, tmp, data):
        super().__init__()
        self.tmp, self.data = tmp, data

    def __missing__(self, name):
        self[name] = _probe(self.tmp, name, self.data, RUNS[name])
        return self[name]


@pytest.fixture(scope="module")
def runs(stdlib_data, tmp_path_factory):
    return _Runs(tmp_path_factory.mktemp("planner"), stdlib_data)


# Covered by the default suite's other cases in kind (MHA vs GQA, recompute granularities):
# minutes on 2 cores, run with `pytest -m slow` (the benchmark command's check).
SLOW = pytest.mark.slow


def _plan(args, tiers=None):
    # The byte tokenizer's 258 ids; CPU mode runs megatron's local spec (unfused attention).
    model, cluster, grpo, bucket, _ = plan_cli.spec_from_flags(
        [*COMMON, *args], nodes=1, gpus_per_node=2, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258,
        attention="unfused")
    return plan(model, cluster, grpo, bucket_size=bucket, tiers=tiers)


def test_baseline_bytes_predicted_exactly(runs):
    _, metrics = runs["base"]
    p = _plan([])
    assert (p.baseline_grad_bytes, p.baseline_param_bytes) == (608768, 608768)
    assert len(metrics) == 12
    for r in metrics:
        assert r["wire_bytes_grad_reduce"] == p.baseline_grad_bytes, r["iteration"]
        assert r["wire_bytes_param_gather"] == p.baseline_param_bytes, r["iteration"]
    # GRPO's warm-up (every unit core) on its own unit layout, with bf16 parameter all-gathers.
    _, bf16 = runs["grpo_bf16"]
    warm = _plan(RUNS["grpo_bf16"]).grpo_warmup_bytes
    assert warm == 913152
    assert [r["wire_bytes_core"] for r in bf16[:8]] == [warm] * 8


@pytest.mark.parametrize("name", ["grpo", "grpo_bf16", "grpo_core_int8", "llama"])
def test_grpo_tier_bytes_predicted_exactly_from_the_run_tiers(runs, name):
    ranks, metrics = runs[name]
    tiered = [r for r in metrics if set(r["grpo_tier_map"]) != {"c"}]
    assert [r["iteration"] for r in tiered] == [9, 10, 11, 12]
    checked = {"between": 0, "update": 0}
    for r in tiered:
        p = _plan(RUNS[name], tiers=r["grpo_tier_map"])
        assert p.units == ranks[0]["units"]  # the controller's units: megatron's bucket layout
        assert r["wire_bytes_core"] == p.grpo_traffic.core, r["iteration"]
        assert r["wire_bytes_dynamic"] == p.grpo_traffic.dynamic, r["iteration"]
        expected_stable = p.grpo_traffic.stable_update if r["grpo_stable_update"] else 0
        assert r["wire_bytes_stable"] == expected_stable, r["iteration"]
        checked["update" if r["grpo_stable_update"] else "between"] += 1
        assert p.grpo_traffic.dynamic > 0 and p.grpo_traffic.stable_update > 0
    assert checked == {"between": 3, "update": 1}


@pytest.mark.parametrize("name", ["base", "grpo", "grpo_bf16", "grpo_core_int8", "llama", "llama_bf16"])
def test_model_state_memory_within_10_percent(runs, name):
    ranks, metrics = runs[name]
    tiers = metrics[-1].get("grpo_tier_map")
    p = _plan(RUNS[name], tiers=tiers)
    predicted = p.grpo_memory if tiers else p.baseline_memory
    state = ("params", "master_params", "optimizer_moments", "error_feedback", "delayed_accumulators")
    for rank in ranks:
        got = rank["state"]  # after the last step
        assert got["params_outside_buffers"] == 0
        # Buffers and residuals have exact sizes; the optimizer shard of one rank differs from
        # the average (unpadded / dp) by the padding inside its half of each bucket.
        assert got["params"] == predicted.params
        # megatron's buffer stays; released gradient storage is empty after a step.
        assert got["grads"] == (0 if tiers and p.grpo.release_grads else predicted.grads)
        assert got["error_feedback"] == predicted.error_feedback  # committed: none staged now
        if tiers:
            assert got["error_feedback"] == metrics[-1]["grpo_ef_bytes"] > 0
        for key in ("master_params", "optimizer_moments"):
            assert abs(got[key] - getattr(predicted, key)) <= 0.01 * getattr(predicted, key) + 1, key
        measured = sum(got[k] for k in state)
        planned = sum(getattr(predicted, k) for k in state)
        assert abs(measured - planned) <= 0.10 * measured, (measured, planned)
        for step in rank["steps"]:  # residuals exist exactly for the compressed units, every step
            if set(step["tiers"]) == {"c"}:  # the exact warm-up (the planner plans tiered steps)
                assert step["ef_bytes"] == 0, step["iteration"]
                continue
            ef = _plan(RUNS[name], tiers=step["tiers"]).grpo_memory.error_feedback
            assert step["ef_bytes"] == ef, step["iteration"]
    # fp32 baseline masters are views of the param buffer; GRPO gives them their own storage.
    assert (ranks[0]["state"]["master_params"] > 0) == (name != "base")


@pytest.mark.parametrize("name", ["base", "grpo_bf16", "llama", "llama_bf16",
                                  pytest.param("llama_mha_bf16", marks=SLOW), "llama_full_bf16",
                                  pytest.param("block", marks=SLOW), pytest.param("selective", marks=SLOW)])
def test_activation_memory_within_1_percent(runs, name):
    ranks, _ = runs[name]
    p = _plan(RUNS[name])
    assert stage_activation_bytes(p.model, p.cluster, 0) == p.baseline_memory.activations
    # What one forward keeps (recompute's working set in backward is not measured here).
    predicted = stage_kept_bytes(p.model, p.cluster, 0)
    if "--recompute-granularity" not in RUNS[name]:
        assert predicted == p.baseline_memory.activations
    for rank in ranks:
        measured = rank["activations"]["storages"]
        assert rank["activations"]["loss_shape"] == [2, 64]
        # The issue asks for 10 %; the formula is held to 1 % so that a missing term (e.g. the
        # fp32 softmax copy, 9 % of this model's bf16 activations) cannot hide in the margin.
        assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)


@pytest.mark.parametrize("name", ["grpo", "grpo_bf16", "grpo_core_int8", "llama", "llama_bf16", "release_1mb",
                                  "release_w1_int8", "no_release_bf16", "host_accum"])
def test_step_peak_within_5_percent_gradient_and_residual_bytes_exact(runs, name):
    """Per step, against the planner for that step's tiers and kind (the first
    iteration, a stable update step or one between updates), the most gradient bytes (the
    storage's own peak, also the grad_bytes_peak metric) and the most residual bytes
    (committed + staged) exactly, and the most bytes of everything the planner counts at one
    moment (sampled at every allocation and release of gradient storage, the end of every
    forward and the step's end; activations as autograd holds them then) within 5 %."""
    ranks, metrics = runs[name]
    release = "--no-grpo-release-grads" not in RUNS[name]
    checked = {"first": 0, "warm-up": 0, "tiered": 0}
    for rank in ranks:
        previous = None
        for step in rank["steps"]:
            it, tiers = step["iteration"], step["tiers"]
            kind = "first" if it == 1 else "update" if step["stable_update"] and "s" in tiers else "between"
            # GRPO's warm-up is exact whatever --grpo-core-compressor says.
            exact = ["--grpo-core-compressor", "none"] if set(tiers) == {"c"} else []
            g = _plan([*RUNS[name], *exact], tiers=tiers).grpo_memory
            if release:
                assert step["grad_peak"] == g.grad_peaks[kind], (it, kind)
                if rank["rank"] == 0:
                    assert metrics[it - 1]["grad_bytes_peak"] == step["grad_peak"], it
            else:
                assert step["grad_peak"] is None and g.grad_peaks[kind] == g.grads
            # Residuals: the committed ones of the previous step's tiers beside the new ones
            # staged at this step's syncs (the same units once the tiers have settled).
            if set(tiers) == {"c"}:
                assert step["ef_peak"] == 0, it
            elif previous == tiers:
                assert step["ef_peak"] == 2 * g.error_feedback > 0, it
            elif set(previous) == {"c"}:  # the first tiered step: nothing committed yet
                assert step["ef_peak"] == g.error_feedback > 0, it
            steady = it == 1 or set(tiers) == {"c"} or previous == tiers
            if steady:  # the planner plans settled steps, not the one after a re-tiering
                assert abs(step["peak"] - g.step_peaks[kind]) <= 0.05 * step["peak"], \
                    (it, kind, step["peak"], g.step_peaks[kind], step["at_peak"])
                checked["first" if it == 1 else "warm-up" if set(tiers) == {"c"} else "tiered"] += 1
            previous = tiers
    assert checked == {"first": 2, "warm-up": 14, "tiered": 6}, checked
