"""--grpo-compress in real runs (2 gloo ranks, localhost): auto measures that compression does
not pay here and syncs exactly, so GRPO trains the baseline's model bit for bit; none is the
same by construction; a run saved with compression resumes without it (and the other way
round), delivering what error feedback owed instead of dropping it."""

from harness import GRPO_SMALL, SMALL_MODEL, losses, read_metrics, run_training, train_and_read

ITERS = 14
# The small model; GRPO_SMALL (three tiers, --grpo-compress all) where a test adds it, and
# the last --grpo-compress flag wins.
COMMON = [*SMALL_MODEL, "--train-iters", str(ITERS), "--eval-interval", str(ITERS)]


def _grad_bytes(records):
    return [r["wire_bytes_grad_reduce"] + r["wire_bytes_param_gather"] for r in records]


DEFAULTS = ["--grpo", "--grpo-bucket-mb", "0.04", "--grpo-warmup-iters", "6", "--grpo-stable-interval", "4"]
"""GRPO's defaults (int8 core, int4 dynamic, no stable tier) at test scale."""


def test_auto_on_localhost_syncs_exactly_and_trains_the_baselines_model(stdlib_data, tmp_path):
    from megatron_grpo.training.arguments import parse_args

    args = [*COMMON, "--data-path", stdlib_data]
    # The baseline with GRPO's bucket layout: other buckets sum the gradient norm in another
    # order, and the comparison would test rounding instead of GRPO.
    buckets = parse_args([*args, *DEFAULTS], world_size=2).grpo.bucket_elements
    base = train_and_read(tmp_path, "base", 2, [*args, "--ddp-bucket-size", str(buckets)])
    auto = train_and_read(tmp_path, "auto", 2, [*args, *DEFAULTS])
    assert len([r for r in auto if r["grpo_tiered"]]) >= 5
    # The decision, as measured at start: the compressed path took longer than the exact one.
    assert all(r["grpo_compress_int4"] == 0.0 and r["grpo_compress_int8"] == 0.0 for r in auto)
    assert auto[-1]["grpo_probe_int4_vs_exact"] > 0.9 and auto[-1]["grpo_link_gbps"] > 0
    # Every sync is megatron's own: the baseline's model and gradient/parameter bytes, bit for
    # bit, tiers and importance running beside it. (none takes the same path without the
    # probe: unit/test_link_decision.py; it ran here too until the suite needed the time.)
    assert losses(auto) == losses(base)
    assert _grad_bytes(auto) == _grad_bytes(base)


def test_a_run_saved_compressed_resumes_exact(stdlib_data, tmp_path):
    """Saved at iteration 10 with --grpo-compress all (residuals owed), resumed with none: the
    first resumed step hands the residuals to its exact syncs (none left afterwards), and the
    run finishes."""
    args = [*COMMON, "--data-path", stdlib_data, *GRPO_SMALL]
    ck = str(tmp_path / "ck")
    run_training(2, [*args, "--grpo-compress", "all", "--save", ck, "--save-interval", "10",
                     "--exit-after-iter", "10", "--metrics-file", str(tmp_path / "a.jsonl")])
    saved = read_metrics(str(tmp_path / "a.jsonl"))
    assert saved[-1]["iteration"] == 10 and saved[-1]["grpo_ef_bytes"] > 0  # owed at the save
    run_training(2, [*args, "--grpo-compress", "none", "--load", ck,
                     "--metrics-file", str(tmp_path / "b.jsonl")])
    resumed = read_metrics(str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in resumed] == list(range(11, ITERS + 1))
    assert all(r["grpo_compress_int4"] == 0.0 and r["grpo_ef_bytes"] == 0 for r in resumed)
    assert resumed[-1]["loss"] < saved[0]["loss"]


def test_a_run_saved_exact_resumes_compressed(stdlib_data, tmp_path):
    """Saved with none and resumed with all: it compresses from its first resumed step."""
    args = [*COMMON, "--data-path", stdlib_data, *GRPO_SMALL]
    ck2 = str(tmp_path / "ck2")
    run_training(2, [*args, "--grpo-compress", "none", "--save", ck2, "--save-interval", "10",
                     "--exit-after-iter", "10", "--metrics-file", str(tmp_path / "c.jsonl")])
    run_training(2, [*args, "--grpo-compress", "all", "--load", ck2,
                     "--metrics-file", str(tmp_path / "d.jsonl")])
    back = read_metrics(str(tmp_path / "d.jsonl"))
    assert all(r["grpo_compress_int4"] == 1.0 for r in back)
    assert back[0]["grpo_ef_bytes"] > 0  # compressing from the first resumed step
