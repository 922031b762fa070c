"""Save -> resume equals the uninterrupted run; damaged checkpoints fail loudly and safely."""

import json
import shutil

import pytest

from harness import SMALL_MODEL, losses, read_metrics, run_training, train_and_read

ITERS = 16


@pytest.fixture(scope="module")
def runs(stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    base = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", str(ITERS),
            "--eval-interval", "8"]
    full = train_and_read(tmp, "full", 2, base)
    ckpt = tmp / "ckpt"
    metrics = tmp / "resumed.jsonl"
    # First job: checkpoints every 4 iterations, then "dies" after iteration 10.
    run_training(2, [*base, "--save", str(ckpt), "--save-interval", "4", "--exit-after-iter", "10",
                     "--metrics-file", str(metrics)])
    first = read_metrics(metrics)
    # Second job resumes from the newest complete checkpoint (iteration 8) and finishes.
    run_training(2, [*base, "--save", str(ckpt), "--save-interval", "4", "--load", str(ckpt),
                     "--metrics-file", str(metrics)])
    return dict(base=base, full=full, first=first, all=read_metrics(metrics), ckpt=ckpt, tmp=tmp)


def test_resume_is_bit_identical(runs):
    full, first, every = runs["full"], runs["first"], runs["all"]
    assert [r["iteration"] for r in first] == list(range(1, 11))
    resumed = every[len(first):]
    assert [r["iteration"] for r in resumed] == list(range(9, ITERS + 1))
    # Same weights, optimizer moments, per-param Adam steps, lr schedule and data position:
    # the losses after resume are the uninterrupted run's, bit for bit.
    assert losses(resumed) == losses(full)[8:]
    assert resumed[-1]["val_loss"] == full[-1]["val_loss"]
    assert resumed[-1]["consumed_samples"] == full[-1]["consumed_samples"] == ITERS * 8


def test_checkpoint_layout_and_tracker(runs):
    ckpt = runs["ckpt"]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000004", "iter_0000008", "iter_0000012", "iter_0000016",
        "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "16"
    manifest = json.loads((ckpt / "iter_0000016" / "megatron_grpo_manifest.json").read_text())
    assert manifest["iteration"] == 16 and manifest["world_size"] == 2
    assert "common.pt" in manifest["files"] and "rng/rank_00001.pt" in manifest["files"]


def test_corrupted_checkpoint_is_refused_by_name(runs, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(runs["ckpt"], damaged)
    target = sorted((damaged / "iter_0000016").glob("*.distcp"))[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in damaged.rglob("*") if p.is_file()}
    proc = run_training(2, [*runs["base"], "--load", str(damaged), "--save", str(damaged)],
                        check=False)
    assert proc.returncode != 0
    assert f"checkpoint file {target} is corrupted" in proc.stderr
    assert "rank 0" in proc.stderr and "load an earlier checkpoint" in proc.stderr
    # Nothing that was saved was touched.
    assert {p: p.read_bytes() for p in damaged.rglob("*") if p.is_file()} == before


def test_missing_tracker_and_incomplete_save(runs, tmp_path):
    proc = run_training(1, [*runs["base"], "--load", str(tmp_path / "nothing")], check=False)
    assert proc.returncode != 0  # the rank exits 2; torchrun reports the failed child as 1
    assert "no latest_checkpointed_iteration.txt" in proc.stderr and "(rank 0" in proc.stderr
    # The same directory for --save and --load is the requeue idiom: the first job starts fresh.
    fresh = tmp_path / "fresh"
    proc = run_training(1, [*runs["base"], "--train-iters", "2", "--save", str(fresh),
                            "--load", str(fresh)])
    assert "no checkpoint yet (same directory as --save); starting from scratch" in proc.stdout
    assert (fresh / "latest_checkpointed_iteration.txt").read_text() == "2"
    # A save that died half-way leaves iter_N.tmp without a manifest and never moves the tracker;
    # the next --load uses the last complete checkpoint.
    ckpt = tmp_path / "ck"
    shutil.copytree(runs["ckpt"], ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("12")
    shutil.rmtree(ckpt / "iter_0000016")
    partial = ckpt / "iter_0000016.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    metrics = tmp_path / "m.jsonl"
    run_training(2, [*runs["base"], "--load", str(ckpt), "--metrics-file", str(metrics)])
    resumed = read_metrics(metrics)
    assert [r["iteration"] for r in resumed] == [13, 14, 15, 16]
    assert losses(resumed) == losses(runs["full"])[12:]
