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


# -- which checkpoint --load resumes from; what a save may replace ---------------

from megatron_grpo.training.safety import checkpoint_dirs  # noqa: E402
from megatron_grpo.training.safety.checkpoint_dirs import USE_TRACKER, replace_problem, resume_decision, run_saves  # noqa: E402
from megatron_grpo.training.checkpointing import write_manifest  # noqa: E402


def _ckpt(root, it, damaged=False):
    """A verified iter_N (one file and its manifest); ``damaged``: a byte flipped afterwards."""
    d = root / f"iter_{it:07d}"
    d.mkdir(parents=True)
    (d / "common.pt").write_bytes(bytes([it % 256]) * 64)
    write_manifest(str(d), it, 2, [1, 1], None)
    if damaged:
        (d / "common.pt").write_bytes(bytes([(it + 1) % 256]) * 64)
    return d


def test_a_missing_tracker_resumes_from_the_newest_verified_directory(tmp_path):
    for it in (5, 10, 15, 20):
        _ckpt(tmp_path, it)
    (tmp_path / "iter_0000025.tmp").mkdir()  # a crashed save: never a candidate
    for fresh_ok in (True, False):
        what, warning = resume_decision(str(tmp_path), fresh_ok)
        assert what == 20
        assert warning == (f"WARNING: --load {tmp_path}: no {TRACKER}, but {tmp_path}/iter_0000020 is a "
                           f"complete checkpoint (its manifest verified: every file's size and CRC32); "
                           f"resuming from iteration 20, the newest of 4 iter_* directories (a job killed "
                           f"between a save's rename and its tracker write leaves this).")


def test_a_tracker_older_than_a_verified_directory_is_passed_over(tmp_path):
    for it in (5, 10, 15):
        _ckpt(tmp_path, it)
    _ckpt(tmp_path, 20, damaged=True)
    (tmp_path / TRACKER).write_text("10")
    what, warning = resume_decision(str(tmp_path), True)
    assert what == 15
    assert warning.startswith(f"WARNING: --load {tmp_path}: {TRACKER} names iteration 10, but "
                              f"{tmp_path}/iter_0000015 is newer and complete"), warning
    assert f"To resume from iteration 10 instead, move the newer iter_* directories out of {tmp_path}." in warning
    assert (f"Passed over, as they fail verification: iter_0000020 (checkpoint file "
            f"{tmp_path}/iter_0000020/common.pt is corrupted") in warning
    # Nothing newer than the tracker verifies: the tracker's, saying what was passed over.
    (tmp_path / TRACKER).write_text("15")
    what, warning = resume_decision(str(tmp_path), True)
    assert what == USE_TRACKER and warning.startswith(
        f"WARNING: --load {tmp_path}: resuming from iteration 15, which {TRACKER} names. Passed over")
    (tmp_path / TRACKER).write_text("20")  # the tracker's own directory: load_checkpoint verifies it
    assert resume_decision(str(tmp_path), True) == (USE_TRACKER, None)
    (tmp_path / TRACKER).write_text("1x6")  # load_checkpoint names the bad tracker
    assert resume_decision(str(tmp_path), True) == (USE_TRACKER, None)


def test_nothing_verified_starts_fresh_only_in_the_save_directory(tmp_path):
    assert resume_decision(str(tmp_path), True) == (None, None)
    assert resume_decision(str(tmp_path), False) == (USE_TRACKER, None)  # --load elsewhere: an error
    _ckpt(tmp_path, 5, damaged=True)
    what, warning = resume_decision(str(tmp_path), True)
    assert what is None and warning.startswith(
        f"WARNING: --load {tmp_path}: no {TRACKER} and no iter_* directory there verifies; starting "
        f"from scratch. Passed over, as they fail verification: iter_0000005 (")


def test_verified_directories_are_never_replaced_unless_asked(tmp_path):
    root = str(tmp_path)
    for it in (5, 10, 15, 20):
        _ckpt(tmp_path, it)
    _ckpt(tmp_path, 25, damaged=True)
    assert list(run_saves(0, 24)) == list(range(1, 25)) and list(run_saves(0, 0)) == [0]
    assert list(run_saves(20, 24)) == [21, 22, 23, 24] and list(run_saves(24, 24)) == []
    assert replace_problem(root, run_saves(0, 24), False) == (
        f"--save {root}: this run (iterations 1-24) would replace complete, verified checkpoints there: "
        f"iter_0000005, iter_0000010, iter_0000015, iter_0000020 (iter_0000020 verified). Checkpoints are "
        f"never overwritten unless asked: resume from them with --load {root}, point --save at another "
        f"directory, or pass --overwrite-checkpoints to replace them")
    assert replace_problem(root, run_saves(0, 24), True) is None  # --overwrite-checkpoints
    assert replace_problem(root, run_saves(20, 30), False) is None  # only the damaged iter_0000025
    assert replace_problem(root, range(10, 11), False).startswith(
        f"--save {root}: this run (iteration 10) would replace complete, verified checkpoints there: "
        f"iter_0000010 (iter_0000010 verified)")
    assert checkpoint_dirs.iteration_dirs(root) == [5, 10, 15, 20, 25]
