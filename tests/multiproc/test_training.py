"""Multi-process training on real text: learning, layout equivalence, metrics, counted bytes."""

import pytest

from harness import SMALL_MODEL, losses, train_and_read
from megatron_grpo.comm.analytic import baseline_step_bytes, ddp_bucket_numels, gpt_param_numels

REQUIRED_FIELDS = {"iteration", "loss", "lr", "step_time_s", "tokens_per_s", "wire_bytes",
                   "peak_rss_bytes"}


@pytest.fixture(scope="module")
def dp2_run(stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    tb = tmp / "tb"
    records = train_and_read(tmp, "dp2", 2, [*SMALL_MODEL, "--data-path", stdlib_data,
                                              "--train-iters", "40", "--eval-interval", "20",
                                              "--tensorboard-dir", str(tb)])
    return records, tb


def test_loss_falls_on_real_text(dp2_run):
    records, _ = dp2_run
    ls = losses(records)
    assert len(ls) == 40
    # Byte-level text starts near ln(384) ~ 5.95; 40 steps of real text must learn a lot.
    assert ls[0] > 5.0
    assert sum(ls[-5:]) / 5 < ls[0] - 1.5
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0]


def test_metrics_fields_and_tensorboard(dp2_run):
    records, tb = dp2_run
    for r in records:
        assert REQUIRED_FIELDS <= set(r), REQUIRED_FIELDS - set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_rss_bytes"] > 10**7
    assert [r["iteration"] for r in records] == list(range(1, 41))
    assert [r["iteration"] for r in records if "val_loss" in r] == [20, 40]
    events = list(tb.glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 1000


def test_counted_wire_bytes_equal_analytic(dp2_run):
    """DistributedOptimizer step = reduce-scatter of every grad bucket + all-gather of every
    param bucket; the counted bytes of each must equal megatron's layout, exactly, every step."""
    records, _ = dp2_run
    vocab = 384  # byte tokenizer (258) padded to a multiple of 128
    numels = gpt_param_numels(num_layers=2, hidden=96, ffn_hidden=384, vocab_padded=vocab,
                              max_position=64)
    buckets = ddp_bucket_numels(numels, bucket_size=20000, dp=2)
    assert sum(buckets) > sum(numels)  # padding is exercised
    grad_bytes, param_bytes = baseline_step_bytes(buckets, dp=2)
    for r in records:
        assert r["wire_bytes_grad_reduce"] == grad_bytes
        assert r["wire_bytes_param_gather"] == param_bytes
        # The rest: the loss all-reduce (2 fp32 values: 8 bytes under the ring model) and
        # the optimizer's scalar all-reduces (grad norm, ...), never gradient-sized.
        other = r["wire_bytes"] - grad_bytes - param_bytes
        assert r["wire_bytes_logging"] == 8
        assert 8 <= other <= 64


@pytest.fixture(scope="module")
def dp1_reference(stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp1")
    return train_and_read(tmp, "dp1", 1, [*SMALL_MODEL, "--data-path", stdlib_data,
                                          "--train-iters", "8", "--eval-interval", "8"])


def _assert_close(a, b, rtol):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * abs(y), f"iteration {i + 1}: {x} vs {y}"


def test_dp2_matches_dp1_on_same_global_batch(stdlib_data, dp1_reference, tmp_path):
    dp2 = train_and_read(tmp_path, "dp2", 2, [*SMALL_MODEL, "--data-path", stdlib_data,
                                              "--train-iters", "8", "--eval-interval", "8"])
    # Same samples per step (global batch 8 = 2 micro-batches x 1 rank = 1 x 2 ranks):
    # only the fp32 summation order differs.
    _assert_close(losses(dp2), losses(dp1_reference), 2e-5)
    assert abs(dp2[-1]["val_loss"] - dp1_reference[-1]["val_loss"]) < 1e-4
    assert dp1_reference[-1]["wire_bytes_grad_reduce"] == 0


def test_tp2_matches_tp1(stdlib_data, dp1_reference, tmp_path):
    # TP pads the vocabulary to a multiple of 128 * TP: 64 x 2 gives the reference's 384 rows.
    tp2 = train_and_read(tmp_path, "tp2", 2, [*SMALL_MODEL, "--data-path", stdlib_data,
                                              "--train-iters", "8", "--eval-interval", "8",
                                              "--tensor-model-parallel-size", "2",
                                              "--make-vocab-size-divisible-by", "64"])
    _assert_close(losses(tp2), losses(dp1_reference), 1e-4)


def test_pp2_matches_pp1(stdlib_data, dp1_reference, tmp_path):
    """Each pipeline stage draws its initial weights from its own RNG stream (as in
    Megatron-LM), so PP=2 starts from a seed checkpoint written by a PP=1 process: the
    torchtitan way to compare layouts. From identical weights the losses must agree."""
    from harness import run_training

    seed = tmp_path / "seed"
    run_training(1, [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", "0",
                     "--save", str(seed)])
    assert (seed / "iter_0000000" / "megatron_grpo_manifest.json").is_file()
    pp2 = train_and_read(tmp_path, "pp2", 2, [*SMALL_MODEL, "--data-path", stdlib_data,
                                              "--train-iters", "8", "--eval-interval", "8",
                                              "--pipeline-model-parallel-size", "2",
                                              "--init-from", str(seed)])
    _assert_close(losses(pp2), losses(dp1_reference), 1e-4)
    assert abs(pp2[-1]["val_loss"] - dp1_reference[-1]["val_loss"]) < 1e-3


def test_missing_dataset_and_bad_flag_errors_from_the_launcher(tmp_path):
    import socket
    import subprocess
    import sys

    from harness import ENTRY, REPO, env

    def launch(*args):
        return subprocess.run([sys.executable, ENTRY, *args], cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=120)

    missing = str(tmp_path / "nope")
    who = f"error (rank 0 on {socket.gethostname()})"
    proc = launch(*SMALL_MODEL, "--data-path", missing, "--train-iters", "2")
    assert proc.returncode == 2
    assert f"{who}: {missing}.bin is missing" in proc.stderr
    assert "launch/preprocess_data.py" in proc.stderr
    proc = launch("--data-path", missing, "--hidden-size", "100", "--num-attention-heads", "3")
    assert proc.returncode == 2
    assert f"{who}: --hidden-size (100) must be divisible by --num-attention-heads (3)" in proc.stderr
    proc = launch("--data-path", missing, "--grpo", "--grpo-compressor", "zip")
    assert proc.returncode == 2 and "--grpo-compressor must be one of int4, int8, topk, powersgd, got 'zip'" in proc.stderr
