"""The memory planner with several distributed-optimizer instances, against a real run: 4 gloo
ranks as 2 nodes of 2 (one instance per node), GRPO with an int8 core every step and periodic
dynamic and stable tiers, measured by tests/multiproc/planner_probe.py from the actual tensors.

What the planner must get right here, and got wrong before (it ignored the instances):
* megatron's partial distributed optimizer shards the masters and Adam moments over the 2 ranks
  of an instance, not the 4 of the data-parallel group: twice the flat layout's state;
* buckets are padded for the ranks of one instance;
* the per-step error feedback lives on the inter-instance stage only: one residual per element
  of the rank's shard (padded to a row per instance), not per element of the unit;
* the periodic tiers hold an fp32 anchor per shard element, an outer momentum (here 0.5) and the
  residual of their compressed deltas (megatron_grpo/comm/outer.py).

Schedule (warm-up 6, so tiering starts at 7; re-tier every 8): dynamic and stable sync their
deltas every 4 iterations, compressed at 10 and exactly at 12 (the run's last iteration), which
delivers and drops the residuals. After 10 every piece of the outer state exists.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from harness import REPO, SMALL_MODEL, env, free_port, read_metrics

from megatron_grpo.planner.plan import plan
from megatron_grpo.training.memory_budget import spec_from_flags

ITERS = 12
ARGS = [*SMALL_MODEL, "--train-iters", str(ITERS), "--eval-iters", "0", "--eval-interval", str(ITERS),
        "--num-distributed-optimizer-instances", "2",
        "--grpo", "--grpo-compress", "all", "--grpo-bucket-mb", "0.04", "--grpo-warmup-iters", "6", "--grpo-retier-interval", "8",
        "--grpo-importance-interval", "1", "--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.65",
        "--grpo-stable-share", "0.2", "--grpo-max-dynamic-share", "0.7", "--grpo-core-compressor", "int8",
        "--grpo-dynamic-sync-interval", "4", "--grpo-stable-mode", "local", "--grpo-stable-interval", "4",
        "--grpo-outer-momentum", "0.5"]


@pytest.fixture(scope="module")
def probe(stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planner_instances")
    out, metrics = str(tmp / "probe.json"), str(tmp / "metrics.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(REPO, "tests", "multiproc", "planner_probe.py"), out, *ARGS,
           "--data-path", stdlib_data, "--metrics-file", metrics, "--run-name", "instances"]
    proc = subprocess.run(cmd, cwd=REPO, env=env({"MEGATRON_GRPO_RANKS_PER_NODE": "2"}),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"probe failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(out) as fh:
        return json.load(fh)["ranks"], read_metrics(metrics)


def _plan(tiers=None, instances=None):
    model, cluster, grpo, bucket, _ = spec_from_flags(
        ARGS, nodes=2, gpus_per_node=2, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258, attention="unfused")
    if instances is not None:  # the same run planned in another layout
        cluster = dataclasses.replace(cluster, instances=instances)
    return plan(model, cluster, grpo, bucket_size=bucket, tiers=tiers)


def test_instance_memory_predicted_from_the_run_tiers(probe):
    ranks, metrics = probe
    by_iter = {r["iteration"]: r for r in metrics}
    assert {k: by_iter[k]["grpo_outer_synced"] for k in (10, 12)} == {10: "ds", 12: "ds"}
    tiers = metrics[-1]["grpo_tier_map"]
    assert set(tiers) == {"c", "d", "s"}
    p = _plan(tiers)
    assert p.cluster.instances == 2 and p.cluster.dp == 4
    g = p.grpo_memory
    for rank in ranks:
        got = rank["state"]
        assert got["params_outside_buffers"] == 0
        # Gradient release (the default): nothing left after the step; during one, the
        # storage of the units in flight (one micro-batch) and the shards of one instance.
        assert (got["params"], got["grads"]) == (g.params, 0)
        for key in ("master_params", "optimizer_moments"):  # a rank's shard vs the average
            assert abs(got[key] - getattr(g, key)) <= 0.01 * getattr(g, key) + 1, key
        # Per-step residuals: the core's shard rows only (dynamic and stable train locally).
        assert got["error_feedback"] == g.error_feedback > 0
        steps = {s["iteration"]: s for s in rank["steps"]}
        for k in (10, 11):  # anchors, momentum and delta residuals of both periodic tiers
            assert steps[k]["tiers"] == tiers
            assert steps[k]["outer_bytes"] == g.outer_state > 0, k
            kind = "update" if steps[k]["stable_update"] else "between"
            assert steps[k]["grad_peak"] == g.grad_peaks[kind] > 0, k
            assert steps[k]["ef_peak"] == 2 * g.error_feedback, k  # committed and staged
        # The step's peak once the outer state has all its pieces (its delta residuals are
        # made at 10's sync, after that step's peak).
        kind = "update" if steps[11]["stable_update"] else "between"
        assert abs(steps[11]["peak"] - g.step_peaks[kind]) <= 0.05 * steps[11]["peak"]
        # The exact sync of the last iteration delivered and dropped the delta residuals.
        assert 0 < got["outer_state"] == steps[12]["outer_bytes"] < g.outer_state


def test_instances_double_the_optimizer_state_and_shrink_the_residuals():
    """The same flags planned flat (one instance) and hierarchical: what the run above measures
    is not what the flat plan says."""
    flat, hier = _plan(instances=1), _plan()
    assert hier.grpo_memory.optimizer_moments == pytest.approx(2 * flat.grpo_memory.optimizer_moments, rel=1e-3)
    assert hier.baseline_memory.optimizer_moments == pytest.approx(
        2 * flat.baseline_memory.optimizer_moments, rel=1e-3)
    assert flat.grpo_memory.outer_state == 0 < hier.grpo_memory.outer_state
    # Flat: a residual per element of every unit of the tiers compressed every step (core and
    # dynamic); hierarchical: per shard element of the core (the other tiers train locally).
    assert hier.grpo_memory.error_feedback < flat.grpo_memory.error_feedback / 2
