"""A save or a resume that runs out of file descriptors (EMFILE: the process's `ulimit -n`;
ENFILE: the node's table) names that limit, its value, the rank and how to raise it, however
torch and megatron wrapped the errno; it is not reported as a full or read-only disk ("Free space
on its filesystem or make it writable"), which would send the user looking in the wrong place."""

import contextlib
import errno
import gc
import io
import os
import pickle
import resource

import pytest
import torch

from megatron_grpo.training import checkpointing
from megatron_grpo.training.checkpointing import CheckpointError
from megatron_grpo.training.safety import save_errors

DISK = "Free space on its filesystem or make it writable"


def _limit_said(text: str, soft=None) -> None:
    """``text`` names the open-file limit (``soft``: the one in force when it was written)."""
    now, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = now if soft is None else soft
    assert f"`ulimit -n` is {soft}" in text and f"hard limit {hard}" in text, text
    assert "EMFILE, errno 24" in text and "`ulimit -n 65536` in the sbatch script" in text, text
    assert DISK not in text, text


def _emfile(path="/ckpt/iter_0000008.tmp/__0_0.distcp"):
    return OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)


def test_emfile_names_the_open_file_limit_not_the_disk():
    said = save_errors.what_to_do(_emfile(), 0)
    _limit_said(said)
    assert said.startswith("This process has reached its open-file limit"), said
    assert save_errors.out_of_files(_emfile(), 3) == {3: errno.EMFILE}


def test_enfile_names_the_nodes_table():
    said = save_errors.what_to_do(OSError(errno.ENFILE, os.strerror(errno.ENFILE)), 0)
    assert said.startswith("The node's open-file table is full (ENFILE, errno 23"), said
    assert "sysctl fs.file-max" in said and DISK not in said, said


def test_a_wrapped_emfile_is_found_through_cause_and_context():
    def wrapped(link):  # megatron: raise RuntimeError(f"Worker failure: {exc}") from exc
        try:
            try:
                raise _emfile()
            except OSError as exc:
                if link == "cause":
                    raise RuntimeError("Worker failure: the writer stopped") from exc
                raise KeyError("a later step")  # only __context__ links the two
        except Exception as outer:  # noqa: BLE001
            return outer
    for link in ("cause", "context"):
        exc = wrapped(link)
        assert save_errors.out_of_files(exc, 0) == {0: errno.EMFILE}, link
        _limit_said(save_errors.what_to_do(exc, 0))


def test_torch_and_other_ranks_failures_are_read_from_their_text():
    from torch.distributed.checkpoint import CheckpointException

    # torch's zip writer: no errno, only the strerror.
    zip_writer = RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: "
                              "Too many open files")
    assert save_errors.out_of_files(zip_writer, 0) == {0: errno.EMFILE}
    # Another rank's failure arrives pickled: its __cause__ (the OSError) is gone.
    try:
        raise RuntimeError(f"Worker failure: {_emfile()}") from _emfile()
    except RuntimeError as exc:
        remote = pickle.loads(pickle.dumps(exc))
    assert remote.__cause__ is None
    exc = CheckpointException("save failed", {
        1: (remote, None), 2: (RuntimeError(f"Worker failure: {OSError(errno.ENFILE, os.strerror(errno.ENFILE))}"), None),
        3: (RuntimeError("Worker failure: [Errno 28] No space left on device"), None)})
    assert save_errors.out_of_files(exc, 0) == {1: errno.EMFILE, 2: errno.ENFILE}
    said = save_errors.what_to_do(exc, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert said.startswith("The open-file table of the node of rank 2 is full (ENFILE, errno 23"), said
    assert (f"rank 1 reached its open-file limit (EMFILE, errno 24: Too many open files; `ulimit -n` is {soft} "
            f"on rank 0, hard limit {hard})") in said, said
    assert said.endswith("for rank 3: free space on its filesystem or make it writable (or point --save "
                         "elsewhere)"), said


def test_a_disk_failure_keeps_the_disk_advice():
    assert save_errors.what_to_do(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 0).startswith(DISK)
    assert save_errors.out_of_files(OSError(errno.EROFS, os.strerror(errno.EROFS)), 0) == {}


@contextlib.contextmanager
def no_descriptors_left():
    """Every descriptor this process may open is taken (a lowered soft limit, filled), as in a
    save of many tensors; yields that limit. Limit and descriptors are given back on leaving."""
    gc.collect()  # a file an earlier test left to the collector, closed while filled, frees one
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    lowered = min(soft, in_use + 64)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    taken = []
    try:
        with pytest.raises(OSError) as full:
            while True:
                taken.append(os.open(os.devnull, os.O_RDONLY))
        assert full.value.errno == errno.EMFILE
        yield lowered
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_save_out_of_descriptors_names_the_limit(tmp_path, gloo_group, monkeypatch):
    from megatron_grpo.training.safety import divergence

    root = str(tmp_path / "ckpt")
    torch.save({"warm": torch.zeros(1)}, io.BytesIO())  # torch's lazy imports open files too

    def write(root, iteration):  # the per-rank RNG file of _save_checkpoint, out of descriptors
        tmp = checkpointing.iteration_dir(root, iteration) + ".tmp"
        os.makedirs(tmp)
        with no_descriptors_left():
            torch.save({"rng": torch.zeros(4)}, os.path.join(tmp, "rng.pt"))
    monkeypatch.setattr(divergence, "nonfinite_weights_problem", lambda root, iteration, built: None)
    monkeypatch.setattr(checkpointing, "_save_checkpoint",
                        lambda root, iteration, built, common, extra, record: write(root, iteration))
    with pytest.raises(CheckpointError) as err:  # was: torch's RuntimeError, unexplained
        checkpointing.save_checkpoint(root, 8, None, {})
    said = str(err.value)
    assert said.startswith(f"--save {root}: saving iteration 8 failed on rank 0 (RuntimeError: "), said
    assert "Too many open files). This process has reached its open-file limit" in said, said
    assert said.endswith("; it holds no complete checkpoint."), said
    _limit_said(said)


@pytest.mark.parametrize("form", ["OSError", "wrapped"])
def test_a_save_whose_errno_came_bare_or_wrapped_names_the_limit(form, tmp_path, gloo_group, monkeypatch):
    from megatron_grpo.training.safety import divergence

    def write(root, iteration):  # was: "Free space on its filesystem", or the RuntimeError re-raised
        if form == "OSError":
            raise _emfile()
        raise RuntimeError(f"Worker failure: {_emfile()}") from _emfile()
    monkeypatch.setattr(divergence, "nonfinite_weights_problem", lambda root, iteration, built: None)
    monkeypatch.setattr(checkpointing, "_save_checkpoint",
                        lambda root, iteration, built, common, extra, record: write(root, iteration))
    with pytest.raises(CheckpointError) as err:
        checkpointing.save_checkpoint(str(tmp_path / "ckpt"), 8, None, {})
    _limit_said(str(err.value))


def test_a_resume_out_of_descriptors_names_the_limit(tmp_path):
    import megatron.core.dist_checkpointing  # noqa: F401 - imported by the load: opens files

    root = tmp_path / "ckpt"
    root.mkdir()
    (root / checkpointing.TRACKER).write_text("8\n")
    with no_descriptors_left() as soft:
        with pytest.raises(CheckpointError) as err:  # was: a bare OSError
            checkpointing.load_checkpoint(str(root), None)
    with no_descriptors_left():  # filled again: the first failure may have let a descriptor go
        with pytest.raises(CheckpointError) as init:
            checkpointing.load_model_weights(str(root), None)
    said = str(err.value)
    assert said.startswith(f"--load {root}: reading the checkpoint failed on rank 0 (OSError: [Errno 24] "
                           f"Too many open files: "), said
    assert said.endswith("a load writes nothing, so the checkpoint is as it was: run again with the same "
                         "--load."), said
    assert "tracker" in said or checkpointing.TRACKER in said, said  # the read of the resume itself
    _limit_said(said, soft)
    assert str(init.value).startswith(f"--init-from {root}: reading the checkpoint failed on rank 0 "), init.value
    _limit_said(str(init.value), soft)
