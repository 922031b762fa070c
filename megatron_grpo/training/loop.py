"""The pretraining run: build everything, train, evaluate, checkpoint, log, summarise.

``run(cfg)`` is what launch/pretrain_gpt.py calls on every rank (started by torchrun).
Hooks (``RunHooks``) let a component such as GRPO wrap the optimizer, see every step and add
metrics and checkpoint state without branches in this loop.

SIGTERM (SLURM preemption, ``scancel``, torchrun stopping its ranks) does not kill a rank during
``run()``: it is noted, every rank agrees at the end of the iteration, and the run saves a
checkpoint of that iteration (with --save) and returns (``_Preemption``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.comm.wire import wire_counter
from megatron_grpo.hooks import RunHooks
from megatron_grpo.training.metrics import MetricsLogger, peak_rss_bytes, step_peak_rss_bytes, wire_fields
from megatron_grpo.platform import select_platform
from megatron_grpo.training import checkpointing, resume_flags
from megatron_grpo.training.safety import checkpoint_dirs, launcher_watch, save_lock
from megatron_grpo.training.config import PretrainConfig
from megatron_grpo.training.safety.divergence import DivergenceGuard, TrainingDiverged
from megatron_grpo.training.memory_budget import current_base_bytes
from megatron_grpo.training.model import (build_model, data_parallel_info, init_distributed,
                                          is_metrics_rank, model_parallel_init, optional_device_peak)
from megatron_grpo.training.step import ForwardStep, evaluate, microbatch_layout, train_step
from megatron_grpo.training.weight_check import (WeightHashMismatch, check_due, check_weight_hashes,
                                                 failure_message, validate_interval)


@dataclass
class RunSummary:
    """What a finished run reports (on the metrics rank; other ranks get Nones)."""

    run_name: str
    iterations: int
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    val_loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    wire_bytes_per_step: Optional[float] = None
    median_step_time_s: Optional[float] = None
    peak_rss_bytes: Optional[int] = None
    num_params: int = 0
    preempted: bool = False
    """True when the run stopped early on SIGTERM (after saving, with --save)."""


class _Preemption:
    """SIGTERM -> stop at the end of the current iteration, on every rank at the same iteration.

    SLURM preemption sends SIGTERM to every task, torchrun forwards it to its ranks, and a rank
    may see it at any point of an iteration, or (a signal to one process) alone. The handler
    only notes it; ``agree()`` is one tiny all-reduce that every rank issues at the same point
    of every iteration, so all ranks learn of any rank's signal at the same iteration and save
    and stop together. A flag checked locally would let a signalled rank leave while the others
    enter the next step's collectives and hang until the timeout.
    Every SIGTERM only sets the flag (no "second signal kills"): under SLURM a rank receives it
    from slurmstepd, from launch/slurm/rank_exec.sh's trap and from torchrun, within
    milliseconds. What bounds a rank that cannot reach the end of its iteration (a hung peer)
    is the sender's SIGKILL (torchrun after 30 s, SLURM after KillWait).
    """

    def __init__(self) -> None:
        self.signalled = False
        self.installed = False
        self._previous = None

    def install(self) -> None:
        # Handlers can only be set from the main thread: run() called in another thread (an
        # embedding application) keeps its process's handling. A process that chose to ignore
        # SIGTERM (SIG_IGN, e.g. nohup-style wrappers) keeps ignoring it.
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
            return
        self._previous = signal.signal(signal.SIGTERM, self._note)
        self.installed = True

    def restore(self) -> None:
        if self.installed:
            # None: a handler set outside Python; the default is the closest we can restore.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self.installed = False

    def _note(self, signum, frame) -> None:
        self.signalled = True

    def agree(self, device, flags: Sequence[int] = ()) -> List[int]:
        """Collective on the default group: [the number of ranks that got SIGTERM so far, then
        the sum over ranks of each of ``flags``] (the divergence checks ride along, so every rank
        also stops together on a NaN loss). On a GPU, ``tolist()`` waits for the all-reduce: one
        small collective and host sync per iteration (the loss all-reduce already syncs every
        step)."""
        flag = torch.tensor([1 if self.signalled else 0, *flags], dtype=torch.int32, device=device)
        with wire_counter().tag("control"):  # not gradient traffic (the caller drops it too)
            dist.all_reduce(flag)
        return [int(x) for x in flag.tolist()]


def _median(xs: List[float]) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


def build_run_datasets(cfg: PretrainConfig, cache_dir: Optional[str] = None):
    """(tokenizer, train, valid) exactly as a run builds them. megatron names its index cache by
    the requested sizes, so anything pre-building caches (launch/slurm/job_setup.py) calls this."""
    from megatron_grpo.data import build_gpt_datasets, parse_data_prefix, read_meta, tokenizer_from_meta

    t, lg = cfg.training, cfg.logging
    tokenizer = tokenizer_from_meta(read_meta(parse_data_prefix(cfg.data.data_path)[0][0]))
    train, valid = build_gpt_datasets(
        data_prefix=cfg.data.data_path, split=cfg.data.split, seq_length=cfg.model.seq_length,
        seed=t.seed, train_samples=max(t.train_iters, 1) * t.global_batch_size,
        valid_samples=max(lg.eval_iters, 1) * t.global_batch_size,
        cache_dir=cache_dir or cfg.data.data_cache_dir, tokenizer=tokenizer)
    return tokenizer, train, valid


def run(cfg: PretrainConfig, hooks: Optional[RunHooks] = None) -> RunSummary:
    # Installed before the process group exists: a SIGTERM during start-up or --load is noted
    # too, and acted on at the end of the first iteration. The previous handler comes back
    # whatever happens (tests and embedding code call run() more than once per process).
    preemption = _Preemption()
    preemption.install()
    if hooks is None:
        if cfg.grpo.enabled:
            # The launcher picks GRPO's hooks (megatron_grpo.megatron.run_hooks): training does
            # not import the megatron glue.
            raise ValueError("run(cfg) with --grpo needs GRPO's hooks: "
                             "run(cfg, megatron_grpo.megatron.run_hooks(cfg))")
        hooks = RunHooks()
    # A rank whose launcher dies exits without saving (launcher_watch); rank 0 holds --save's
    # lock from start to end (save_lock), released whatever the end, that exit included.
    lock = save_lock.SaveLock(cfg.checkpoint.save) if cfg.checkpoint.save else None
    watch = launcher_watch.from_environment(cfg.checkpoint.save)
    if watch is not None:
        if lock is not None:
            watch.before_exit(lock.release)
        watch.start()
    try:
        return _run(cfg, hooks, preemption, lock, watch)
    except BaseException:
        if watch is not None:  # a peer that saw the launcher die first left this rank a peer failure
            watch.check()
        raise
    finally:
        try:
            hooks.finish()
        finally:
            if lock is not None:
                lock.release()
            if watch is not None:
                watch.stop()
            preemption.restore()


def _apply_memory_budget(cfg: PretrainConfig, platform, vocab: int):
    """--grpo-memory-budget-gb: settle the memory tier's placement before the model exists
    (megatron_grpo.training.memory_budget); None without a budget."""
    if not cfg.offload.memory_budget_gb:
        return None
    from megatron_grpo.training import memory_budget
    from megatron_grpo.training.model import layer_spec

    attention = "flash" if layer_spec(platform)[1] == "transformer_engine" else "unfused"
    cfg.offload, budget = memory_budget.choose(cfg, vocab, attention, dist.get_world_size(),
                                               current_base_bytes(platform),
                                               rank=dist.get_rank())
    if dist.get_rank() == 0:
        print(f"[{cfg.logging.run_name}] {budget.describe()}", flush=True)
    return budget


def _before_save(lock, watch) -> None:
    """No save after the launcher died or with --save's lock lost (launcher_watch, save_lock)."""
    if watch is not None:
        watch.check()
    if lock is not None:
        save_lock.confirm(lock)


def _run(cfg: PretrainConfig, hooks: RunHooks, preemption: _Preemption, lock=None, watch=None) -> RunSummary:
    t, lg = cfg.training, cfg.logging
    platform = select_platform(force_cpu=t.cpu, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    hash_interval = validate_interval(lg.check_weight_hash_interval)
    # Import megatron's buffer module before installing the counter so its import-time
    # reference to reduce_scatter/all_gather is rebound to the counting wrappers.
    import megatron.core.distributed.param_and_grad_buffer  # noqa: F401
    import megatron.core.pipeline_parallel.p2p_communication  # noqa: F401

    counter = wire_counter()
    init_distributed(platform, timeout_s=int(cfg.parallel.distributed_timeout_minutes * 60))
    model_parallel_init(cfg)
    if cfg.checkpoint.save:  # an unwritable --save fails now, not after the first save_interval
        checkpointing.check_save_dir(cfg.checkpoint.save)
        save_lock.acquire(lock)  # one job per --save: before --load reads it or anything is saved

    from megatron_grpo.data import MicroBatchIterator

    tokenizer, train_ds, valid_ds = build_run_datasets(cfg)
    dp_rank, dp_size = data_parallel_info()
    mbs, gbs, seq = t.micro_batch_size, t.global_batch_size, cfg.model.seq_length
    num_mb, _ = microbatch_layout(gbs, mbs, dp_size)

    budget = _apply_memory_budget(cfg, platform, tokenizer.vocab_size)
    # What the process holds before the model (CPU: resident set; CUDA: allocated): the part of
    # the peak the planner does not model, logged so its predictions can be held to runs.
    before_model = current_base_bytes(platform)
    built = build_model(cfg, platform, tokenizer.vocab_size, hooks.optimizer_factory,
                        ddp_class=hooks.ddp_class, bucket_size=hooks.bucket_size)
    hooks.after_build(built)

    # The model record goes into every checkpoint's manifest and is checked against at load.
    model_rec = checkpointing.model_record(cfg, tokenizer, built.vocab_size,
                                           checkpointing.bucket_layout(cfg, hooks.bucket_size, dp_size))
    start_iter, consumed = 0, 0
    load = cfg.checkpoint.load
    if load:
        # `--save D --load D` is the auto-resume idiom of requeued jobs: the first job starts fresh.
        # A --load that names another directory without a checkpoint stays an error (a typo).
        # A verified iter_* newer than the tracker (or without one) is resumed from, with a WARNING.
        same = bool(cfg.checkpoint.save) and os.path.abspath(load) == os.path.abspath(cfg.checkpoint.save)
        resume = checkpoint_dirs.resume_iteration(load, fresh_ok=same)
        if resume is None:
            if dist.get_rank() == 0:
                print(f"[{lg.run_name}] --load {load}: no checkpoint yet (same directory as --save); "
                      f"starting from scratch", flush=True)
            load = None
    if load:
        resume_flags.check_not_past_end(load, resume, cfg, dist.get_rank())
        common, rank_extra = checkpointing.load_checkpoint(
            load, built, iteration=None if resume == checkpoint_dirs.USE_TRACKER else resume,
            record=model_rec, load_optim=cfg.checkpoint.load_optim)
        start_iter = int(common["iteration"])
        consumed = int(common["consumed_samples"])
        resume_flags.restore(cfg, common, built, load)  # the lr schedule; refuses or says what changed
        hooks.load_state(common.get("extensions", {}))
        hooks.load_rank_state(rank_extra)
    elif cfg.checkpoint.init_from:
        checkpointing.load_model_weights(cfg.checkpoint.init_from, built, model_rec)
    if cfg.checkpoint.save:  # before training, not at the first save that would replace one
        checkpoint_dirs.check_no_replace(cfg.checkpoint.save, checkpoint_dirs.run_saves(start_iter, t.train_iters),
                                         cfg.checkpoint.overwrite_checkpoints)

    train_iter = MicroBatchIterator(train_ds, consumed, mbs, dp_rank, dp_size)
    forward_step = ForwardStep(seq, platform.device)
    writer = is_metrics_rank()
    logger = MetricsLogger.create(writer, lg.metrics_file, lg.tensorboard_dir, lg.log_interval,
                                  t.train_iters, lg.run_name, start_iteration=start_iter)
    summary = RunSummary(lg.run_name, t.train_iters, num_params=built.num_params)
    if dist.get_rank() == 0:
        print(f"[{lg.run_name}] platform={platform.backend}/{platform.device} spec={built.spec_name} "
              f"world={dist.get_world_size()} tp={cfg.parallel.tensor_model_parallel_size} "
              f"pp={cfg.parallel.pipeline_model_parallel_size} dp={dp_size} "
              f"params/rank={built.num_params} vocab={built.vocab_size} start_iter={start_iter}",
              flush=True)

    if cfg.checkpoint.save and start_iter == 0 and t.train_iters == 0:
        # A seed checkpoint: the initial weights, for runs in other layouts to --init-from.
        _before_save(lock, watch)
        hooks.before_save()
        checkpointing.save_checkpoint(cfg.checkpoint.save, 0, built, {
            "consumed_samples": 0, "scheduler": built.scheduler.state_dict(),
            "run_flags": resume_flags.run_flags(cfg),
            "extensions": hooks.checkpoint_state()}, hooks.rank_state(), model_rec,
            overwrite=cfg.checkpoint.overwrite_checkpoints)
    step_times: List[float] = []
    logged, wire_after_first = 0, 0
    rss_high, device_high = 0, 0
    counter.reset()
    guard = DivergenceGuard(cfg)
    iteration = start_iter
    while iteration < t.train_iters:
        hooks.before_step(iteration)
        t0 = time.perf_counter()
        result = train_step(forward_step, train_iter, built, num_mb, seq, mbs)
        built.scheduler.step(increment=gbs)
        hooks.after_step(iteration + 1)
        step_time = time.perf_counter() - t0
        iteration += 1
        wire = counter.reset()
        # Every rank, every iteration, at this point: did any rank get SIGTERM, or see a NaN
        # loss? Its few bytes are dropped from the counts (like evaluation's), so wire_bytes
        # stays the step's own.
        signalled, *nonfinite = preemption.agree(platform.device, guard.local_flags(result))
        diverged = guard.problem(iteration, result, nonfinite, platform.device)
        counter.reset()
        stopping = signalled > 0 and iteration < t.train_iters
        step_times.append(step_time)
        record = {
            "iteration": iteration, "run": lg.run_name, "loss": result.loss,
            "lr": built.optimizer.param_groups[0]["lr"], "grad_norm": result.grad_norm,
            "step_time_s": step_time, "tokens_per_s": gbs * seq / step_time,
            "optimizer_time_s": result.optimizer_time_s,
            **wire_fields(wire),
            "consumed_samples": train_iter.consumed_samples,
            "skipped": not result.update_successful,
            "memory_before_model_bytes": before_model,
        }
        # Per-step peaks (reset after each read), so memory freed after warm-up -- the memory
        # tier's offload -- shows; the whole-run peaks are their running maxima.
        step_rss = step_peak_rss_bytes()
        if step_rss is not None:
            rss_high = max(rss_high, step_rss)
            record["step_peak_rss_bytes"] = step_rss
        record["peak_rss_bytes"] = rss_high if step_rss is not None else peak_rss_bytes()
        device_peak = optional_device_peak(platform)
        if device_peak is not None:
            device_high = max(device_high, device_peak)
            record["step_peak_device_bytes"] = device_peak
            record["peak_device_bytes"] = device_high
        record.update(hooks.step_metrics(iteration, wire, step_time))
        if budget is not None:
            record.update(budget.metrics())
        if diverged is not None:  # log the failing record, then stop on every rank (no save)
            if writer:
                logger.log(record)
            logger.close()
            raise TrainingDiverged(diverged)
        if check_due(hash_interval, iteration):
            hashes = check_weight_hashes(built.ddp_model, hooks.params_between_syncs())
            counter.reset()  # its traffic is no step's traffic (tagged "weight_check")
            record["weight_hash_ok"] = hashes.ok
            # Parameters compared only inside each instance (periodic tiers between syncs).
            record["weight_hash_instance_only"] = hashes.checked.get("dp_instance_only", 0)
            if not hashes.ok:  # log the failing record, then stop on every rank (no save)
                if writer:
                    logger.log(record)
                logger.close()
                raise WeightHashMismatch(failure_message(hashes, iteration))
        # A preempted run skips a due evaluation: the grace before SIGKILL is for the checkpoint.
        if (iteration % lg.eval_interval == 0 or iteration == t.train_iters) and not stopping:
            if lg.eval_iters > 0:
                valid_iter = MicroBatchIterator(valid_ds, 0, mbs, dp_rank, dp_size)
                val = evaluate(forward_step, valid_iter, built, lg.eval_iters, num_mb, seq, mbs)
                counter.reset()  # evaluation traffic is not part of any training step
                if val is not None:
                    record["val_loss"] = val
                    summary.val_loss = val
        save_due = cfg.checkpoint.save and (
            iteration == t.train_iters or stopping
            or (cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0))
        if save_due:
            _before_save(lock, watch)
            hooks.before_save()
            checkpointing.save_checkpoint(cfg.checkpoint.save, iteration, built, {
                "consumed_samples": train_iter.consumed_samples,
                "scheduler": built.scheduler.state_dict(), "run_flags": resume_flags.run_flags(cfg),
                "extensions": hooks.checkpoint_state(),
            }, hooks.rank_state(), model_rec, overwrite=cfg.checkpoint.overwrite_checkpoints)
            counter.reset()
        if writer:
            logger.log(record)
            # Running figures only: a long run must not keep every record in memory.
            if summary.first_loss is None:
                summary.first_loss = record["loss"]
            else:
                wire_after_first += record["wire_bytes"]
            summary.last_loss = record["loss"]
            logged += 1
        if stopping:
            summary.preempted = True
            if dist.get_rank() == 0:
                where = (f"saved checkpoint {checkpointing.iteration_dir(cfg.checkpoint.save, iteration)}"
                         f"; resume with --load {cfg.checkpoint.save}" if cfg.checkpoint.save
                         else "no --save, so no checkpoint")
                print(f"[{lg.run_name}] SIGTERM on {signalled} of {dist.get_world_size()} rank(s): "
                      f"stopped after iteration {iteration} of {t.train_iters}; {where}", flush=True)
            break
        if t.exit_after_iter is not None and iteration >= t.exit_after_iter:
            break
    logger.close()
    if writer and logged:
        summary.median_step_time_s = _median(step_times[1:] or step_times)
        summary.tokens_per_s = gbs * seq / summary.median_step_time_s
        if logged > 1:
            summary.wire_bytes_per_step = wire_after_first / (logged - 1)
        tail = step_peak_rss_bytes()  # what came after the last record (final evaluation, save)
        summary.peak_rss_bytes = max(rss_high, tail or 0) or peak_rss_bytes()
    return summary


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
