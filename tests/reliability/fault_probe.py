"""launch/pretrain_gpt.py with faults injected from inside the ranks (tests/reliability).

    torchrun --nproc_per_node 2 tests/reliability/fault_probe.py [--fault SPEC]... \
        [--fault-out DIR] <pretrain_gpt.py flags>

The training is the real entry, launch/pretrain_gpt.py main(): same flags, same error handling,
same exit codes. Faults come in through the run's hooks (RunHooks, wrapped around whatever
megatron_grpo.megatron.run_hooks builds: baseline or GRPO) and through two wrapped checkpoint writes, so nothing in
megatron_grpo needs a test branch. SPEC (R: rank, K: iteration, counted from 1):

  kill:R:K              rank R SIGKILLs itself inside the backward pass of iteration K (mid-step:
                        its peer is in, or about to enter, the step's collectives)
  kill-save:R:K:POINT   rank R SIGKILLs itself inside the save of iteration K, at POINT:
                          rng       writing its RNG file (its own shards are already written)
                          manifest  rank 0, before the manifest (every shard written, not complete)
                          tracker   rank 0, iteration directory complete, tracker not yet moved
  hang:R:K              rank R sleeps forever before iteration K (its peers wait in the step's
                        data-parallel collectives)
  hang-after:R:K        rank R sleeps forever after the optimizer step of iteration K (its peers
                        wait in the next world-group collective: the loop's SIGTERM agreement)
  sigterm:R:K           rank R sends itself SIGTERM before iteration K (only that rank is signalled)
  nonfinite:K:TIER:V    rank 1 writes V (nan or inf) into one gradient element of a GRPO unit of
                        tier TIER (core, dynamic, stable) during iteration K
  slow:S                every rank sleeps S seconds before each iteration (a window for a test
                        to signal the job from outside)

--fault-out DIR: each rank writes DIR/rank-R.pid at start and DIR/rank-R.json (one record per
iteration: state digests before and after the step, injections) after every iteration.
"""

import hashlib
import importlib.util
import json
import os
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_faults(argv):
    """(faults, out_dir, remaining argv): --fault SPEC and --fault-out DIR are ours."""
    faults, out, rest, i = [], None, [], 0
    while i < len(argv):
        if argv[i] == "--fault":
            faults.append(argv[i + 1].split(":"))
            i += 2
        elif argv[i] == "--fault-out":
            out = argv[i + 1]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    return faults, out, rest


def _digest(tensors) -> str:
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


_OUT = [None]  # --fault-out DIR, for mark()


def mark(rank: int, what: str, **extra) -> None:
    """Print and record (DIR/fault.json: wall time) the fault being injected now, so a test can
    measure how long the job took to notice it."""
    print(f"[fault_probe] rank {rank}: {what}", flush=True)
    if _OUT[0]:
        with open(os.path.join(_OUT[0], "fault.json"), "w") as fh:
            json.dump(dict(rank=rank, what=what, time=time.time(), **extra), fh)


class Faults:
    def __init__(self, faults, out_dir, rank: int):
        self.faults, self.out, self.rank = faults, out_dir, rank
        self.built = self.ctrl = None
        self.records, self.current = [], None
        self.track_state = any(f[0] == "nonfinite" for f in faults)
        self.unranked = ("nonfinite", "slow")

    def mine(self, kind):
        """(K, rest...) of this rank's faults of ``kind``."""
        for f in self.faults:
            if f[0] == kind and (kind in self.unranked or int(f[1]) == self.rank):
                yield f[1:] if kind in self.unranked else f[2:]

    # -- hooks ---------------------------------------------------------------------------------
    def wrap(self, hooks) -> None:
        after_build, before, after = hooks.after_build, hooks.before_step, hooks.after_step

        def after_build_(built):
            after_build(built)
            self.built = built
            try:
                from megatron_grpo.megatron import grpo_optimizers

                self.ctrl = next(iter(grpo_optimizers(built.optimizer))).grpo
            except (ImportError, StopIteration, AttributeError):
                self.ctrl = None  # baseline run

        def before_(iteration):
            before(iteration)  # GRPO's begin_step first: the tiers of this step are set
            self.before_step(iteration + 1)

        def after_(iteration):
            after(iteration)
            self.after_step(iteration)

        hooks.after_build, hooks.before_step, hooks.after_step = after_build_, before_, after_

    def params(self):
        return [p for chunk in self.built.ddp_model for p in chunk.module.parameters()]

    def state_digest(self):
        out = {"params": _digest(self.params())}
        if self.ctrl is not None:
            ef = self.ctrl.ef
            out["ef"] = _digest([ef.residual(k) for k in sorted(ef.keys())])
        return out

    def before_step(self, k: int) -> None:
        for (seconds,) in self.mine("slow"):
            time.sleep(float(seconds))
        self.current = {"iteration": k, "injected": None, "fired": False}
        if self.track_state:
            self.current["before"] = self.state_digest()
        for (it,) in self.mine("hang"):
            if int(it) == k:
                mark(self.rank, f"hangs before iteration {k}", iteration=k)
                while True:
                    time.sleep(3600)
        for (it,) in self.mine("sigterm"):
            if int(it) == k:
                mark(self.rank, f"sends itself SIGTERM before iteration {k}", iteration=k)
                os.kill(os.getpid(), signal.SIGTERM)
        for (it,) in self.mine("kill"):
            if int(it) == k:
                self._kill_in_backward(k)
        for it, tier, value in self.mine("nonfinite"):
            if int(it) == k:
                self._poison(k, tier, value)

    def _kill_in_backward(self, k: int) -> None:
        param = next(p for p in self.params() if p.requires_grad)

        def hook(grad):
            mark(self.rank, f"SIGKILLs itself in the backward of iteration {k}", iteration=k)
            _die()
        param.register_hook(hook)

    def _poison(self, k: int, tier: str, value: str) -> None:
        ctrl = self.ctrl
        unit = next((u for u, t in zip(ctrl.units, ctrl.tiers) if t == tier), None)
        if unit is None:
            return  # recorded as not injected: the test names the missing tier
        self.current["injected"] = {"unit": unit.index, "tier": tier, "value": value}
        if self.rank != 1:
            return
        param = unit.params[0]
        handle = []

        def poison(grad):
            handle[0].remove()
            self.current["fired"] = True
            grad = grad.clone()
            grad.view(-1)[0] = float(value)
            return grad
        handle.append(param.register_hook(poison))

    def after_step(self, iteration: int) -> None:
        for (it,) in self.mine("hang-after"):
            if int(it) == iteration:
                mark(self.rank, f"hangs after the step of iteration {iteration}", iteration=iteration)
                while True:
                    time.sleep(3600)
        rec = self.current
        if self.track_state:
            rec["after"] = self.state_digest()
        if self.ctrl is not None:
            rec["skipped"] = bool(self.ctrl.step_skipped)
            rec["tiers"] = "".join(t[0] for t in self.ctrl.tiers)
            rec["stable_update"] = bool(self.ctrl.step.stable_update)
        self.records.append(rec)
        if self.out:
            path = os.path.join(self.out, f"rank-{self.rank}.json")
            with open(path + ".part", "w") as fh:
                json.dump(self.records, fh)
            os.replace(path + ".part", path)

    # -- inside save_checkpoint ----------------------------------------------------------------
    def wrap_checkpointing(self) -> None:
        points = list(self.mine("kill-save"))
        if not points:
            return
        import torch

        from megatron_grpo.training import checkpointing as ck

        write_text, torch_save = ck._atomic_write_text, torch.save

        def due(point, path):
            return any(p == point and f"iter_{int(k):07d}" in path for k, p in points)

        def atomic_write_text(path, text):
            if path.endswith(ck.MANIFEST) and due("manifest", path):
                mark(self.rank, f"SIGKILLs itself before writing {path}")
                _die()
            if path.endswith(ck.TRACKER) and any(p == "tracker" and text == str(int(k)) for k, p in points):
                mark(self.rank, f"SIGKILLs itself before moving the tracker to {text}")
                _die()
            write_text(path, text)

        def save(obj, f, *args, **kwargs):
            if isinstance(f, str) and "/rng/rank_" in f and due("rng", f):
                mark(self.rank, f"SIGKILLs itself writing {f}")
                _die()
            return torch_save(obj, f, *args, **kwargs)

        ck._atomic_write_text, torch.save = atomic_write_text, save


def main() -> int:
    faults, out, argv = parse_faults(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    _OUT[0] = out
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank-{rank}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(REPO, "launch", "pretrain_gpt.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)  # its __main__ guard keeps main() from running on import

    import megatron_grpo.megatron as glue

    probe = Faults(faults, out, rank)
    probe.wrap_checkpointing()
    base_hooks = glue.run_hooks

    def run_hooks(cfg):  # the launcher picks its hooks through this module-level name
        hooks = base_hooks(cfg)
        probe.wrap(hooks)
        return hooks
    glue.run_hooks = run_hooks
    return entry.main(argv)


# Guarded: dist_checkpointing's save starts a spawn-based Manager that re-imports __main__.
if __name__ == "__main__":
    sys.exit(main())
