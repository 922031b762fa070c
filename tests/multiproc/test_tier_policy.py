"""The ablation settings on 2 real ranks: a random tier policy redraws the map at every re-tier
(the same on every rank: weights stay bit-identical) and an importance-score variant trains."""

from harness import GRPO_SMALL, SMALL_MODEL, train_and_read

ITERS = ["--train-iters", "22", "--check-weight-hash-interval", "2"]


def test_random_policy_redraws_and_ranks_agree(tmp_path, stdlib_data):
    recs = train_and_read(tmp_path, "random", 2, ["--data-path", stdlib_data, *SMALL_MODEL,
                                                   *GRPO_SMALL, *ITERS, "--grpo-tier-policy", "random",
                                                   "--grpo-importance-score", "fisher"])
    maps = {r["iteration"]: r["grpo_tier_map"] for r in recs}
    # Tiered at iteration 9 (the first stable boundary after the 6 warm-up steps), re-tiered at
    # iteration 17: each re-tier's fresh draw gives another map; shares stay near the quotas.
    changes = [i for i in range(2, 23) if maps[i] != maps[i - 1]]
    assert changes[0] == 9 and len(changes) >= 2, maps
    assert all(r["weight_hash_ok"] for r in recs if "weight_hash_ok" in r)
    assert len([r for r in recs if "weight_hash_ok" in r]) == 11
    tiered = [r for r in recs if r["grpo_tiered"]]
    assert all(0.1 <= r["grpo_share_stable"] <= 0.3 for r in tiered), [r["grpo_share_stable"] for r in tiered]
