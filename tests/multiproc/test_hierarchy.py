"""megatron's partial distributed optimizer (--num-distributed-optimizer-instances), with and
without GRPO, on 4 gloo ranks emulating 2 nodes of 2 (MEGATRON_GRPO_RANKS_PER_NODE=2: the wire
counter's link classes). Instances are nodes: GRPO compresses only the traffic between them.

What must hold: megatron's own hierarchy runs on CPU and sends a third of its bytes between
instances; with GRPO every copy of the model (all 4 ranks) ends every step with the same bytes
(the run's own weight-hash check, every iteration), the warm-up is megatron's sync bit for bit,
the traffic inside an instance is megatron's exact one, the traffic between instances shrinks,
and a resume is exact.
"""

import pytest

from harness import (GRPO_SMALL, SMALL_MODEL, assert_copies_agree, losses, run_probe, stop_and_resume,
                     train_and_read)

NODES = {"MEGATRON_GRPO_RANKS_PER_NODE": "2"}
HIER = ["--num-distributed-optimizer-instances", "2"]
CORE8 = ["--grpo-core-compressor", "int8"]
ITERS = 16


def _common(data):
    return [*SMALL_MODEL, "--data-path", data, "--train-iters", str(ITERS), "--eval-interval", str(ITERS),
            "--check-weight-hash-interval", "1"]


@pytest.fixture(scope="module")
def runs(stdlib_data, tmp_path_factory):
    from megatron_grpo.training.arguments import parse_args

    tmp = tmp_path_factory.mktemp("hier")
    common = _common(stdlib_data)
    # Like with like: the baselines get GRPO's buckets (sized from --grpo-bucket-mb), so the
    # warm-up comparison sums in the same order.
    size = parse_args([*common, *GRPO_SMALL], world_size=4).grpo.bucket_elements
    buckets = ["--ddp-bucket-size", str(size)]
    return {"bucket": size, "grpo_flags": [*common, *HIER, *GRPO_SMALL, *CORE8],
        "flat": train_and_read(tmp, "flat", 4, [*common, *buckets], extra_env=NODES),
        "hier": train_and_read(tmp, "hier", 4, [*common, *buckets, *HIER], extra_env=NODES),
        "grpo": train_and_read(tmp, "grpo", 4, [*common, *HIER, *GRPO_SMALL, *CORE8], extra_env=NODES),
    }


def test_megatron_hierarchy_sends_a_third_between_instances(runs):
    flat, hier = runs["flat"], runs["hier"]
    assert [r["iteration"] for r in hier] == list(range(1, ITERS + 1))
    assert all(r["weight_hash_ok"] for r in flat + hier)
    for f, h in zip(flat, hier):
        # Flat: the data-parallel group spans both nodes, so all of it is inter-node.
        assert f["wire_bytes_inter_node"] == f["wire_bytes"] > 0
        # Hierarchical: reduce-scatter (2 of 4 ranks) and all-gather stay inside the instance;
        # the shard's all-reduce across the 2 instances is the same size as each of them.
        # (plus a few bytes of scalar all-reduces: loss logging, the grad norm over the
        # instance.) Flat reduce-scatters 3/4 of a bucket per rank, hierarchical 1/2 of it.
        assert f["wire_bytes_grad_reduce"] * 2 == h["wire_bytes_grad_reduce"] * 3
        assert h["wire_bytes_param_gather"] == h["wire_bytes_grad_reduce"]
        assert 0 <= h["wire_bytes_inter_node"] - h["wire_bytes_grad_reduce"] < 64
        assert abs(h["wire_bytes"] - f["wire_bytes"]) < 64
    # Another summation order (reduce-scatter in 2, then all-reduce in 2): rounding only.
    assert losses(hier) == pytest.approx(losses(flat), rel=1e-4)


def test_grpo_between_instances_keeps_every_copy_identical(runs):
    hier, grpo = runs["hier"], runs["grpo"]
    assert [r["iteration"] for r in grpo] == list(range(1, ITERS + 1))
    # The run checks the weight hashes of all 4 copies at every iteration and stops on a mismatch.
    assert all(r["weight_hash_ok"] for r in grpo)
    tiered = [r for r in grpo if set(r["grpo_tier_map"]) != {"c"}]
    assert [r["iteration"] for r in tiered] == list(range(9, ITERS + 1))
    # The warm-up is megatron's own hierarchical sync: the same losses bit for bit, the same
    # bytes (GRPO adds its 4-byte control all-reduce).
    warm = grpo[:8]
    assert losses(warm) == losses(hier[:8])
    assert [r["wire_bytes"] - r["wire_bytes_grpo_control"] for r in warm] == [r["wire_bytes"] for r in hier[:8]]
    for g in tiered:
        h = hier[g["iteration"] - 1]
        # Inside an instance every unit reduce-scatters exactly, megatron's way (the only
        # reduce-scatters of the run: between instances GRPO uses all-to-all), except what a
        # frozen stable unit skips between its updates (every 4th iteration).
        if g["iteration"] % 4 == 0:
            assert g["wire_bytes_grad_reduce"] == h["wire_bytes_grad_reduce"], g["iteration"]
        else:
            assert 0 < g["wire_bytes_grad_reduce"] < h["wire_bytes_grad_reduce"], g["iteration"]
    # Between instances: core int8, dynamic int4, stable held (exact on its update steps).
    inter = sum(g["wire_bytes_inter_node"] for g in tiered) / sum(hier[g["iteration"] - 1]["wire_bytes_inter_node"]
                                                                  for g in tiered)
    assert inter < 0.25, inter  # 0.17 measured
    assert grpo[-1]["loss"] == pytest.approx(hier[-1]["loss"], rel=0.05)


def test_planner_predicts_the_inter_node_bytes(runs, stdlib_data):
    from megatron_grpo.planner.internode import internode
    from megatron_grpo.training.memory_budget import spec_from_flags

    flags = runs["grpo_flags"]
    model, cluster, grpo, bucket, _ = spec_from_flags(
        flags, nodes=2, gpus_per_node=2, gpu_memory_gb=1.0, link_gbps=1.0, vocab=258, attention="unfused")
    assert cluster.instances == 2
    hier = runs["hier"]
    base = internode(model, cluster, grpo, bucket_size=runs["bucket"])
    # The logging scalars (12 bytes) are not the planner's.
    assert [r["wire_bytes_inter_node"] - r["wire_bytes_logging"] for r in hier] == [base.hier_baseline] * ITERS
    assert base.flat_baseline == runs["flat"][0]["wire_bytes_grad_reduce"] + runs["flat"][0]["wire_bytes_param_gather"]
    checked = 0
    for r in runs["grpo"][8:]:
        t = internode(model, cluster, grpo, bucket_size=runs["bucket"], tiers=r["grpo_tier_map"])
        stable = t.hier_stable_update if r["iteration"] % 4 == 0 else 0
        # Steps without importance or health all-reduces: GRPO's only control traffic is the
        # skip flag, one float32 all-reduced over the whole job (4 ranks: 6 ring bytes, crossing
        # the nodes; over one instance it let a node skip alone).
        if r["wire_bytes_grpo_control"] == 6:
            assert r["wire_bytes_inter_node"] - r["wire_bytes_logging"] - 6 == \
                t.hier_core + t.hier_dynamic + stable
            checked += 1
    assert checked >= 5


def test_hierarchical_grpo_resume_is_bit_identical(stdlib_data, tmp_path, runs):
    # Instances 0 = one per node: 2 here (2 ranks per emulated node), as in the full run.
    common = [*_common(stdlib_data), "--num-distributed-optimizer-instances", "0", *GRPO_SMALL, *CORE8]
    full = runs["grpo"]
    resumed, proc = stop_and_resume(tmp_path, 4, common, full, save_at=10, extra_env=NODES)
    assert "distributed-optimizer instances: one per node -> 2" in proc.stdout
    assert [r["iteration"] for r in resumed] == list(range(11, ITERS + 1))
    assert [r["wire_bytes_inter_node"] for r in resumed] == [r["wire_bytes_inter_node"] for r in full[10:]]


def test_grpo_hierarchy_with_tensor_parallel_keeps_every_copy_identical(stdlib_data, tmp_path):
    # TP 2 x DP 2, one instance per TP pair (the tensor-parallel ranks of a node): layernorms and
    # row-parallel biases are held by both TP ranks and cross the instances exactly beside the
    # compressed payload. Every copy (both instances, both TP ranks) keeps the same bytes.
    probe = run_probe(tmp_path, 4, [*_common(stdlib_data), *HIER, *GRPO_SMALL, *CORE8,
                                    "--tensor-model-parallel-size", "2", "--train-iters", "12",
                                    "--eval-interval", "12", "--eval-iters", "0"])
    assert_copies_agree(probe, "d", tp_replicated=True)
    assert all("c" in rank[-1]["tiers"] for rank in probe["ranks"])
