"""Verified checkpoints are never overwritten, on 2 gloo ranks.

The reproduction: `--save D --load D` where D holds verified iter_0000005 ... iter_0000020 but
no latest_checkpointed_iteration.txt (a job killed between a first save's rename and its tracker
write leaves exactly this) started from scratch and replaced all four. Now the newest verified
directory is resumed from, with a WARNING; a run that would replace verified directories is
refused at start unless it passes --overwrite-checkpoints. The decision rules themselves are
unit-tested in tests/unit/test_checkpoint_checks.py."""


from harness import SMALL_MODEL, file_digests, read_metrics, run_training

TRACKER = "latest_checkpointed_iteration.txt"



def test_verified_checkpoints_are_resumed_not_overwritten(stdlib_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    base = [*SMALL_MODEL, "--data-path", stdlib_data, "--eval-interval", "1000", "--eval-iters", "0"]
    run_training(2, [*base, "--train-iters", "20", "--save", str(ckpt), "--save-interval", "5"])
    (ckpt / TRACKER).unlink()
    before = file_digests(ckpt)
    assert sorted(p for p in before if p.endswith("megatron_grpo_manifest.json")) == [
        f"iter_{k:07d}/megatron_grpo_manifest.json" for k in (5, 10, 15, 20)]

    # The requeue idiom with the tracker lost: resume from the newest verified directory.
    metrics = tmp_path / "resumed.jsonl"
    # --train-iters 24 would change the 20-iteration lr decay: keep the checkpoint's (resume_flags).
    proc = run_training(2, [*base, "--train-iters", "24", "--save", str(ckpt), "--load", str(ckpt),
                            "--use-checkpoint-opt_param-scheduler",
                            "--metrics-file", str(metrics)])
    warning = [line for line in proc.stdout.splitlines() if line.startswith("WARNING: --load")]
    assert warning == [f"WARNING: --load {ckpt}: no {TRACKER}, but {ckpt}/iter_0000020 is a complete "
                       f"checkpoint (its manifest verified: every file's size and CRC32); resuming from "
                       f"iteration 20, the newest of 4 iter_* directories (a job killed between a save's "
                       f"rename and its tracker write leaves this)."], proc.stdout[-3000:]
    assert "starting from scratch" not in proc.stdout and "start_iter=20" in proc.stdout
    assert [r["iteration"] for r in read_metrics(str(metrics))] == [21, 22, 23, 24]
    after = file_digests(ckpt)
    assert {k: v for k, v in after.items() if k in before} == before  # all four untouched
    assert (ckpt / TRACKER).read_text() == "24"

    # A fresh run into the same directory would replace iter_0000005 ... iter_0000024: refused at
    # start, before training, naming the directory and the flag; nothing touched.
    before = file_digests(ckpt)
    proc = run_training(2, [*base, "--train-iters", "24", "--save", str(ckpt)], check=False)
    assert proc.returncode != 0
    for rank in (0, 1):
        said = [line for line in proc.stderr.splitlines() if line.startswith(f"error (rank {rank} on")]
        assert len(said) == 1, proc.stderr[-3000:]
        assert (f"--save {ckpt}: this run (iterations 1-24) would replace complete, verified "
                f"checkpoints there: iter_0000005, iter_0000010, iter_0000015, iter_0000020, iter_0000024 "
                f"(iter_0000024 verified)") in said[0], said[0]
        assert f"resume from them with --load {ckpt}" in said[0] and "--overwrite-checkpoints" in said[0]
    assert file_digests(ckpt) == before
