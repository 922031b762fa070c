"""The memory tier in real training runs (2 gloo ranks): the stable tier's optimizer state goes
to SSD (or host memory) between its updates, the dynamic tier's Adam moments stream through the
optimizer step, and the run is bit-identical to the same run without offload; a resume with
offload is exact, and a bad --grpo-offload-dir fails before step 1."""

import glob
import io
import os

import pytest
import torch

from harness import GRPO_SMALL, SMALL_MODEL, losses, read_metrics, run_training, train_and_read

ITERS = 20
# GRPO_SMALL: tiers from iteration 9, stable updates at 12, 16, 20, a re-tier at 17.
OFFLOAD = ["--grpo-offload-chunk-mb", "0.25"]


@pytest.fixture(scope="module")
def runs(stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    # The default stable mode (delayed): GRPO_SMALL pins frozen, the flag after it wins.
    base = [*SMALL_MODEL, *GRPO_SMALL, "--grpo-stable-mode", "delayed", "--data-path", stdlib_data,
            "--train-iters", str(ITERS), "--eval-interval", "10"]
    ssd_dir = tmp / "ssd"
    ssd_dir.mkdir()
    ssd = [*base, "--grpo-offload", "ssd", "--grpo-offload-dir", str(ssd_dir), *OFFLOAD]
    out = dict(base=base, ssd_dir=ssd_dir, tmp=tmp)
    # Its checkpoint at 10 is compared with the "first" run's below.
    out["plain"] = train_and_read(tmp, "plain", 2, [*base, "--save", str(tmp / "plain_ckpt"),
                                                   "--save-interval", "10"])
    out["ssd"] = train_and_read(tmp, "ssd", 2, ssd)
    out["files_after"] = sorted(os.listdir(ssd_dir))
    # Interrupted after iteration 11 with a checkpoint at 10 (the stable state was on SSD then),
    # resumed to the end.
    ckpt, metrics = tmp / "ckpt", tmp / "resumed.jsonl"
    run_training(2, [*ssd, "--save", str(ckpt), "--save-interval", "5", "--exit-after-iter", "11",
                     "--metrics-file", str(metrics)])
    out["first"] = read_metrics(metrics)
    run_training(2, [*ssd, "--save", str(ckpt), "--save-interval", "5", "--load", str(ckpt),
                     "--metrics-file", str(metrics)])
    out["all"] = read_metrics(metrics)
    return out


def test_ssd_offload_is_bit_identical_to_no_offload(runs):
    plain, ssd = runs["plain"], runs["ssd"]
    assert losses(ssd) == losses(plain)
    assert ssd[-1]["val_loss"] == plain[-1]["val_loss"]
    assert runs["files_after"] == []  # the rank files are deleted at the end of the run


def test_state_streams_through_the_optimizer_step_and_stays_away_between(runs):
    by_iter = {r["iteration"]: r for r in runs["ssd"]}
    # Warm-up (iterations 1-8, every unit core): every unit's state streams, so the warm-up's
    # peak is no higher than the tiered steps'. Adam's moments appear at a unit's first update
    # inside step 1 and leave with that unit right away: after step 1 as much state is away as
    # after any warm-up step (all of it: masters and both moments), none of it left resident
    # until step 2 (that was the run's peak, +8 bytes per shard element).
    for k in range(1, 9):
        assert by_iter[k]["offload_bytes_written"] > 0 and by_iter[k]["offload_bytes_core_ssd"] > 0
        assert by_iter[k]["offload_bytes_core_device"] == 0
        assert by_iter[k]["offload_bytes_core_ssd"] == by_iter[8]["offload_bytes_core_ssd"]
        assert "offload_bytes_stable_ssd" not in by_iter[k]
    # From the tiering at 9: after every step the dynamic and stable units' masters and
    # moments are on SSD; the dynamic ones went through every step, the stable ones through
    # the updates at 12, 16, 20 only.
    stable = by_iter[9]["offload_bytes_stable_ssd"]
    assert stable > 0
    for k in range(9, ITERS + 1):
        r = by_iter[k]
        assert r.get("offload_bytes_core_ssd", 0) == 0 and r["offload_bytes_core_device"] > 0  # tiered: core stays
        assert r["offload_bytes_dynamic_device"] == 0 and r["offload_bytes_dynamic_ssd"] > 0
        assert r["offload_bytes_stable_device"] == 0 and r["offload_bytes_stable_ssd"] > 0
        assert r["offload_bytes_read"] > 0 and r["offload_stall_s"] >= 0
        assert 0.0 <= r.get("offload_hidden_share", 0.0) <= 1.0
    # The dynamic tier's error-feedback residuals: read in backward, written after the step.
    assert all(by_iter[k]["offload_bytes_residuals_ssd"] > 0 for k in range(10, ITERS + 1))
    # The delayed stable units' gradient sums: made at 9, read back, added to
    # and written out again after every step between updates; none is resident from the start
    # of such a step through its backward (the writes of the last one landed first). An update
    # step (12, 16, 20) reads them ahead for its backward, then empties them.
    for k in range(9, ITERS + 1):
        r = by_iter[k]
        placed = r["offload_bytes_accumulators_device"] + r["offload_bytes_accumulators_ssd"]
        assert placed > 0, k
        if k % 4:
            assert r["offload_bytes_accumulators_device_at_start"] == 0, k
        else:  # every stable unit has a sum since the last update: read ahead for backward
            assert r["offload_bytes_accumulators_device_at_start"] > 0, k
    # Device bytes by kind and tier: what the tier moves is away after every
    # tiered step, what it keeps is there, and without the tier all of it is resident.
    plain = {r["iteration"]: r for r in runs["plain"]}
    for k in range(9, ITERS + 1):
        r, p = by_iter[k], plain[k]
        for kind in ("masters", "moments"):
            for t in ("dynamic", "stable"):
                assert r[f"mem_{kind}_{t}"] == 0 < p[f"mem_{kind}_{t}"], (k, kind, t)
            assert r[f"mem_{kind}_core"] == p[f"mem_{kind}_core"] > 0, (k, kind)
        assert r["mem_masters_dynamic"] + r["mem_moments_dynamic"] == 0 == r["offload_bytes_dynamic_device"]
        # Written out after the step (a write in flight counts as away); resident without the tier.
        assert r["mem_residuals_dynamic"] == 0 < p["mem_residuals_dynamic"], k
        if k % 4:  # between updates: every stable unit has a sum
            assert r["mem_accumulators_stable"] == 0 < p["mem_accumulators_stable"], k
        # The gradient peak is every unit full (two micro-batches: all syncs after backward),
        # the same with and without the tier.
        assert all(r[f"mem_grads_{t}"] == p[f"mem_grads_{t}"] for t in ("core", "dynamic", "stable"))
        assert r["mem_grads_stable"] > 0  # delayed units hold theirs until the step's end
    # Gradient shards (--grpo-offload-grads, the default with the tier): a streamed unit's
    # shard is written out at its sync and read back for its update, so at most the last
    # three writes are resident (all units during the warm-up, the dynamic and stable ones
    # after it); without the tier every shard stays from its sync to the step.
    for k in range(1, ITERS + 1):
        r, p = by_iter[k], plain[k]
        largest_shard = r["grad_bytes_largest_bucket"] / 2  # dp = 2
        assert r["grad_shard_bytes_peak"] < p["grad_shard_bytes_peak"], k
        if k <= 8:
            assert r["grad_shard_bytes_peak"] <= 3 * largest_shard < p["grad_shard_bytes_peak"], k
        assert r["offload_bytes_grads_ssd"] > 0 and r["offload_bytes_grads_device"] == 0, k
    # A stable update reads the stable state back too: more bytes than the steps around it.
    assert by_iter[12]["offload_bytes_read"] > by_iter[10]["offload_bytes_read"]
    assert by_iter[10]["offload_bytes_read"] == by_iter[11]["offload_bytes_read"]


def test_resume_with_offload_is_exact(runs):
    first, every = runs["first"], runs["all"]
    assert [r["iteration"] for r in first] == list(range(1, 12))
    resumed = every[len(first):]
    assert [r["iteration"] for r in resumed] == list(range(11, ITERS + 1))
    assert losses(resumed) == losses(runs["ssd"])[10:] == losses(runs["plain"])[10:]


def _saved(ckpt_dir, out):
    """Everything a checkpoint holds, as plain objects: the dist_checkpointing tensors and
    objects (model, optimizer: masters, moments), the common state less the run's flags, and each
    rank's file (RNG, residuals, accumulators, importance, Adam steps).

    megatron writes the gaps between parameters in an optimizer bucket from torch.empty
    (uninitialised memory: they differ between any two runs), so they are zeroed here. It
    starts every parameter on a multiple of 64 elements of its bucket, so a piece written at
    an offset off that grid is such a gap (here: 32 of 96 elements after each 96-element one)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt_dir), str(out))
    tensors = torch.load(out, weights_only=False)
    gaps = 0
    for key, meta in FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata.items():
        if key.startswith("optimizer.") and hasattr(meta, "chunks"):
            for chunk in meta.chunks:
                start, size = chunk.offsets[0], chunk.sizes[0]
                if start % 64:
                    tensors[key][start:start + size] = 0
                    gaps += size
    # megatron-core up to 0.18 writes common.pt; 0.19 keeps the common state inside the
    # torch_dist files (a "common_state" object): its own reader takes either.
    from megatron.core.dist_checkpointing import load_common_state_dict

    for key in [k for k in tensors if k.startswith("common_state")]:  # 0.19: "common_state/shard_0_1"
        tensors.pop(key)
    common = load_common_state_dict(str(ckpt_dir))
    common["common"].pop("run_flags")  # --grpo-offload and its directory differ, as they should
    ranks = [torch.load(f, weights_only=False)
             for f in sorted(glob.glob(str(ckpt_dir / "rng" / "*.pt")))]
    for rank in ranks:  # no run seeds Python's or NumPy's global RNG: each process draws its own
        del rank["rng"]["python"], rank["rng"]["numpy"]
    return tensors, common, ranks, gaps


def _same(a, b, where="") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, io.BytesIO):
        assert a.getvalue() == b.getvalue(), where
    else:
        assert a == b, where


def test_a_save_with_offload_writes_what_a_save_without_it_writes(runs):
    # Iteration 10: the dynamic units' state on SSD (streamed), the stable units' between
    # updates; the save reads it from the store (mapped or copied: 0.25 MB chunks) and brings
    # none of it back to the device. Bit for bit the checkpoint of the run without the tier.
    tmp = runs["tmp"]
    plain = _saved(tmp / "plain_ckpt" / "iter_0000010", tmp / "plain10.pt")
    ssd = _saved(tmp / "ckpt" / "iter_0000010", tmp / "ssd10.pt")
    optimizer = sum(t.numel() for k, t in plain[0].items()
                    if k.startswith("optimizer.") and torch.is_tensor(t))
    assert any("exp_avg_sq" in k for k in plain[0]) and len(plain[2]) == 2
    assert 0 < plain[3] < optimizer // 100  # the gaps: under 1 % of the optimizer's elements
    _same(plain, ssd)


def test_missing_offload_dir_fails_before_step_1_or_falls_back_to_cpu(runs, tmp_path):
    missing = tmp_path / "no-such-dir"
    metrics = tmp_path / "m.jsonl"
    proc = run_training(2, [*runs["base"], "--grpo-offload", "ssd", "--grpo-offload-dir",
                            str(missing), *OFFLOAD, "--metrics-file", str(metrics)], check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert str(missing) in text and "rank 0" in text and "it does not exist" in text
    assert not metrics.exists()  # no step ran
    # With --grpo-offload-fallback cpu the run warns, keeps the state in host memory, and
    # trains the same bits.
    metrics = tmp_path / "fallback.jsonl"
    proc = run_training(2, [*runs["base"], "--grpo-offload", "ssd", "--grpo-offload-dir",
                            str(missing), *OFFLOAD, "--grpo-offload-fallback", "cpu",
                            "--no-grpo-offload-stream", "--metrics-file", str(metrics)])
    assert proc.stdout.count("Falling back to host memory") == 2  # one line per rank
    records = read_metrics(metrics)
    assert losses(records) == losses(runs["plain"])
    assert records[8]["offload_bytes_stable_cpu"] > 0 and "offload_bytes_stable_ssd" not in records[8]
    assert records[8]["offload_bytes_dynamic_cpu"] == 0  # not streamed: moments stay resident
    # The delayed stable tier's sums leave in host memory too, streamed or not.
    assert all(records[k - 1]["offload_bytes_accumulators_cpu"] > 0 for k in (10, 11, 14, 15))
    assert all(records[k - 1]["offload_bytes_accumulators_device_at_start"] == 0 for k in (10, 11, 14, 15))


def test_memory_budget_chooses_before_the_model_and_refuses_what_cannot_fit(runs, tmp_path):
    # A budget every placement fits: nothing moves (no chunk store), the run trains the same
    # bits, and every record says what was chosen and planned.
    metrics = tmp_path / "roomy.jsonl"
    proc = run_training(2, [*runs["base"], "--grpo-offload", "cpu", *OFFLOAD,
                            "--grpo-memory-budget-gb", "1000", "--metrics-file", str(metrics)])
    assert "--grpo-memory-budget-gb 1000: placement 'resident' (planned peaks per rank: resident " in proc.stdout
    records = read_metrics(metrics)
    assert losses(records) == losses(runs["plain"])
    assert {r["grpo_memory_level"] for r in records} == {"resident"}
    assert all(r["grpo_memory_budget_bytes"] == 10 ** 12 for r in records)
    # The planned peak (the resident set before the model + the planner's tensors) against the
    # measured one: 0.91 here; the rest is allocator slack and gloo's buffers, which the
    # planner does not model.
    planned, peak = records[0]["grpo_memory_planned_bytes"], max(r["peak_rss_bytes"] for r in records)
    assert 0.8 * peak <= planned <= peak, (planned, peak)
    assert not any(k.startswith("offload_") for r in records for k in r)
    # A budget no placement fits: an error on every rank before step 1, no record written.
    metrics = tmp_path / "tight.jsonl"
    proc = run_training(2, [*runs["base"], "--grpo-offload", "cpu", *OFFLOAD,
                            "--grpo-memory-budget-gb", "0.001", "--metrics-file", str(metrics)],
                        check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "rank 0: --grpo-memory-budget-gb 0.001 (OffloadConfig.memory_budget_gb): no placement fits" in text
    assert "rank 1: --grpo-memory-budget-gb 0.001" in text
    assert not metrics.exists()


def test_core_state_streams_and_gradients_accumulate_on_the_host(runs):
    """The largest-model settings: --grpo-offload-core streams the core tier's state through
    every step too, and --grpo-grad-accumulation host adds the two micro-batches' gradients in
    host memory: the same bits as the run without either, and after the warm-up no tier's
    masters or moments stay on the device."""
    records = train_and_read(runs["tmp"], "core", 2, [
        *runs["base"], "--grpo-offload", "cpu", "--grpo-offload-core",
        "--grpo-grad-accumulation", "host", *OFFLOAD])
    assert losses(records) == losses(runs["plain"])
    assert records[-1]["val_loss"] == runs["plain"][-1]["val_loss"]
    for r in records[9:]:  # tiered (GRPO_SMALL: from iteration 9 on)
        for tier in ("core", "dynamic"):
            assert r[f"offload_bytes_{tier}_device"] == 0 and r[f"offload_bytes_{tier}_cpu"] > 0, r
        assert r["grad_host_accum_parks"] == r["grad_host_accum_folds"] > 0, r  # 2 micro-batches
        assert r["grad_bytes_after_step"] == 0
