"""The checkpoint checks that need no model: manifest shape (verify_checkpoint) and the --save
write probe (save_dir_problem). Without a process group the messages say rank 0."""

import json

import pytest

from megatron_grpo.training.checkpointing import (MANIFEST, TRACKER, CheckpointError, save_dir_problem,
                                                  verify_checkpoint)

WHAT_TO_DO = f"The checkpoint is damaged: load an earlier iter_* directory by writing its iteration into {TRACKER}."


@pytest.mark.parametrize("manifest, problem", [
    ({}, "no 'iteration' and no 'files' key (keys found: none)"),
    ({"iteration": 4, "file": {}}, "no 'files' key (keys found: 'file', 'iteration')"),
    ([1, 2], "expected a JSON object, got [1, 2]"),
    ({"iteration": "4", "files": {}}, "'iteration' is \"4\", not an integer"),
    ({"iteration": 4, "files": []}, "'files' is [], not an object of file name -> size and crc32"),
    ({"iteration": 4, "files": {"common.pt": {"size": 3}}},
     "the entry of 'common.pt' is {\"size\": 3}, not {\"size\": int, \"crc32\": int}"),
])
def test_manifest_of_another_shape_is_a_checkpoint_error(tmp_path, manifest, problem):
    path = tmp_path / MANIFEST
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(str(tmp_path))
    assert str(err.value) == f"{path} is not a checkpoint manifest (rank 0): {problem}. {WHAT_TO_DO}"
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST]  # nothing written


def test_a_manifest_of_the_saved_shape_passes(tmp_path):
    (tmp_path / "common.pt").write_bytes(b"abc")
    (tmp_path / MANIFEST).write_text(json.dumps(
        {"iteration": 4, "files": {"common.pt": {"size": 3, "crc32": 891568578}}}))
    assert verify_checkpoint(str(tmp_path))["iteration"] == 4


def test_save_dir_probe(tmp_path):
    fresh = tmp_path / "a" / "b"
    assert save_dir_problem(str(fresh)) is None
    assert fresh.is_dir() and list(fresh.iterdir()) == []  # created, probe file removed
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    assert save_dir_problem(str(blocker / "ckpt")) == f"[Errno 20] Not a directory: '{blocker / 'ckpt'}'"
    assert blocker.read_text() == "x"


def test_another_instance_count_is_refused_on_load_with_the_way_out():
    # GRPO's residuals between distributed-optimizer instances have the shard's length and the
    # optimizer state is sharded inside an instance: a resume needs the count it was written with.
    from megatron_grpo.data.tokenizer import ByteTokenizer
    from megatron_grpo.training.arguments import parse_args
    from megatron_grpo.training.checkpointing import bucket_layout, check_record, model_record

    def record(instances):
        cfg = parse_args(["--data-path", "x", "--grpo", "--num-distributed-optimizer-instances",
                          str(instances), "--global-batch-size", "16"], world_size=4)
        return model_record(cfg, ByteTokenizer(), 384, bucket_layout(cfg, 40000, 4))

    flat, hier = record(1), record(2)
    assert "distributed_optimizer_instances" not in flat["optimizer_buckets"]  # earlier records match
    assert hier["optimizer_buckets"]["distributed_optimizer_instances"] == 2
    check_record("--load", "ck", {"model": hier}, record(2))
    with pytest.raises(CheckpointError, match=r"--load ck \(rank 0\): the distributed optimizer's state is "
                                              r"saved per DDP bucket.*Resume with "
                                              r"--num-distributed-optimizer-instances 2, as it was written"):
        check_record("--load", "ck", {"model": hier}, flat)
