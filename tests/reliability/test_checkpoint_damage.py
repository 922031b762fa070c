"""Corrupt and truncated checkpoint files: --load refuses with an error naming the file (and the
rank), before reading any state, and leaves every byte on disk as it was.

Each damage is tried in-process on a copy of the reference run's checkpoints, through
checkpointing.load_checkpoint (what run() calls for --load): it verifies the tracker and the
manifest before it touches the model, so no model is needed. One damage also goes through the
launcher on 2 ranks, for the exit code and the message format. (tests/multiproc/test_checkpoint.py
already covers a flipped byte in a .distcp through the launcher and an iter_N.tmp left by a save.)
"""

import shutil

import pytest

from reliability_harness import rank_errors, run_job, tree_digest
from megatron_grpo.training import checkpointing
from megatron_grpo.training.checkpointing import MANIFEST, TRACKER, CheckpointError

GROUP = "Corrupt and truncated checkpoint files"
IT = "iter_0000016"


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep(len(data))])
    return f"{path.stat().st_size} of {len(data)} bytes kept"


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return f"byte {len(data) // 2} of {len(data)} flipped"


def _distcp(root):
    return sorted((root / IT).glob("*.distcp"))[0]


# name -> (damage(root) -> (path the error must name, what was done))
DAMAGE = {
    "distcp truncated to half": lambda r: (_distcp(r), _truncate(_distcp(r), lambda n: n // 2)),
    "common.pt truncated to 0 bytes": lambda r: (r / IT / "common.pt", _truncate(r / IT / "common.pt", lambda n: 0)),
    "rank 1 RNG file short by 1 byte": lambda r: (r / IT / "rng" / "rank_00001.pt",
                                                  _truncate(r / IT / "rng" / "rank_00001.pt", lambda n: n - 1)),
    ".metadata with one byte flipped": lambda r: (r / IT / ".metadata", _flip(r / IT / ".metadata")),
    "a distcp file deleted": lambda r: (_distcp(r), _distcp(r).unlink() or "deleted"),
    "manifest truncated to half": lambda r: (r / IT / MANIFEST, _truncate(r / IT / MANIFEST, lambda n: n // 2)),
    "manifest deleted": lambda r: (r / IT / MANIFEST, (r / IT / MANIFEST).unlink() or "deleted"),
    "manifest replaced by valid JSON of another shape ({})": lambda r: (
        r / IT / MANIFEST, (r / IT / MANIFEST).write_text("{}") and "2 bytes: {}"),
    "tracker holds '1x6'": lambda r: (r / TRACKER, (r / TRACKER).write_text("1x6") and "'1x6'"),
    "tracker empty": lambda r: (r / TRACKER, _truncate(r / TRACKER, lambda n: 0)),
    "tracker names iteration 20 (no such directory)": lambda r: (
        r / "iter_0000020", (r / TRACKER).write_text("20") and "'20'"),
    # the message names the --load directory and the tracker's file name
    "tracker deleted": lambda r: (f"{r}: no {TRACKER}", (r / TRACKER).unlink() or "deleted"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(reference, tmp_path, table, name):
    root = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], root)
    named, done = DAMAGE[name](root)
    before = tree_digest(root)
    try:
        checkpointing.load_checkpoint(str(root), built=None)
        raised = None
    except Exception as exc:  # noqa: BLE001 - which exception it is, is the finding
        raised = exc
    assert raised is not None, "a damaged checkpoint was accepted"
    assert tree_digest(root) == before, "loading changed the checkpoint directory"
    clear = isinstance(raised, CheckpointError) and str(named) in str(raised) and "rank 0" in str(raised)
    happened = f"{type(raised).__name__}: {raised}".replace(str(tmp_path) + "/", "")
    expected = "CheckpointError naming the file and rank; directory unchanged (sha256 of every file)"
    assert clear, f"unclear error for {name}: {happened}"
    table.row(GROUP, f"{name} ({done})", expected, f"{happened}; directory unchanged")


def test_truncated_shard_through_the_launcher(reference, tmp_path, table):
    root = tmp_path / "ckpt"
    shutil.copytree(reference["ckpt"], root)
    target = _distcp(root)
    done = _truncate(target, lambda n: n // 2)
    before = tree_digest(root)
    job = run_job(tmp_path / "job", 2, [*reference["args"], "--load", root, "--save", root],
                  probe=False, timeout=180)
    assert job.rc not in (0, None), job.text[-4000:]
    errors = rank_errors(job.err)
    for rank in (0, 1):
        said = errors.get(rank, "")
        assert f"checkpoint file {target} is corrupted" in said and f"rank {rank})" in said, job.err[-4000:]
    assert tree_digest(root) == before
    assert not job.leftovers
    said = errors[1].replace(str(tmp_path) + "/", "")
    table.row(GROUP, f"torchrun, 2 ranks, --load = --save = a checkpoint whose {target.name} was "
                     f"truncated ({done})",
              "non-zero exit, every rank names the file; nothing on disk touched",
              f"torchrun rc {job.rc} after {job.seconds:.0f} s; each rank printed e.g. \"{said}\" (each rank "
              f"exits 2); checkpoint directory unchanged, nothing written")
