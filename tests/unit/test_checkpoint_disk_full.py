"""A checkpoint save that fills the disk says "no space left on <--save>",
whether the kernel's ENOSPC reached us or torch.save's zip writer turned it into "unexpected pos
704 vs 598". A real full filesystem: a small tmpfs (root only; skipped elsewhere)."""

import gc
import os
import re

import pytest
import torch

from megatron_grpo.training import checkpointing
from megatron_grpo.training.checkpointing import CheckpointError

TAIL = ("Free space on its filesystem or make it writable (or point --save elsewhere); it holds no "
        "complete checkpoint.")


def _fill(disk):
    with pytest.raises(OSError):
        with open(disk / "filler", "wb") as fh:
            fh.write(b"x" * (1 << 20))


def _saving_with(monkeypatch, write):
    """save_checkpoint with its writer replaced by ``write(root, iteration)`` (no model needed:
    the weights check is skipped, the directory check runs)."""
    from megatron_grpo.training.safety import divergence

    monkeypatch.setattr(divergence, "nonfinite_weights_problem", lambda root, iteration, built: None)
    monkeypatch.setattr(checkpointing, "_save_checkpoint",
                        lambda root, iteration, built, common, extra, record: write(root, iteration))


def test_torch_save_on_a_full_disk_says_no_space_left(tmp_path, tmpfs, gloo_group, monkeypatch):
    disk = tmp_path / "disk"
    with tmpfs(disk, "64k"):
        root = str(disk / "ckpt")

        def write(root, iteration):  # the per-rank RNG file of _save_checkpoint, on a full disk
            tmp = checkpointing.iteration_dir(root, iteration) + ".tmp"
            os.makedirs(tmp)
            _fill(disk)
            torch.save({"rng": torch.zeros(1 << 16)}, os.path.join(tmp, "rng.pt"))
        _saving_with(monkeypatch, write)
        with pytest.raises(CheckpointError) as err:
            checkpointing.save_checkpoint(root, 8, None, {})
        said = str(err.value)
        del err  # its traceback holds torch's open zip writer: the tmpfs could not be unmounted
        gc.collect()
    m = re.fullmatch(rf"--save {re.escape(root)}: saving iteration 8 failed on rank 0 \(no space left on "
                     rf"{re.escape(root)}: (\d+) bytes free after the failure; RuntimeError: \[enforce fail "
                     rf"at inline_container.cc:\d+\] . unexpected pos \d+ vs \d+\). {re.escape(TAIL)}", said)
    assert m is not None, said
    from megatron_grpo.training.safety import save_errors

    assert int(m.group(1)) < save_errors.FULL_BELOW_BYTES


def test_a_writer_failure_on_every_rank_says_no_space_left(tmp_path, tmpfs, gloo_group, monkeypatch):
    from torch.distributed.checkpoint import CheckpointException

    disk = tmp_path / "disk"
    with tmpfs(disk, "64k"):
        _fill(disk)
        root = str(disk / "ckpt")

        def write(root, iteration):  # dist_checkpointing's coordinator: each rank's cause
            raise CheckpointException("save failed", {
                0: (RuntimeError("Worker failure: [Errno 28] No space left on device"), None),
                1: (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), None)})
        _saving_with(monkeypatch, write)
        with pytest.raises(CheckpointError) as err:
            checkpointing.save_checkpoint(root, 8, None, {})
    assert str(err.value) == (
        f"--save {root}: saving iteration 8 failed on rank 0 (no space left on {root}: 0 bytes free "
        f"after the failure; rank 0: Worker failure: [Errno 28] No space left on device; "
        f"rank 1: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598). {TAIL}")


def test_a_zip_writer_failure_with_room_left_is_not_called_a_full_disk(tmp_path, gloo_group, monkeypatch):
    root = str(tmp_path / "ckpt")

    def write(root, iteration):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    _saving_with(monkeypatch, write)
    with pytest.raises(CheckpointError) as err:
        checkpointing.save_checkpoint(root, 8, None, {})
    from megatron_grpo.training.safety import save_errors

    free = save_errors.free_bytes(root)
    assert free >= save_errors.FULL_BELOW_BYTES  # this test's premise: tmp has room
    said = str(err.value)
    assert said.startswith(f"--save {root}: saving iteration 8 failed on rank 0 (RuntimeError: [enforce fail at "
                           f"inline_container.cc:672] . unexpected pos 704 vs 598; a write failed with ")
    assert re.search(rf"with \d+ bytes free on {re.escape(root)} after the failure, so not for lack of space "
                     rf"\(a quota, an I/O error\)\)\. ", said), said


def test_another_runtime_error_in_a_save_is_not_swallowed(tmp_path, gloo_group, monkeypatch):
    def write(root, iteration):
        raise RuntimeError("a bug")
    _saving_with(monkeypatch, write)
    with pytest.raises(RuntimeError, match="^a bug$"):
        checkpointing.save_checkpoint(str(tmp_path / "ckpt"), 8, None, {})
