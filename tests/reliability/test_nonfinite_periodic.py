"""NaN and Inf in one gradient element on one rank of one node while GRPO's tiers train locally
(4 ranks as 2 distributed-optimizer instances; the dynamic tier syncs its deltas every 3 steps:
9, 12, 15; the stable tier is local, synced every 4: 10, 14, and everything before the re-tier at
15 and at the end).

The poisoned gradient reaches only rank 1's node: a periodic unit's gradients never cross the
nodes. The step must still be skipped on all 4 ranks -- megatron's own found-inf flag is taken
over one instance, and a node that stepped while the other skipped would diverge and, at a sync,
issue collectives the other does not. A sync due at a skipped step happens at the next applied
one. The run's weight check (every iteration) keeps every copy identical as scoped."""

import math

from harness import GRPO_SMALL, SMALL_MODEL, read_metrics
from reliability_harness import run_job

GROUP = "NaN/Inf in a gradient of each tier"
PERIODIC = ["--num-distributed-optimizer-instances", "2", "--grpo-dynamic-sync-interval", "3",
            "--grpo-stable-mode", "local", "--grpo-stable-interval", "4"]
# 12: a dynamic sync step (its sync moves to 13); 10: a stable sync step (moves to 11).
INJECT = {10: ("stable", "inf"), 12: ("dynamic", "nan")}
ITERS = 16


def test_nonfinite_in_a_local_tier_skips_the_step_on_every_node(stdlib_data, tmp_path, table):
    metrics = str(tmp_path / "m.jsonl")
    job = run_job(tmp_path / "job", 4, [*SMALL_MODEL, *GRPO_SMALL, *PERIODIC, "--data-path", stdlib_data,
                                        "--train-iters", ITERS, "--eval-iters", "0", "--eval-interval",
                                        ITERS, "--check-weight-hash-interval", "1", "--metrics-file", metrics],
                  faults=[f"nonfinite:{k}:{t}:{v}" for k, (t, v) in INJECT.items()],
                  extra_env={"MEGATRON_GRPO_RANKS_PER_NODE": "2"})
    assert job.rc == 0, job.text[-4000:]
    m = read_metrics(metrics)
    assert [r["iteration"] for r in m if r["skipped"]] == sorted(INJECT)
    assert all(r["weight_hash_ok"] for r in m) and all(math.isfinite(r["loss"]) for r in m)
    for k, (tier, _) in INJECT.items():
        for rank in range(4):
            rec = job.records(rank)[k - 1]
            assert rec["skipped"] and rec["before"]["params"] == rec["after"]["params"], (k, rank)
            assert rec["injected"]["tier"] == tier and rec["tiers"][rec["injected"]["unit"]] == tier[0]
        assert job.records(1)[k - 1]["fired"]
    synced = {r["iteration"]: r["grpo_outer_synced"] for r in m if r.get("grpo_outer_synced")}
    # The syncs of the skipped steps 10 (stable) and 12 (dynamic) happen at 11 and 13.
    assert synced == {9: "d", 11: "s", 13: "d", 14: "ds", 15: "d", 16: "ds"}, synced
    table.row(GROUP, "NaN / Inf in one gradient element on rank 1 (node 0 of 2), in a unit that "
                     f"trains locally (stable at {min(INJECT)}, dynamic at {max(INJECT)}; periodic tiers, "
                     f"4 ranks)",
              "step skipped on all 4 ranks, both nodes; the due sync happens at the next step",
              f"skipped on every rank at {sorted(INJECT)}, parameters unchanged there; syncs at "
              f"{sorted(synced)}; weight hashes equal every iteration")
