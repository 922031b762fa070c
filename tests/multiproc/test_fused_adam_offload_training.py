"""The memory tier with a fused optimizer, in real 2-rank GRPO runs: megatron
builds TE FusedAdam's CPU double (megatron_grpo/platform/fused_adam.py) as its inner optimizer, as it
builds TE's FusedAdam on a CUDA machine. With the memory tier (--grpo-offload cpu, streamed)
the losses are those of the same run without it, bit for bit; every param group's step counter
is the iteration (not iterations x streamed units); and no step() call holds more optimizer
state than the windows allow (TE makes every parameter's moments at its first step())."""

import json
import os
import subprocess
import sys

import pytest

from harness import GRPO_SMALL, REPO, SMALL_MODEL, env, free_port, losses, read_metrics

ITERS = 10  # warm-up 1-6 (every unit streamed), tiers from 7


def run_probe(tmp, name, args):
    out, metrics = tmp / f"{name}.json", tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(REPO, "tests", "multiproc", "fused_adam_probe.py"), str(out), *args,
           "--metrics-file", str(metrics), "--run-name", name]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"probe failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    with open(out) as fh:
        return json.load(fh)["ranks"], read_metrics(metrics)


@pytest.fixture(scope="module")
def runs(stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused")
    base = [*SMALL_MODEL, *GRPO_SMALL, "--data-path", stdlib_data, "--train-iters", str(ITERS),
            "--eval-interval", "1000"]
    tiered = [*base, "--grpo-offload", "cpu", "--grpo-offload-chunk-mb", "0.25"]
    return {"plain": run_probe(tmp, "plain", base), "tiered": run_probe(tmp, "tiered", tiered)}


def test_memory_tier_trains_the_same_bits_with_te_fused_adam(runs):
    (plain_ranks, plain), (tiered_ranks, tiered) = runs["plain"], runs["tiered"]
    assert len(plain) == len(tiered) == ITERS
    assert losses(tiered) == losses(plain)
    assert tiered[-1]["offload_bytes_dynamic_cpu"] > 0  # the tier did move state
    for ranks in (plain_ranks, tiered_ranks):
        for rank in ranks:
            for rec in rank:
                # One advance per iteration of every (non-empty) group, as without the tier.
                assert rec["counters"] and set(rec["counters"]) == {rec["iteration"]}, rec


def test_fused_adam_eager_state_respects_the_windows(runs):
    for rank in runs["tiered"][0]:
        for rec in rank:
            assert rec["peak"] <= rec["bound"], rec
            assert rec["streamed_allocated"] == 0, rec
        # Iteration 1 streams every unit: the windows allow well under all of the state.
        assert rank[0]["bound"] < rank[0]["total"], rank[0]
    # Without the tier all state is resident, as expected.
    for rank in runs["plain"][0]:
        assert rank[0]["peak"] == rank[0]["total"] > 0
