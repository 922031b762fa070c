"""Which checkpoint --load resumes from, and which iter_* directories a run may replace.

The tracker (``latest_checkpointed_iteration.txt``) is written after a save's rename, so a job
killed between the two leaves a complete, verified ``iter_N`` that the tracker does not name
(no tracker at all after a first save). Trusting the tracker alone, the requeued job started
from scratch, or from the older iteration, and its saves then replaced the newer directories.

* ``resume_decision``: the newest ``iter_*`` whose manifest verifies (every file's size and
  CRC32), when the tracker is missing or older, with a WARNING that says so. Only directories
  newer than the tracker are verified here, newest first, stopping at the first good one; the
  one that is loaded is verified again by ``load_checkpoint`` on every rank.
* ``replace_problem``: a verified ``iter_*`` directory is never replaced unless the run was
  given --overwrite-checkpoints. Checked at start for every iteration the run may save (before
  training, not at its first save) and again at each save.

This module also owns the names and the check that say what a checkpoint directory is (the
tracker, the manifest, ``iter_N``, ``verify_checkpoint``): the writer and reader
(training/checkpointing.py) import them from here, so neither module imports the other.

Rank 0 reads the directory and broadcasts what it found: ranks on other nodes may see a
shared filesystem with some delay, and ranks that decided differently would load different
checkpoints or leave some of them waiting in a collective.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "megatron_grpo_manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and what to do."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def files_under(root: str) -> List[str]:
    out = []
    for base, _, files in os.walk(root):
        for name in files:
            if name != MANIFEST:
                out.append(os.path.relpath(os.path.join(base, name), root))
    return sorted(out)


def verify_checkpoint(ckpt_dir: str) -> Dict:
    """Check every file listed in the manifest (size and CRC32). Returns the manifest."""
    manifest_path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{manifest_path} is missing (rank {_rank()}): the checkpoint is "
                              f"incomplete. Load an earlier iter_* directory by writing its iteration "
                              f"into {TRACKER}.")
    try:
        manifest = json.load(open(manifest_path))
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path} is not valid JSON (rank {_rank()}): {exc}") from None
    problem = _manifest_shape_problem(manifest)
    if problem:
        raise CheckpointError(f"{manifest_path} is not a checkpoint manifest (rank {_rank()}): "
                              f"{problem}. The checkpoint is damaged: load an earlier iter_* directory "
                              f"by writing its iteration into {TRACKER}.")
    for name, info in manifest["files"].items():
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing (rank {_rank()}); the "
                                  f"checkpoint is damaged, load an earlier one.")
        if os.path.getsize(path) != info["size"] or crc32(path) != info["crc32"]:
            raise CheckpointError(f"checkpoint file {path} is corrupted (size/CRC32 differ from "
                                  f"{MANIFEST}; rank {_rank()}); load an earlier checkpoint.")
    return manifest


def _manifest_shape_problem(manifest) -> Optional[str]:
    """What is wrong with the shape save_checkpoint writes (an object with an integer
    ``iteration`` and ``files``: name -> {size, crc32} integers), or None."""
    def text(value) -> str:
        shown = json.dumps(value)
        return shown if len(shown) <= 80 else shown[:77] + "..."

    if not isinstance(manifest, dict):
        return f"expected a JSON object, got {text(manifest)}"
    missing = [f"'{key}'" for key in ("iteration", "files") if key not in manifest]
    if missing:
        has = ", ".join(f"'{k}'" for k in sorted(manifest)) or "none"
        return f"no {' and no '.join(missing)} key (keys found: {has})"
    if not isinstance(manifest["iteration"], int):
        return f"'iteration' is {text(manifest['iteration'])}, not an integer"
    if not isinstance(manifest["files"], dict):
        return f"'files' is {text(manifest['files'])}, not an object of file name -> size and crc32"
    for name, info in manifest["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("size"), int)
                and isinstance(info.get("crc32"), int)):
            return f"the entry of {name!r} is {text(info)}, not {{\"size\": int, \"crc32\": int}}"
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0



USE_TRACKER = "tracker"
"""``resume_decision``: load what the tracker names (load_checkpoint reports any problem)."""

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iteration_dirs(root: str) -> List[int]:
    """Iterations of the ``iter_N`` directories under ``root`` (not ``iter_N.tmp``), ascending."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [int(m.group(1)) for m in map(_ITER_DIR.match, names)
             if m and os.path.isdir(os.path.join(root, m.group(0)))]
    return sorted(found)


def _verified(path: str) -> Tuple[bool, str]:
    try:
        verify_checkpoint(path)
        return True, ""
    except CheckpointError as exc:
        return False, str(exc)


def resume_decision(root: str, fresh_ok: bool) -> Tuple[object, Optional[str]]:
    """(what --load ``root`` resumes from, a WARNING or None). What: an iteration (a verified
    directory the tracker does not name), None (start from scratch: ``fresh_ok`` -- --load is
    --save's directory -- and nothing verified there), or USE_TRACKER."""
    try:
        text = open(os.path.join(root, TRACKER)).read().strip()
    except FileNotFoundError:
        text = None
    except OSError:
        return USE_TRACKER, None
    if text is not None and not text.isdigit():
        return USE_TRACKER, None  # load_checkpoint names the tracker and its content
    tracked = None if text is None else int(text)
    present = iteration_dirs(root)
    skipped: List[str] = []
    found = None
    for it in reversed([k for k in present if tracked is None or k > tracked]):
        ok, why = _verified(iteration_dir(root, it))
        if ok:
            found = it
            break
        skipped.append(f"{os.path.basename(iteration_dir(root, it))} ({why})")
    note = (" Passed over, as they fail verification: " + "; ".join(skipped) + ".") if skipped else ""
    if found is None:
        if tracked is None and fresh_ok and skipped:
            return None, (f"WARNING: --load {root}: no {TRACKER} and no iter_* directory there verifies; "
                          f"starting from scratch.{note}")
        if tracked is None and fresh_ok:
            return None, None
        return USE_TRACKER, (f"WARNING: --load {root}: resuming from iteration {tracked}, which {TRACKER} "
                             f"names.{note}" if skipped and tracked is not None else None)
    path = iteration_dir(root, found)
    if tracked is None:
        head = (f"no {TRACKER}, but {path} is a complete checkpoint (its manifest verified: every "
                f"file's size and CRC32); resuming from iteration {found}, the newest of {len(present)} "
                f"iter_* directories")
    else:
        head = (f"{TRACKER} names iteration {tracked}, but {path} is newer and complete (its manifest "
                f"verified: every file's size and CRC32); resuming from iteration {found}")
    tail = "" if tracked is None else (f" To resume from iteration {tracked} instead, move the newer iter_* "
                                       f"directories out of {root}.")
    return found, (f"WARNING: --load {root}: {head} (a job killed between a save's rename and its tracker "
                   f"write leaves this).{tail}{note}")


def resume_iteration(root: str, fresh_ok: bool) -> object:
    """Collective: ``resume_decision`` taken on rank 0, printed there, returned on every rank."""
    decision = [resume_decision(root, fresh_ok) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(decision, src=0)
    what, warning = decision[0]
    if warning and dist.get_rank() == 0:
        print(warning, flush=True)
    return what


def replace_problem(root: str, iterations: range, overwrite: bool) -> Optional[str]:
    """Why saving ``iterations`` under ``root`` would replace a verified checkpoint, or None.
    Directories are verified newest first, stopping at the first that passes."""
    if overwrite:
        return None
    at_risk = [k for k in iteration_dirs(root) if k in iterations]
    verified = next((k for k in reversed(at_risk) if _verified(iteration_dir(root, k))[0]), None)
    if verified is None:
        return None  # incomplete or damaged directories are not checkpoints: a save replaces them
    names = ", ".join(os.path.basename(iteration_dir(root, k)) for k in at_risk)
    span = (f"iteration {iterations[0]}" if len(iterations) == 1
            else f"iterations {iterations[0]}-{iterations[-1]}")
    return (f"--save {root}: this run ({span}) would replace complete, verified checkpoints there: "
            f"{names} ({os.path.basename(iteration_dir(root, verified))} verified). Checkpoints are never "
            f"overwritten unless asked: resume from them with --load {root}, point --save at another "
            f"directory, or pass --overwrite-checkpoints to replace them")


def check_no_replace(root: str, iterations: range, overwrite: bool) -> None:
    """Collective: ``replace_problem`` on rank 0; every rank raises the same CheckpointError."""
    problem = [replace_problem(root, iterations, overwrite) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(f"{problem[0]} (directories read by rank 0; this is rank {dist.get_rank()}).")


def run_saves(start_iter: int, train_iters: int) -> range:
    """The iterations a run from ``start_iter`` may save: any up to --train-iters (a SIGTERM
    saves wherever it lands), or 0 alone for a seed checkpoint (--train-iters 0)."""
    if start_iter == 0 and train_iters == 0:
        return range(0, 1)
    return range(start_iter + 1, max(train_iters, start_iter) + 1)
