"""The Megatron-LM runner end to end: megatron.training's own loop (megatron-core 0.19.2's
training package, driven the way pretrain_gpt.py drives it) on 2 gloo ranks, with and without
--grpo, and the refusals before anything starts."""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_grpo.platform.ports import free_port

from lm_harness import DRIVER, REPO

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-3", "--mock-data", "--vocab-size", "512",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--log-interval", "1",
         "--eval-iters", "0", "--eval-interval", "1000", "--seed", "5",
         # CPU mode runs megatron's RNG streams on one generator, which a checkpoint cannot
         # restore stream by stream: without dropout a resume is exact to the bit.
         "--hidden-dropout", "0", "--attention-dropout", "0"]
GRPO = ["--grpo", "--grpo-compress", "all", "--grpo-bucket-mb", "0.05", "--grpo-warmup-iters", "6",
        "--grpo-retier-interval", "8", "--rerun-mode", "disabled"]
ITERS = 24
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def run(path, nproc, args, timeout=300):
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "-m", "megatron_grpo.megatron_lm", DRIVER, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def records(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if "iteration" in r]


@pytest.fixture(scope="module")
def runs(megatron_lm_path, tmp_path_factory):
    """Three runs of the same job: plain (no GRPO flag at all), GRPO off with the metrics file,
    GRPO on with the metrics file."""
    d = tmp_path_factory.mktemp("megatron_lm")
    out = {}
    for name, extra in (("plain", []),
                        ("off", ["--grpo-metrics-file", str(d / "off.jsonl")]),
                        ("grpo", GRPO + ["--grpo-metrics-file", str(d / "grpo.jsonl")])):
        proc = run(megatron_lm_path, 2, MODEL + ["--train-iters", str(ITERS)] + extra)
        assert proc.returncode == 0, f"{name}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        out[name] = {"log": proc.stdout + proc.stderr,
                     "losses": dict(LOSS_LINE.findall(proc.stdout + proc.stderr)),
                     "records": records(d / f"{name}.jsonl") if name != "plain" else None}
    return out


def test_grpo_off_leaves_megatron_lm_bit_identical(runs):
    plain, off = runs["plain"], runs["off"]
    assert len(plain["losses"]) == ITERS
    # megatron's own log lines, to the digit, and the metrics file's losses are those values.
    assert off["losses"] == plain["losses"]
    assert [r["iteration"] for r in off["records"]] == list(range(1, ITERS + 1))
    for r in off["records"]:
        # megatron's line for iteration 2 averages iterations 1 and 2 (its first report is not
        # reset), so the per-step values are compared from iteration 3 on.
        if r["iteration"] != 2:
            assert f"{r['loss']:E}" == plain["losses"][str(r["iteration"])]
        assert r["wire_bytes_grad_reduce"] == r["wire_bytes_by_op"]["reduce_scatter_tensor"] > 0
        assert sum(r["wire_bytes_by_op"].values()) == r["wire_bytes"] and "grpo_tier_map" not in r
    assert "GRPO in place" not in off["log"]


def test_grpo_on_builds_grpo_classes_and_sends_fewer_bytes(runs):
    off, grpo = runs["off"]["records"], runs["grpo"]["records"]
    log = runs["grpo"]["log"]
    # Each of 0.19's construction points, replaced and then used (the optimizer wrapper checks
    # every model chunk is GRPO's DDP; setup_model_and_optimizer's wrapper checks the optimizer).
    assert ("GRPO in place at megatron.training.training.DDP, megatron.training.models.dist_utils."
            "DistributedDataParallel, megatron.training.training.get_megatron_optimizer") in log
    assert grpo[-1]["grpo_tier_map"].count("d") >= 3, grpo[-1]["grpo_tier_map"]
    after = [(g["wire_bytes"], o["wire_bytes"]) for g, o in zip(grpo, off) if g["iteration"] > 12]
    ratio = sum(g for g, _ in after) / sum(o for _, o in after)
    assert ratio < 0.3, ratio  # int4/int8 with quantised deltas: about 0.18 on this model
    assert grpo[-1]["loss"] < grpo[0]["loss"] - 0.5
    assert abs(grpo[-1]["loss"] - off[-1]["loss"]) / off[-1]["loss"] < 0.01


def test_grpo_resumes_from_megatron_lm_checkpoints_to_the_bit(runs, megatron_lm_path, tmp_path):
    ck = str(tmp_path / "ck")
    common = MODEL + GRPO + ["--train-iters", str(ITERS)]
    first = run(megatron_lm_path, 2, common + ["--save", ck, "--save-interval", "12", "--exit-interval", "12"])
    assert first.returncode == 0, first.stderr[-3000:]
    # GRPO's state beside megatron's checkpoint, one file per rank and the common one.
    assert sorted(os.listdir(os.path.join(ck, "iter_0000012", "grpo_state"))) == [
        "common.pt", "rank_00000.pt", "rank_00001.pt"]
    metrics = str(tmp_path / "resumed.jsonl")
    second = run(megatron_lm_path, 2, common + ["--load", ck, "--grpo-metrics-file", metrics])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "no GRPO state" not in second.stdout
    resumed = records(metrics)
    straight = {r["iteration"]: r for r in runs["grpo"]["records"]}
    assert [r["iteration"] for r in resumed] == list(range(13, ITERS + 1))
    keys = ("loss", "grpo_tier_map", "wire_bytes_core", "wire_bytes_dynamic", "wire_bytes_stable")
    for r in resumed:  # the gradient traffic by tier (a resumed run's control bytes differ)
        assert [r[k] for k in keys] == [straight[r["iteration"]][k] for k in keys], r["iteration"]


def test_refusals_come_before_distributed_start_up(megatron_lm_path):
    args = [a for a in MODEL if a != "--overlap-grad-reduce"] + ["--train-iters", "2", "--grpo"]
    proc = run(megatron_lm_path, 1, args, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 0: this Megatron-LM run cannot start with GRPO" in out
    assert "add --overlap-grad-reduce" in out and "add --rerun-mode disabled" in out
    assert "initializing torch distributed" not in out and not LOSS_LINE.search(out)
