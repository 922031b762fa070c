"""Gradient release (--grpo-release-grads, megatron/grad_storage.py) in real gloo runs: the same
bits as megatron's one gradient buffer in every tier mode, nothing full left after a step, and
the step's gradient peak bounded by the units in flight plus the owned shards."""

import pytest

from harness import GRPO_SMALL, SMALL_MODEL, train_and_read

ONE_MICROBATCH = ["--global-batch-size", "4"]  # micro 2 x dp 2: the in-flight bound applies


def _pair(tmp_path, name, nproc, args, iters=14):
    base = [*SMALL_MODEL, *GRPO_SMALL, "--data-path", args[0], "--train-iters", str(iters),
            "--eval-interval", "1000", *args[1:]]
    on = train_and_read(tmp_path, f"{name}_on", nproc, base, timeout=600)
    off = train_and_read(tmp_path, f"{name}_off", nproc, [*base, "--no-grpo-release-grads"], timeout=600)
    return on, off


def _check_released(on, off):
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert all("grad_bytes_peak" not in r for r in off)          # off: megatron's own buffer
    # megatron's whole-model gradient buffer was never allocated (made on the meta device).
    assert on[0]["grad_bytes_setup_buffer"] == 0
    for r in on:
        # After every step no unit holds full (or any) gradient storage.
        assert r["grad_bytes_after_step"] == 0 and r["grad_units_full_after_step"] == 0, r["iteration"]
        assert 0 < r["grad_bytes_peak"] <= r["grad_bytes_whole_buffer"]


@pytest.mark.parametrize("mode", [
    ["--grpo-stable-mode", "frozen"],
    ["--grpo-stable-mode", "delayed", "--grpo-core-compressor", "int8"],
    ["--grpo-stable-mode", "compressed", *ONE_MICROBATCH],
    ["--no-overlap-grad-reduce", "--grpo-stable-mode", "delayed"],
], ids=["frozen", "delayed-int8core", "compressed-1mb", "no-overlap"])
def test_release_is_bit_identical_and_leaves_nothing(stdlib_data, tmp_path, mode):
    on, off = _pair(tmp_path, "m", 2, [stdlib_data, *mode])
    _check_released(on, off)


def test_warmup_peak_is_units_in_flight_plus_shards(stdlib_data, tmp_path):
    """During the exact warm-up (every unit synced by megatron's reduce-scatter) with one
    micro-batch, at most window + 1 units are full at once on top of this rank's shards (half
    of the buffer at dp 2); megatron's buffer is the whole model. Iteration 1 too: GRPO starts
    each sync as its unit is ready in megatron's first batch (--grpo-first-batch-overlap);
    without that, megatron syncs after backward then, and every unit is full."""
    window = 1
    args = [stdlib_data, *ONE_MICROBATCH, "--grpo-grad-units-in-flight", str(window),
            "--grpo-warmup-iters", "8"]
    # Release against megatron's own buffer is checked bit for bit by the cases above; here
    # the two places a sync can start are compared with each other.
    on = train_and_read(tmp_path, "w_on", 2, [
        *SMALL_MODEL, *GRPO_SMALL, "--data-path", *args, "--train-iters", "8",
        "--eval-interval", "1000"], timeout=600)
    whole, largest = on[0]["grad_bytes_whole_buffer"], on[0]["grad_bytes_largest_bucket"]
    for r in on:
        assert r["grad_bytes_peak"] <= whole / 2 + (window + 1) * largest, r
        assert r["grad_bytes_peak"] < 0.75 * whole, r
    late = train_and_read(tmp_path, "w_late", 2, [
        *SMALL_MODEL, *GRPO_SMALL, "--data-path", *args, "--train-iters", "8",
        "--eval-interval", "1000", "--no-grpo-first-batch-overlap"], timeout=600)
    assert late[0]["grad_bytes_peak"] == whole
    assert all(r["grad_bytes_peak"] < 0.75 * whole for r in late[1:])
    # Where the syncs start changes no bit.
    assert [r["loss"] for r in on] == [r["loss"] for r in late]


def test_pipeline_stages_release_bit_identically(stdlib_data, tmp_path):
    """PP 2 x DP 2: the position embedding is read by megatron after the sync (kept as a copy)."""
    on, off = _pair(tmp_path, "pp", 4, [stdlib_data, "--pipeline-model-parallel-size", "2",
                                        "--grpo-stable-mode", "delayed"], iters=12)
    _check_released(on, off)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--grpo-stable-mode", "delayed"],
    ["--num-distributed-optimizer-instances", "2", "--grpo-stable-mode", "delayed"],
    ["--num-distributed-optimizer-instances", "2", "--grpo-dynamic-sync-interval", "4",
     "--grpo-stable-mode", "local"],
], ids=["tp2", "hierarchy", "periodic"])
def test_other_layouts_release_bit_identically(stdlib_data, tmp_path, layout):
    on, off = _pair(tmp_path, "l", 4, [stdlib_data, *layout], iters=12)
    _check_released(on, off)


FOUR_MICROBATCHES = ["--global-batch-size", "16"]  # micro 2 x dp 2 x 4


@pytest.mark.parametrize("mode", [
    ["--grpo-stable-mode", "delayed"],
    pytest.param(["--grpo-stable-mode", "frozen", "--grpo-offload", "cpu"], marks=pytest.mark.slow),
], ids=["delayed", "frozen-offload"])
def test_host_accumulation_is_bit_identical_and_holds_a_few_units(stdlib_data, tmp_path, mode):
    """--grpo-grad-accumulation host over 4 micro-batches: the same losses bit for bit as the
    device's accumulation; every unit parked once per micro-batch before the last and folded
    back once; the device's gradient peak a few units, where the device's accumulation holds
    every unit at once. (With the memory tier and two micro-batches the default suite runs it in
    tests/multiproc/test_offload_training.py.)"""
    base = [*SMALL_MODEL, *GRPO_SMALL, "--data-path", stdlib_data, "--train-iters", "12",
            "--eval-interval", "1000", *FOUR_MICROBATCHES, "--grpo-grad-units-in-flight", "1", *mode]
    dev = train_and_read(tmp_path, "dev", 2, base, timeout=600)
    host = train_and_read(tmp_path, "host", 2, [*base, "--grpo-grad-accumulation", "host"], timeout=600)
    assert [r["loss"] for r in host] == [r["loss"] for r in dev]
    whole, largest = dev[0]["grad_bytes_whole_buffer"], dev[0]["grad_bytes_largest_bucket"]
    assert dev[0]["grad_bytes_peak"] == whole  # warm-up: every unit full across micro-batches
    assert all(h["grad_bytes_peak"] < d["grad_bytes_peak"] for h, d in zip(host, dev))
    assert all("grad_host_accum_parks" not in r for r in dev)
    for r in host:
        active = r["grad_host_accum_folds"]  # units that computed a gradient this step
        # A frozen stable unit computes a gradient only on its update steps.
        frozen = r["grpo_tier_map"].count("s") if "frozen" in mode else 0
        assert len(r["grpo_tier_map"]) - frozen <= active <= len(r["grpo_tier_map"]), r
        assert r["grad_host_accum_parks"] == 3 * active, r
        assert r["grad_host_accum_bytes"] >= r["grad_host_accum_parked_bytes"] / 3
        # The device holds the unit being written, one in flight and this rank's shards.
        assert r["grad_bytes_peak"] <= whole / 2 + 3 * largest, r
        assert r["grad_bytes_after_step"] == 0, r


def test_host_accumulation_refuses_megatrons_one_buffer(stdlib_data, tmp_path):
    from harness import run_training

    with pytest.raises(Exception) as err:
        run_training(2, [*SMALL_MODEL, *GRPO_SMALL, "--data-path", stdlib_data, "--train-iters", "2",
                         "--grpo-grad-accumulation", "host", "--no-grpo-release-grads"], timeout=300)
    assert "--grpo-grad-accumulation host" in str(err.value) and "--grpo-release-grads" in str(err.value)
