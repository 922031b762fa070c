"""GRPO on a model with a single tier unit: nothing to tier, so it runs exactly as megatron
would (one notice says so), from start to a resume, instead of refusing the model."""

from harness import SMALL_MODEL, losses, read_metrics, run_training, train_and_read

LONE_MB = "1024"  # one 1 GB bucket: far above SMALL_MODEL's gradients


def test_a_single_unit_model_runs_exactly_as_the_baseline(stdlib_data, tmp_path):
    from megatron_grpo.training.arguments import parse_args

    common = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", "8", "--eval-interval", "8"]
    # A short warm-up, re-tiers and monitoring steps that would all happen with several units;
    # the default tiers (int8 core, int4 dynamic) would make any tiered step differ.
    grpo = [*common, "--grpo", "--grpo-bucket-mb", LONE_MB, "--grpo-warmup-iters", "2",
            "--grpo-retier-interval", "2", "--grpo-stable-interval", "2", "--grpo-gvr-interval", "2"]
    bucket = parse_args(grpo, world_size=2).grpo.bucket_elements
    base = train_and_read(tmp_path, "base", 2, [*common, "--ddp-bucket-size", str(bucket)])
    ckpt, metrics = str(tmp_path / "ck"), str(tmp_path / "grpo.jsonl")
    first = run_training(2, [*grpo, "--save", ckpt, "--save-interval", "4", "--exit-after-iter", "4",
                             "--metrics-file", metrics])
    notices = [line for line in first.stdout.splitlines() if "one tier unit" in line]
    assert len(notices) == 1 and "exactly as megatron" in notices[0] and "--grpo-bucket-mb" in notices[0], \
        first.stdout[-3000:]
    second = run_training(2, [*grpo, "--load", ckpt, "--metrics-file", metrics])
    assert sum("one tier unit" in line for line in second.stdout.splitlines()) == 1
    run = read_metrics(metrics)
    assert [r["iteration"] for r in run] == list(range(1, 9))
    assert losses(run) == losses(base)
    assert run[-1]["val_loss"] == base[-1]["val_loss"]
    for r, b in zip(run, base):
        assert r["grpo_tier_map"] == "c" and r["grpo_tiered"] is False and r["grpo_share_core"] == 1.0
        assert "grpo_gvr_core" not in r and "grpo_rel_error_core" not in r
        assert r["wire_bytes_dynamic"] == r["wire_bytes_stable"] == 0
        # megatron's own collectives, byte for byte.
        assert r["wire_bytes_core"] == b["wire_bytes_grad_reduce"] + b["wire_bytes_param_gather"], r["iteration"]
    # The notice is the first step's event, in the metrics of the run and of its resume.
    events = [(r["iteration"], e["reason"]) for r in run for e in r.get("grpo_retier", [])]
    assert [it for it, _ in events] == [1, 5] and all("one tier unit" in why for _, why in events)
