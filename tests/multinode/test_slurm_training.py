"""The real sbatch script on a local 2-node SLURM cluster (network namespaces, gloo across a
bridge): both nodes train GRPO, a checkpoint is saved, a second job resumes it on both nodes,
and every result equals an uninterrupted 2-rank run on one machine, bit for bit."""

import os

import pytest

from megatron_grpo.bench.slurm_cluster import rank_logs
from harness import GRPO_SMALL, SMALL_MODEL, losses, read_metrics, run_training

pytestmark = pytest.mark.multinode

ITERS, EXIT_AT = 20, 14  # checkpoints every 4; the first job stops after 14 (last: 12)


@pytest.fixture(scope="module")
def jobs(sbatch, stdlib_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mn_train")
    # --log-interval 2: every rank prints a progress line every 2 iterations (per-rank logs).
    flags = [*SMALL_MODEL, *GRPO_SMALL, "--log-interval", "2", "--data-path", stdlib_data,
             "--train-iters", ITERS, "--eval-interval", 10, "--save", tmp / "ckpt",
             "--save-interval", 4]
    first, first_logs = sbatch(tmp, "first", [*flags, "--exit-after-iter", EXIT_AT,
                                              "--metrics-file", tmp / "first.jsonl"])
    assert first.state == "COMPLETED", first.output[-5000:]
    second, second_logs = sbatch(tmp, "second", [*flags, "--load", tmp / "ckpt",
                                                 "--metrics-file", tmp / "second.jsonl"])
    assert second.state == "COMPLETED", second.output[-5000:]
    # Reference: the same run uninterrupted, 2 ranks under torchrun on this machine (no SLURM).
    run_training(2, [*map(str, flags[:-4]), "--metrics-file", str(tmp / "ref.jsonl"),
                     "--data-cache-dir", str(tmp / "ref_cache")])
    return dict(tmp=tmp, first=first, second=second, ref=read_metrics(tmp / "ref.jsonl"),
                m1=read_metrics(tmp / "first.jsonl"), m2=read_metrics(tmp / "second.jsonl"),
                logs1=rank_logs(first_logs), logs2=rank_logs(second_logs))


def test_both_nodes_train_one_rank_each(jobs):
    for key, last in (("logs1", EXIT_AT), ("logs2", ITERS)):
        logs = jobs[key]
        assert sorted(host for _, host in logs) == ["n1", "n2"], logs.keys()
        assert sorted(rank for rank, _ in logs) == [0, 1]
        first = 2 if key == "logs1" else EXIT_AT  # the resumed job starts after iteration 12
        for entry in logs.values():
            assert entry["progress"] == list(range(first, last + 1, 2)), entry["progress"]
    assert "world 2 = TP 1 x PP 1 x DP 2, grpo=1" in jobs["first"].output
    assert "platform=gloo/cpu" in jobs["first"].output


def test_loss_falls_and_equals_the_single_machine_run(jobs):
    m1, ref = jobs["m1"], jobs["ref"]
    assert [r["iteration"] for r in m1] == list(range(1, EXIT_AT + 1))
    assert losses(m1)[-1] < 0.75 * losses(m1)[0], losses(m1)
    # Two "nodes" over a bridge compute exactly what two local ranks compute.
    assert losses(m1) == losses(ref)[:EXIT_AT]
    assert m1[9]["val_loss"] == ref[9]["val_loss"]


def test_checkpoint_saved_and_second_job_resumes_on_both_nodes(jobs):
    ckpt = jobs["tmp"] / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000004", "iter_0000008", "iter_0000012", "iter_0000016", "iter_0000020",
        "latest_checkpointed_iteration.txt"]
    assert "start_iter=12" in jobs["second"].output
    m2, ref = jobs["m2"], jobs["ref"]
    assert [r["iteration"] for r in m2] == list(range(13, ITERS + 1))
    # Same weights, optimizer state, data position, RNG and GRPO state: bit-identical.
    assert losses(m2) == losses(ref)[12:]
    assert m2[-1]["val_loss"] == ref[-1]["val_loss"]
    assert m2[-1]["consumed_samples"] == ITERS * 8
    for entry in jobs["logs2"].values():  # both nodes restored the tiers of iteration 12
        assert entry["maps"][0] == (13, jobs["m1"][11]["grpo_tier_map"])


def test_tier_maps_agree_on_both_nodes(jobs):
    for key, metrics in (("logs1", jobs["m1"]), ("logs2", jobs["m2"])):
        (_, a), (_, b) = sorted(jobs[key].items())
        assert a["maps"] == b["maps"]  # every change, at the same iteration, on both nodes
        # ...and equal to rank 0's metrics records, iteration by iteration.
        changes = dict(a["maps"])
        current = None
        for rec in metrics:
            current = changes.get(rec["iteration"], current)
            assert current == rec["grpo_tier_map"], rec["iteration"]
    maps = [m for _, m in jobs["logs1"][(0, "n1")]["maps"]]
    assert maps[0] == "c" * len(maps[0])  # exact warm-up, then a real three-tier plan
    assert {"c", "d", "s"} <= set(maps[1])
    assert [r["grpo_tier_map"] for r in jobs["m1"] + jobs["m2"][-(ITERS - EXIT_AT):]] == \
        [r["grpo_tier_map"] for r in jobs["ref"]]


def test_dataset_index_caches_are_node_local(jobs, stdlib_data):
    local = jobs["tmp"] / "local"
    for node in ("n1", "n2"):
        cache = local / f"megatron_grpo_data_cache.{node}"
        built = list(cache.rglob("*-document_index.npy"))
        assert len(built) == 2, built  # train and valid
    assert not os.path.exists(stdlib_data + "_cache")  # the shared default was not used
