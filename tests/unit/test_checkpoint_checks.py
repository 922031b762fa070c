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
