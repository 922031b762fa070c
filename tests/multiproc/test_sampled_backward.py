"""--grpo-sampled-backward in real training runs of megatron-core on gloo ranks: tensor-parallel
ranks sample the same rows (TP=2 trains what TP=1 does), pipeline parallelism with activation
recompute, gradient accumulation over micro-batches with overlap_grad_reduce (SMALL_MODEL: 2
micro-batches per rank), the memory tier, and an exact resume (the plan in the checkpoint, the
generators seeded by iteration)."""

import dataclasses
import math

import pytest

from harness import SMALL_MODEL, losses, stop_and_resume, train_and_read

ITERS = 10
# Tiers from iteration 5 (the first stable-interval boundary after the warm-up); a measuring (exact) step every 4 iterations; keep ratios pinned to 0.3 so the
# sampling is heavy enough to change the numbers (a wrong row would show).
SAMPLED = ["--grpo", "--grpo-bucket-mb", "0.04", "--grpo-warmup-iters", "4", "--grpo-stable-interval", "2",
           "--grpo-retier-interval", "100", "--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.85",
           "--grpo-core-compressor", "none", "--grpo-sampled-backward", "--grpo-sample-interval", "4",
           "--grpo-sample-min-keep", "0.3", "--grpo-sample-max-keep", "0.3",
           "--grpo-sample-dgrad", "below-core"]


def _args(stdlib_data, *extra):
    return [*SMALL_MODEL, *SAMPLED, "--data-path", stdlib_data, "--train-iters", str(ITERS),
            "--eval-interval", str(ITERS), *extra]


def _sampled(records):
    """The iterations that sampled: a keep ratio below 1 and fewer FLOPs than the exact step."""
    return [r for r in records if r.get("sample_keep_dynamic", 1.0) < 1.0 and r["flops_ratio"] < 1.0]


@pytest.fixture(scope="module")
def tp1(stdlib_data, tmp_path_factory):
    return train_and_read(tmp_path_factory.mktemp("sampled_tp1"), "tp1", 1,
                          _args(stdlib_data, "--make-vocab-size-divisible-by", "128"))


def test_tensor_parallel_ranks_sample_the_rows_one_rank_does(stdlib_data, tp1, tmp_path):
    """Column- and row-parallel layers hold different slices of x and dy; their squared row
    norms are summed over the TP group so both ranks draw the same rows, the ones TP=1 draws.
    Each step logs a digest of the rows it kept: TP=2's rank 0 must report TP=1's. (Norms summed
    in another order may flip a row whose draw lies within rounding of its probability: one
    step of the run may differ, not more. Ranks using their own slices' norms differ in every
    step; so do their losses only by ~1e-4, which is why the digest is compared.)"""
    tp2 = train_and_read(tmp_path, "tp2", 2, _args(stdlib_data, "--tensor-model-parallel-size", "2",
                                                   "--make-vocab-size-divisible-by", "64"))
    assert len(_sampled(tp1)) == len(_sampled(tp2)) >= 5
    digests = [(a.get("sample_rows_digest"), b.get("sample_rows_digest")) for a, b in zip(tp1, tp2)
               if "sample_rows_digest" in a]
    assert len(digests) >= 5 and sum(a != b for a, b in digests) <= 1, digests
    for i, (a, b) in enumerate(zip(losses(tp2), losses(tp1))):
        assert abs(a - b) <= 1e-3 * abs(b), f"iteration {i + 1}: {a} vs {b}"
    # The counted FLOPs: each TP rank computes half of every linear layer; the exact step is
    # the planner's count (megatron_grpo.planner.compute) to the FLOP.
    assert tp2[-1]["flops_ratio"] == pytest.approx(tp1[-1]["flops_ratio"], rel=0.02)
    from megatron_grpo.planner.compute import exact_step_flops
    from megatron_grpo.planner.plan import ModelSpec

    small = ModelSpec(num_layers=2, hidden=96, heads=4, vocab=258, seq_length=64, micro_batch_size=2)
    assert tp1[-1]["flops_exact_step"] == exact_step_flops(small, tokens=8 * 64)
    # TP=2 ran with --make-vocab-size-divisible-by 64 (x2 = 128: the same padded vocabulary).
    small2 = dataclasses.replace(small, make_vocab_size_divisible_by=64)
    assert tp2[-1]["flops_exact_step"] == exact_step_flops(small2, tokens=8 * 64, tp=2)


def test_pipeline_stages_with_activation_recompute_sample(stdlib_data, tmp_path):
    recs = train_and_read(tmp_path, "pp2", 2, _args(
        stdlib_data, "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"))
    assert len(recs) == ITERS and all(math.isfinite(r["loss"]) for r in recs)
    assert len(_sampled(recs)) >= 5
    assert recs[-1]["loss"] < recs[0]["loss"]


def test_resume_with_the_memory_tier_is_exact(stdlib_data, tmp_path):
    """Two data-parallel ranks (gradient accumulation over 2 micro-batches each, overlapped
    reduce), the stable tier's state on host memory: stopped after iteration 7 with a
    checkpoint at 6, resumed, the losses are the uninterrupted run's bit for bit."""
    args = _args(stdlib_data, "--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.65",
                 "--grpo-stable-share", "0.2", "--grpo-offload", "cpu", "--grpo-offload-chunk-mb", "0.25")
    full = train_and_read(tmp_path, "full", 2, args)
    assert len(_sampled(full)) >= 5
    assert any(r.get("sample_keep_stable", 1.0) < 1.0 for r in full)
    stop_and_resume(tmp_path, 2, args, full, save_at=6)


def test_a_stage_without_linear_layers_joins_the_measurement(stdlib_data, tmp_path):
    """A pipeline stage of the embedding alone (megatron's layout "E|t*2,L") wraps no linear
    layer. The keep-ratio measurement is a collective over every rank of the job: a stage that
    skipped it left the other waiting at the first measuring step. Under a short collective
    timeout and a process timeout, a skip fails the test instead of hanging the suite."""
    recs = train_and_read(tmp_path, "pp2_layout", 2, _args(
        stdlib_data, "--pipeline-model-parallel-size", "2",
        "--pipeline-model-parallel-layout", "E|t*2,L", "--untie-embeddings-and-output-weights",
        "--distributed-timeout-minutes", "1"), timeout=240)
    assert [r["iteration"] for r in recs] == list(range(1, ITERS + 1))
    # The last stage holds every linear layer and samples; its measurements came back summed.
    assert len(_sampled(recs)) >= 5
    assert recs[-1]["loss"] < recs[0]["loss"]
