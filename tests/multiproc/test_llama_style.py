"""A Llama-style model (grouped-query attention, SwiGLU, RMSNorm, RoPE, no linear biases)
through megatron-core's own options, trained with GRPO on 2-4 gloo ranks: the options reach the
model, and every copy of every parameter holds the same bytes after every iteration, at DP2,
TP2 x DP2 and PP2 x DP2."""

import pytest

from harness import GRPO_SMALL, LLAMA_SMALL, assert_copies_agree, probe_with_metrics, run_training

LLAMA = LLAMA_SMALL


def _expected_params(h=96, heads=4, groups=2, ffn=256, layers=2, vocab=384):
    head = h // heads
    layer = (h                                  # input RMSNorm weight (no bias)
             + h * (heads + 2 * groups) * head  # fused QKV with 2 key/value groups, no bias
             + h * h                            # attention output projection
             + h                                # pre-MLP RMSNorm
             + h * 2 * ffn + ffn * h)           # SwiGLU: gate and up in one fc1, then fc2
    return vocab * h + layers * layer + h + vocab * h  # embedding (no position table), final norm, output


def test_llama_options_reach_megatron_and_copies_agree_at_dp2(stdlib_data, tmp_path):
    probe, metrics = probe_with_metrics(tmp_path, 2, [*LLAMA, *GRPO_SMALL, "--data-path", stdlib_data,
                                                      "--train-iters", "20", "--eval-interval", "20"])
    assert sum(probe["units"]) >= _expected_params() == 276960
    names = " ".join(probe["names"])
    assert "position_embeddings" not in names  # rope: no learned table
    r0, r1 = probe["ranks"]
    assert {"c", "d", "s"} <= set(r0[-1]["tiers"])
    for a, b in zip(r0, r1):
        assert a["tiers"] == b["tiers"] and a["digest"] == b["digest"], a["iteration"]
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < 0.85 * losses[0]
    # The parameter count the run prints is the formula's: the options are megatron's own.
    proc = run_training(1, [*LLAMA, "--data-path", stdlib_data, "--train-iters", "1",
                            "--eval-interval", "1", "--global-batch-size", "2"])
    assert f"params/rank={_expected_params()} " in proc.stdout


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"]])
def test_llama_copies_agree_with_tp_and_pp(stdlib_data, tmp_path, layout):
    probe, _ = probe_with_metrics(tmp_path, 4, [*LLAMA, *GRPO_SMALL, *layout, "--data-path", stdlib_data,
                                                "--train-iters", "10", "--eval-iters", "0",
                                                "--eval-interval", "10"])
    # With TP, the RMSNorm weights are on both tensor-parallel ranks: the same bytes after every step.
    assert_copies_agree(probe, "d", tp_replicated="--tensor-model-parallel-size" in layout)


def test_activation_recompute_trains_the_same_bits_with_grpo(stdlib_data, tmp_path):
    # Recompute changes what is kept for backward, not what is computed: with GRPO's tiers
    # (frozen stable units included) the losses and the final parameters are those of the run
    # without it, for full (uniform, one layer a chunk) and selective recompute.
    from harness import train_and_read

    common = [*LLAMA, *GRPO_SMALL, "--data-path", stdlib_data, "--train-iters", "14",
              "--eval-interval", "14", "--eval-iters", "1"]
    plain = train_and_read(tmp_path, "plain", 2, common)
    for name, flags in (("full", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "1"]),
                        ("selective", ["--recompute-granularity", "selective"])):
        rec = train_and_read(tmp_path, name, 2, [*common, *flags])
        assert [r["loss"] for r in rec] == [r["loss"] for r in plain], name
        assert rec[-1]["val_loss"] == plain[-1]["val_loss"], name
        assert rec[-1]["grpo_tier_map"] == plain[-1]["grpo_tier_map"] and "s" in plain[-1]["grpo_tier_map"]


def test_sequence_parallel_on_the_local_spec_is_refused_naming_the_flag(stdlib_data, tmp_path):
    proc = run_training(2, [*LLAMA, "--data-path", stdlib_data, "--train-iters", "1",
                            "--tensor-model-parallel-size", "2", "--sequence-parallel"], check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "rank 0: --sequence-parallel needs the transformer-engine layer spec" in text
    assert "rank 1: --sequence-parallel needs the transformer-engine layer spec" in text
