"""GRPO's periodic tiers between instances (local updates, megatron_grpo.comm.outer), on 4 gloo
ranks emulating 2 nodes of 2 (one distributed-optimizer instance per node).

The schedule under test (warm-up 6, so tiering starts after iteration 6; re-tier every 8):
dynamic syncs its deltas (int4) every 4 iterations: 10, 18; stable (local mode) every 8: 14;
the step before the re-tier at 15 syncs everything exactly (14), and so does the last (20).

What must hold: the replicas inside an instance are bit-identical after every step; the two
instances are bit-identical right after each step that synced every periodic tier (the run's
own weight-hash check: all 4 copies of every parameter then; between syncs each node's pair
of a locally trained tier's parameters, all 4 copies of the rest); the instances did drift between syncs; the bytes between instances are the
planner's to the byte; a resume in the middle of a period is bit-identical.
"""


import pytest

from harness import SMALL_MODEL, load_script, stop_and_resume, train_and_read

NODES = {"MEGATRON_GRPO_RANKS_PER_NODE": "2"}
ITERS = 20
PERIODIC = ["--grpo", "--grpo-compress", "all", "--grpo-bucket-mb", "0.04", "--grpo-warmup-iters", "6",
            "--grpo-retier-interval", "8", "--grpo-importance-interval", "1",
            "--grpo-core-share", "0.15", "--grpo-dynamic-share", "0.65", "--grpo-stable-share", "0.2",
            "--grpo-max-dynamic-share", "0.7",
            "--grpo-dynamic-sync-interval", "4", "--grpo-stable-mode", "local", "--grpo-stable-interval", "8",
            "--grpo-outer-lr", "0.8", "--grpo-outer-momentum", "0.5"]
SYNCED = {10: "d", 14: "ds", 18: "d", 20: "ds"}
ALL_SYNCED = {14, 20}


def _args(data):
    return [*SMALL_MODEL, "--data-path", data, "--train-iters", str(ITERS), "--eval-interval", str(ITERS),
            "--check-weight-hash-interval", "1", "--num-distributed-optimizer-instances", "2", *PERIODIC]


@pytest.fixture(scope="module")
def run(stdlib_data, tmp_path_factory):
    return train_and_read(tmp_path_factory.mktemp("periodic"), "periodic", 4, _args(stdlib_data),
                          extra_env=NODES)


def test_copies_identical_inside_instances_and_across_them_after_each_full_sync(run):
    assert [r["iteration"] for r in run] == list(range(1, ITERS + 1))
    assert all(r["weight_hash_ok"] for r in run)  # the run stops on a mismatch anyway
    # How many parameters were compared only inside each node (the rest across all 4 copies):
    # none in the warm-up and after a full sync; after a dynamic-only sync only the stable tier's
    # (the dynamic tier's copies agree across nodes then too).
    only = {r["iteration"]: r["weight_hash_instance_only"] for r in run}
    assert [k for k, n in only.items() if n == 0] == [1, 2, 3, 4, 5, 6, *sorted(ALL_SYNCED)]
    assert 0 < only[10] < only[9] == only[11] and 0 < only[18] < only[17] == only[19]
    tiered = run[6:]
    assert {r["iteration"]: r["grpo_outer_synced"] for r in tiered if r["grpo_outer_synced"]} == SYNCED
    # The instances had really moved apart when they synced (not a no-op local phase).
    for r in tiered:
        if r["grpo_outer_synced"]:
            assert 0.01 < r["grpo_outer_drift"] < 2.0, r
    # Re-tiered at 15, right after the exact sync of 14; the units that left a periodic tier
    # had their Adam moments averaged across instances before that step.
    assert [e["iteration"] for r in run for e in r.get("grpo_retier", [])] == [7, 15]
    assert run[14]["wire_bytes_outer"] > 0


def test_bytes_between_instances_are_the_planners(run, stdlib_data):
    from megatron_grpo.planner.internode import internode

    plan_cli = load_script("launch/plan.py", "plan_cli")
    model, cluster, grpo, _, _ = plan_cli.spec_from_flags(
        _args(stdlib_data), nodes=2, gpus_per_node=2, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258,
        attention="unfused")
    checked = 0
    for r in run[6:]:
        t = internode(model, cluster, grpo, bucket_size=None, tiers=r["grpo_tier_map"])
        assert (t.dynamic_interval, t.stable_interval, t.core_interval, t.retier_interval) == (4, 8, 1, 8)
        k, outer = r["iteration"], r["wire_bytes_outer"]
        if k in ALL_SYNCED:
            assert outer == t.exact["dynamic"] + t.exact["stable"] > 0, k
        elif k in SYNCED:
            assert outer == t.hier_dynamic > 0, k
        elif k != 15:  # 15: moments of the units that left a periodic tier (checked above)
            assert outer == 0, k
        # Every step, core (int8, per step) crosses as planned; the rest is GRPO's scalar control
        # traffic (importance, the common clipping norm, the skip flag).
        rest = r["wire_bytes_inter_node"] - r["wire_bytes_logging"] - outer - t.hier_core
        assert 0 <= rest <= r["wire_bytes_grpo_control"], (k, rest)
        checked += 1
    assert checked == ITERS - 6
    # Between syncs only the core tier and scalars cross: under a tenth of the warm-up's bytes
    # (the warm-up is megatron's hierarchical sync, tests/multiproc/test_hierarchy.py).
    quiet = [r["wire_bytes_inter_node"] for r in run[6:] if r["iteration"] not in SYNCED and r["iteration"] != 15]
    assert max(quiet) < 0.1 * run[0]["wire_bytes_inter_node"]


def test_resume_in_the_middle_of_a_period_is_bit_identical(run, stdlib_data, tmp_path):
    # Saved at 12: dynamic synced at 10, stable not since 6; the instances differ in masters,
    # Adam moments, anchors, outer momentum and delta residuals, all in the checkpoint.
    resumed, _ = stop_and_resume(tmp_path, 4, _args(stdlib_data), run, save_at=12, extra_env=NODES)
    assert [r["iteration"] for r in resumed] == list(range(13, ITERS + 1))
    for key in ("grpo_tier_map", "grpo_outer_synced", "wire_bytes_outer", "wire_bytes_inter_node"):
        assert [r[key] for r in resumed] == [r[key] for r in run[12:]], key


def test_tensor_parallel_copies_stay_identical(stdlib_data, tmp_path):
    # TP 2 x DP 2, one instance per TP pair: replicated parameters (layernorms, row-parallel
    # biases) are held by both TP ranks and their deltas cross the instances exactly beside
    # the compressed payload; the run's own check compares the TP pairs every step and both
    # instances after every full sync.
    args = [*SMALL_MODEL, "--data-path", stdlib_data, "--train-iters", "16", "--eval-interval", "16",
            "--check-weight-hash-interval", "1", "--num-distributed-optimizer-instances", "2",
            "--tensor-model-parallel-size", "2", *PERIODIC,
            "--grpo-dynamic-sync-interval", "3", "--grpo-stable-interval", "4"]
    recs = train_and_read(tmp_path, "tp", 4, args, extra_env=NODES)
    assert all(r["weight_hash_ok"] for r in recs)
    synced = {r["iteration"]: r["grpo_outer_synced"] for r in recs if r.get("grpo_outer_synced")}
    # dynamic every 3 from 6, stable every 4 from 6, everything before the re-tier at 15 and
    # at the last iteration.
    assert synced == {9: "d", 10: "s", 12: "d", 14: "ds", 15: "d", 16: "ds"}, synced
    assert [r["iteration"] for r in recs if r["weight_hash_instance_only"] == 0] == [1, 2, 3, 4, 5, 6, 14, 16]
