"""--check-weight-hash-interval: clean runs pass, diverged copies are caught and named.

Real torchrun runs (4 ranks, TP=2 x DP=2: TP groups {0,1} {2,3}, DP groups {0,2} {1,3}) of
launch/pretrain_gpt.py and of tests/multiproc/weight_check_probe.py (the real loop with one bit
of one parameter flipped on chosen ranks); a 2-rank spawn for the tied-embedding pipeline case,
which training/model.py's (untied) GPT never builds.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import (ENTRY, REPO, SMALL_MODEL, env, free_port, read_metrics, spawn_ranks,
                     train_and_read)
from megatron_grpo.training.weight_check import tensor_digest

TP2_DP2 = [*SMALL_MODEL, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
PROBE = os.path.join(REPO, "tests", "multiproc", "weight_check_probe.py")
ADVICE = "a bug in a gradient or parameter sync path"


def test_digest_sees_one_bit_and_a_swap():
    x = torch.randn(3000)
    base = tensor_digest(x)
    flipped = x.clone()
    flipped.view(torch.int32)[1234] ^= 1
    swapped = x.clone()
    swapped[[7, 8]] = swapped[[8, 7]]
    assert torch.equal(tensor_digest(x.clone()), base)
    assert not torch.equal(tensor_digest(flipped), base)
    assert not torch.equal(tensor_digest(swapped), base)
    assert not torch.equal(tensor_digest(x.bfloat16()), tensor_digest(x.bfloat16() * 2))


def test_clean_tp2_dp2_run_records_weight_hash_ok(stdlib_data, tmp_path):
    records = train_and_read(tmp_path, "wc", 4, [*TP2_DP2, "--data-path", stdlib_data,
                                                  "--train-iters", "4",
                                                  "--check-weight-hash-interval", "2"])
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert [r.get("weight_hash_ok") for r in records] == [None, True, None, True]
    assert all("weight_hash_ok" not in r for r in records[0::2])
    # The check's own traffic is no step's traffic: every step counts the same bytes.
    assert len({r["wire_bytes"] for r in records}) == 1


def _probe(tmp_path, mode, param, at_iter, args):
    out = tmp_path / "probe.json"
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), PROBE, str(out), mode,
           param, str(at_iter), *args, "--metrics-file", str(metrics)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())["ranks"], read_metrics(str(metrics))


@pytest.mark.parametrize("mode,param,expected", [
    # A layer norm weight (replicated, never synced) on TP rank 1 of both DP replicas: only the
    # TP copies disagree.
    ("tp", "decoder.layers.0.input_layernorm.weight",
     "tensor-parallel (tp) copies differ for 1 parameter(s): "
     "decoder.layers.0.input_layernorm.weight (ranks {0} vs {1}; {2} vs {3})"),
    # A TP-split weight on both TP ranks of DP replica 1: only the DP replicas disagree.
    ("dp", "decoder.layers.1.mlp.linear_fc1.weight",
     "data-parallel (dp) copies differ for 1 parameter(s): "
     "decoder.layers.1.mlp.linear_fc1.weight (ranks {0} vs {2}; {1} vs {3})"),
])
def test_one_flipped_bit_stops_the_run_naming_param_and_group(stdlib_data, tmp_path, mode, param,
                                                               expected):
    ranks, records = _probe(tmp_path, mode, param, 2, [
        *TP2_DP2, "--data-path", stdlib_data, "--train-iters", "3",
        "--check-weight-hash-interval", "1"])
    assert sorted(r["perturbed"] for r in ranks) == [False, False, True, True]
    for r in ranks:  # every rank stops, with the same message
        err = r["error"]
        assert err is not None and err["type"] == "WeightHashMismatch", r
        msg = err["message"]
        assert msg.startswith("weight hash check failed at iteration 2 "
                              "(--check-weight-hash-interval):\n"), msg
        assert expected in msg, msg
        assert ADVICE in msg and "Stopping the run" in msg
        other = "(dp)" if mode == "tp" else "(tp)"
        assert other not in msg
        assert msg == ranks[0]["error"]["message"]
    # A monitor reading the metrics sees the passing check, then the failing one, then nothing.
    assert [(r["iteration"], r["weight_hash_ok"]) for r in records] == [(1, True), (2, False)]
    # Identical collectives (op and bytes, in order) on every rank, for the passing check and the
    # failing one (which adds the world-wide exchange of findings).
    calls = [r["calls"] for r in ranks]
    assert all(c == calls[0] for c in calls), calls
    ops = [op for op, _ in calls[0]]
    assert ops == ["all_gather_into_tensor", "all_gather_into_tensor", "all_reduce"] * 2 \
        + ["all_gather", "all_gather"]


def _tied_pp_worker(rank, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron_grpo.platform import select_platform

    platform = select_platform(force_cpu=True)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_grpo.training.weight_check import check_weight_hashes
    from megatron_grpo.training.config import PretrainConfig
    from megatron_grpo.training.model import transformer_config

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    cfg = PretrainConfig()
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.seq_length = 2, 32, 16
    cfg.parallel.pipeline_model_parallel_size = 2
    model = GPTModel(config=transformer_config(cfg, platform),
                     transformer_layer_spec=gpt_layer_specs.get_gpt_layer_local_spec(),
                     vocab_size=128, max_sequence_length=16,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=True)
    clean = check_weight_hashes([model])
    if ps.is_pipeline_last_stage():
        with torch.no_grad():
            model.output_layer.weight.view(-1).view(torch.int32)[3] ^= 1
    drifted = check_weight_hashes([model])
    queue.put((rank, clean.ok, clean.checked, drifted.ok, drifted.groups, drifted.params("pp"),
               [m.split() for m in drifted.mismatches]))
    dist.barrier()
    dist.destroy_process_group()


def test_tied_embedding_copies_compared_across_pipeline_stages():
    results = sorted(spawn_ranks(_tied_pp_worker))
    for rank, clean_ok, checked, drifted_ok, groups, names, splits in results:
        assert clean_ok and checked == {"dp": 0, "tp": 0, "pp": 1}
        assert not drifted_ok and groups == ["pp"]
        assert names == ["embedding.word_embeddings.weight", "output_layer.weight"]
        assert splits == ["{0} vs {1}", "{0} vs {1}"]


def test_interval_must_be_positive(stdlib_data):
    proc = subprocess.run([sys.executable, ENTRY, *SMALL_MODEL, "--data-path", stdlib_data,
                           "--train-iters", "2", "--check-weight-hash-interval", "0"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert (f"error (rank 0 on {socket.gethostname()}): --check-weight-hash-interval must be a "
            f"positive integer (check every N iterations), got 0") in proc.stderr
