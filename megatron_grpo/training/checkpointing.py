"""Save and resume through megatron-core dist_checkpointing (torch_dist), atomically and checked.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt    the newest *complete* checkpoint (written last)
    DIR/iter_0000100/                          dist_checkpointing files + common.pt
    DIR/iter_0000100/rng/rank_00000.pt         per-rank RNG state
    DIR/iter_0000100/megatron_grpo_manifest.json  every file with its size and CRC32

A checkpoint is written into ``iter_N.tmp`` and renamed to ``iter_N`` only after every rank
has finished and the manifest is written, so a crash mid-save never replaces or corrupts a
complete checkpoint. ``--load`` verifies the manifest before reading a byte of state.

Traps of megatron-core 0.16.1 handled here (see docs/design.md):
* the default ``fully_sharded_model_space`` fails at save on CPU; we use ``dp_reshardable``;
* a fresh torch Adam has no state, and DistributedOptimizer.state_dict() asserts on it;
* after load every param shares one ``step`` tensor that ``dp_reshardable`` resets to the
  template value (0): resume would silently diverge, so per-param steps are restored;
* the save's results-queue Manager process dies with the first SIGTERM sent to the rank's
  process group, and every later save fails (``_sigterm_proof_results_queue``).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_grpo.platform.layout import parallel_layout
from megatron_grpo.training.model import optimizer_list, unwrap
from megatron_grpo.training.safety import checkpoint_dirs, divergence, save_errors
# A checkpoint directory's names and its manifest check live with the guards that read them
# (safety/checkpoint_dirs.py): imported here for the writer and reader, and for callers that
# import them from this module; neither module imports the other's.
from megatron_grpo.training.safety.checkpoint_dirs import (MANIFEST, TRACKER, CheckpointError,  # noqa: F401
                                                            crc32, files_under, iteration_dir,
                                                            verify_checkpoint)

# The model record of a manifest and its check at a load live in their own file; callers
# import them from here too.
from megatron_grpo.training.ckpt_record import (bucket_layout, check_record, model_record,  # noqa: E402,F401
                                                model_versions)

SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}
FORMAT_VERSION = 1


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _rng_state() -> Dict:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: Dict) -> None:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(built, is_loading: bool) -> Dict:
    model_sd = unwrap(built.ddp_model[0]).sharded_state_dict(metadata=SHARDING)
    return {
        "model": model_sd,
        "optimizer": built.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                        metadata=SHARDING),
    }


def _sigterm_proof_results_queue() -> None:
    """Give megatron-core's torch_dist writer a results queue whose Manager survives SIGTERM.

    The writer hands every rank's write results through a queue served by a Manager process
    that megatron spawns at the first save and keeps (filesystem_async._get_write_results_queue).
    SLURM preemption, torchrun and launch/slurm/rank_exec.sh send SIGTERM to the rank's whole
    process group; the Manager (a spawned process: default SIGTERM action) died with it, and
    the checkpoint the training loop then writes for the preemption failed with BrokenPipeError.
    This Manager ignores SIGTERM instead, and gets SIGKILL when the rank dies (Linux
    PR_SET_PDEATHSIG; it checks it was not orphaned before that), so it can neither break the
    save nor outlive a rank that was SIGKILLed. Created as megatron would (spawn context), before
    megatron's first save; a megatron-core without this module attribute is left alone. The
    initializer is builtins.exec of a constant: the server process then imports nothing of ours."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:
        return
    if getattr(fsa, "_results_queue", True) is not None:
        return  # already made (by us or by megatron), or not this megatron-core's layout
    import multiprocessing
    from multiprocessing.managers import SyncManager

    init = ("import ctypes, os, signal\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "try:\n"
            "    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG\n"
            "except (OSError, AttributeError):\n"
            "    pass\n"
            f"if os.getppid() != {os.getpid()}:\n"
            "    os._exit(0)\n")
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(exec, (init,))
    fsa._results_queue = manager.Queue()  # the proxy keeps the manager (and its server) alive


def save_dir_problem(root: str) -> Optional[str]:
    """Why --save ``root`` cannot take a checkpoint (it cannot be created, or a file cannot be
    written and removed in it), or None. Cheap: one 6-byte file. Creates ``root`` if missing."""
    probe = os.path.join(root, f".megatron_grpo_write_probe.{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as fh:
            fh.write("probe\n")
        os.remove(probe)
    except OSError as exc:
        return str(exc)
    return None


def check_save_dir(root: str) -> None:
    """Collective, before training: rank 0 probes --save (save_dir_problem) and every rank raises
    the same CheckpointError if it failed, instead of finding out at the first save."""
    problem = [save_dir_problem(root) if dist.get_rank() == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(
            f"--save {root}: cannot write checkpoints there ({problem[0]}; write probe of rank 0, "
            f"before training; this is rank {dist.get_rank()}). Point --save at a directory this "
            f"job can create and write, or make {root} writable.")


def _save_failure(root: str, iteration: int, exc: BaseException) -> str:
    """The one-line CheckpointError text for a save that failed with ``exc``: its cause (a full
    disk, however torch put it) and what to do (free the disk, or raise the open-file limit)."""
    cause = save_errors.explain(root, save_errors.cause_text(exc))
    try:
        last = open(os.path.join(root, TRACKER)).read().strip()
    except OSError:
        last = ""
    resume = (f"its latest complete checkpoint, iteration {last}, is intact: resume with --load {root}"
              if last.isdigit() else "it holds no complete checkpoint")
    return (f"--save {root}: saving iteration {iteration} failed on rank {dist.get_rank()} "
            f"({' '.join(cause.split())}). {save_errors.what_to_do(exc, dist.get_rank())}; {resume}.")


def save_checkpoint(root: str, iteration: int, built, common: Dict, rank_extra: Optional[Dict] = None,
                    record: Optional[Dict] = None, overwrite: bool = False) -> str:
    """Collective: every rank calls it. ``common`` holds plain values (iteration, data position,
    scheduler state, extra component state); rank 0 writes it. ``rank_extra`` is this rank's own
    state (e.g. error-feedback residuals), stored beside its RNG state. Returns the directory.
    A failed write (ENOSPC, EROFS, ...) raises CheckpointError; the last complete checkpoint
    and the tracker are untouched, the partial iter_N.tmp is replaced by the next save. Weights
    holding a NaN or Inf are refused the same way, before anything is written, and so is an
    existing verified iter_N unless ``overwrite`` (--overwrite-checkpoints)."""
    from torch.distributed.checkpoint import CheckpointException

    checkpoint_dirs.check_no_replace(root, range(iteration, iteration + 1), overwrite)
    # Before anything is written: the previous checkpoint must stay the newest one.
    problem = divergence.nonfinite_weights_problem(root, iteration, built)
    if problem is not None:
        raise CheckpointError(problem)
    try:
        return _save_checkpoint(root, iteration, built, common, rank_extra, record)
    except OSError as exc:
        raise CheckpointError(_save_failure(root, iteration, exc)) from exc
    except Exception as exc:  # noqa: BLE001 - re-raised unless a full disk or out of descriptors
        # torch.save's ENOSPC names no errno; megatron wraps a writer's EMFILE in a RuntimeError
        if not (save_errors.is_zip_writer_failure(exc) or save_errors.out_of_files(exc, dist.get_rank())):
            raise
        raise CheckpointError(_save_failure(root, iteration, exc)) from exc
    except CheckpointException as exc:
        # torch's (a BaseException): dist_checkpointing's writer failed on some rank, e.g.
        # "Worker failure: [Errno 28] No space left on device", raised on every rank.
        raise CheckpointError(_save_failure(root, iteration, exc)) from None


def _save_checkpoint(root: str, iteration: int, built, common: Dict,
                     rank_extra: Optional[Dict], record: Optional[Dict]) -> str:
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    _sigterm_proof_results_queue()
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # left by a crashed save: never complete, safe to drop
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    dist.barrier()
    # Params never stepped (a seed checkpoint at iteration 0) have no Adam state yet; zero
    # state with step 0 is exactly what torch Adam would create on its first step.
    prefill_optimizer_state(built.optimizer)
    state = _sharded_state(built, is_loading=False)
    state["common"] = dict(common, iteration=iteration, world_size=dist.get_world_size(),
                           format_version=FORMAT_VERSION)
    dist_checkpointing.save(state, tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    rng_path = os.path.join(tmp, "rng", f"rank_{rank:05d}.pt")
    torch.save({"rng": _rng_state(), "extra": rank_extra or {}}, rng_path + ".part")
    os.replace(rng_path + ".part", rng_path)
    dist.barrier()
    if rank == 0:
        write_manifest(tmp, iteration, dist.get_world_size(), parallel_layout(), record)
        if os.path.exists(final):  # re-saving the same iteration: replace only once complete
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_tracker(root, iteration)
    dist.barrier()
    return final


def write_tracker(root: str, iteration: int) -> None:
    """Name ``iteration`` the latest complete checkpoint (atomically; after its rename)."""
    _atomic_write_text(os.path.join(root, TRACKER), str(iteration))


def write_manifest(ckpt_dir: str, iteration: int, world_size: int, layout, record: Optional[Dict]) -> None:
    """Size and CRC32 of every file under ``ckpt_dir`` (written last, atomically), with the
    iteration, the writer's world size and TP x PP layout, and the model record."""
    files = {f: {"size": os.path.getsize(os.path.join(ckpt_dir, f)), "crc32": crc32(os.path.join(ckpt_dir, f))}
             for f in files_under(ckpt_dir)}
    manifest = {"iteration": iteration, "world_size": world_size, "files": files,
                "format_version": FORMAT_VERSION, "layout": list(layout)}
    if record is not None:
        manifest["model"] = record
    _atomic_write_text(os.path.join(ckpt_dir, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))


def latest_iteration(root: str) -> int:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(
            f"--load {root}: no {TRACKER} there (rank {_rank()}). Point --load at a directory "
            f"written by --save, or drop --load to start from scratch.")
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {tracker} holds {text!r}, not an iteration number "
                              f"(rank {_rank()}); write the iteration of a complete iter_* directory into it.")
    return int(text)


def prefill_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no per-param state, and DistributedOptimizer.state_dict() asserts
    one common ``step``; give every param zero state so the load template can be built. Also
    the Megatron-LM runner's CPU load (megatron_grpo.megatron_lm.checkpoints)."""
    for opt in optimizer_list(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))


def restore_per_param_steps(optimizer) -> None:
    """After load all params share one ``step`` tensor reset to the template value; rebuild a
    per-param step from the loaded param-group step (torch Adam's bias correction uses it)."""
    for opt in optimizer_list(optimizer):
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                opt.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def _check_layout(root: str, ckpt_dir: str) -> None:
    """The optimizer state is saved per data-parallel shard (dp_reshardable): it resumes at any
    data-parallel size but not in another TP/PP layout; say so before megatron's shape error."""
    with open(os.path.join(ckpt_dir, MANIFEST)) as fh:
        saved = json.load(fh).get("layout")  # absent in checkpoints before this check
    if saved is not None and list(saved) != parallel_layout():
        tp, pp = parallel_layout()
        raise CheckpointError(
            f"--load {root} (rank {_rank()}): written at tensor x pipeline parallel {saved[0]} x "
            f"{saved[1]}, this run is {tp} x {pp}. The distributed optimizer's state is saved per "
            f"data-parallel shard, so a resume may change the data-parallel size but not TP or PP. "
            f"Resume with --tensor-model-parallel-size {saved[0]} --pipeline-model-parallel-size "
            f"{saved[1]}; resume in this layout without the optimizer state with --no-load-optim "
            f"(iteration and data position kept); or start this layout from its weights with "
            f"--init-from {root} (fresh optimizer state).")


@save_errors.names_open_file_limit("--load")
def load_checkpoint(root: str, built, iteration: Optional[int] = None, record: Optional[Dict] = None,
                    load_optim: bool = True):
    """Collective: restore model, optimizer and RNG. Returns (saved ``common`` dict, this
    rank's ``rank_extra`` dict). ``load_optim=False`` (--no-load-optim): model and common state
    only, in any TP/PP layout; the common state's ``extensions`` and the rank's extra come back
    empty (their per-unit and per-rank state belongs to the saved optimizer's layout)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root) if iteration is None else iteration
    ckpt_dir = iteration_dir(root, iteration)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"--load {root}: {TRACKER} names iteration {iteration} but {ckpt_dir} "
                              f"does not exist (rank {_rank()}).")
    manifest = verify_checkpoint(ckpt_dir)
    if not load_optim:
        return _load_without_optimizer(root, ckpt_dir, manifest, built, record)
    _check_layout(root, ckpt_dir)
    check_record("--load", root, manifest, record)
    prefill_optimizer_state(built.optimizer)
    template = _sharded_state(built, is_loading=True)
    template["common"] = {}
    loaded = dist_checkpointing.load(template, ckpt_dir)
    unwrap(built.ddp_model[0]).load_state_dict(loaded["model"])
    # fp32 main params are views of leaf model params: in-place copies need no_grad.
    with torch.no_grad():
        built.optimizer.load_state_dict(loaded["optimizer"])
    restore_per_param_steps(built.optimizer)
    common = loaded.get("common", {})
    rng_path = os.path.join(ckpt_dir, "rng", f"rank_{dist.get_rank():05d}.pt")
    rank_extra: Dict = {}
    if common.get("world_size") == dist.get_world_size() and os.path.isfile(rng_path):
        saved = torch.load(rng_path, weights_only=False)
        _set_rng_state(saved["rng"])
        rank_extra = saved.get("extra", {})
    return common, rank_extra


def _load_without_optimizer(root: str, ckpt_dir: str, manifest: Dict, built, record: Optional[Dict]):
    from megatron.core import dist_checkpointing

    check_record("--load", root, manifest, record, optimizer=False)  # buckets do not matter here
    loaded = dist_checkpointing.load(
        {"model": unwrap(built.ddp_model[0]).sharded_state_dict(metadata=SHARDING), "common": {}}, ckpt_dir)
    unwrap(built.ddp_model[0]).load_state_dict(loaded["model"])
    _refresh_main_params(built)
    common = dict(loaded.get("common", {}), extensions={})
    if _rank() == 0:
        layout = manifest.get("layout")
        print(f"[checkpoint] --load {root} --no-load-optim: model weights, iteration "
              f"{common.get('iteration')}, data position and lr schedule restored (written at tensor x "
              f"pipeline parallel {layout[0] if layout else '?'} x {layout[1] if layout else '?'}, world "
              f"size {manifest.get('world_size')}); optimizer state starts at zero, per-rank RNG and "
              f"GRPO state start fresh", flush=True)
    return common, {}


def _refresh_main_params(built) -> None:
    """The distributed optimizer keeps fp32 main copies of bf16 params: refresh them."""
    for opt in optimizer_list(built.optimizer):
        reload = getattr(opt, "reload_model_params", None)
        if reload is not None:
            reload()


@save_errors.names_open_file_limit("--init-from")
def load_model_weights(path: str, built, record: Optional[Dict] = None) -> int:
    """Load only the model weights (any TP/PP layout) from ``path``: a checkpoint root (its
    latest iteration) or one ``iter_*`` directory. Optimizer state, iteration and data position
    start fresh; this is how different parallel layouts start from identical weights (a seed
    checkpoint) and how converted checkpoints are used. Returns the checkpoint's iteration."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        path = iteration_dir(path, latest_iteration(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"--init-from {path}: no such checkpoint directory (rank {_rank()}).")
    manifest = verify_checkpoint(path)
    check_record("--init-from", path, manifest, record)
    load_model_state(unwrap(built.ddp_model[0]), path)
    _refresh_main_params(built)
    return int(manifest["iteration"])


def load_model_state(model, ckpt_dir: str) -> None:
    """Collective: read a GPTModel's weights from ``ckpt_dir`` (an iter_* directory) in this
    run's layout, whatever layout wrote it (dist_checkpointing reshards)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=SHARDING)}, ckpt_dir)
    model.load_state_dict(loaded["model"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
