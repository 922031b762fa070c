"""Runs a real GRPO training (launch flags) under torchrun and records invariants per step.

    torchrun --nproc_per_node 2 tests/multiproc/grpo_probe.py OUT.json <training flags...>

Besides the training itself it records, on every rank and every iteration:
* the tier map and a digest of every model parameter (all ranks must agree bit for bit);
* for stable units between updates: whether their parameters, Adam moments and gradient
  buffer stayed exactly unchanged (no wgrad, no optimizer work) and requires_grad was False;
* the analytic per-tier byte count of the step, from the units' sizes and the compressor.
Rank 0 writes everything (gathered from all ranks) to OUT.json.
"""

import hashlib
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from harness import leave, write_gathered  # noqa: E402  (the probes' shared epilogue)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _signflip_class(base):
    class SignFlip(base):
        """Decodes every value with the wrong sign: not contractive (||D(q) - c|| = 2 ||c||), the
        kind of broken compressor remediation exists for. GVR cannot see it (same variance)."""

        def _decode_rows(self, payload2d, numel, out2d):
            return super()._decode_rows(payload2d, numel, out2d).neg_()

    return SignFlip


def install_strict_devices(old_bug: bool) -> None:
    """Strict wire counter + default device 'meta' around every GRPO entry point that issues
    collectives. On these CPU machines host and "device" tensors are both CPU tensors, so a
    tensor created without device= (fine on gloo, refused by NCCL) is invisible; with meta as
    the default device it becomes a meta tensor, which the strict counter refuses by name."""
    import functools

    from megatron_grpo.comm.wire import wire_counter
    from megatron_grpo.grpo.controller.core import GRPOController
    from megatron_grpo.megatron.bucket_group import GRPOBucketGroup
    from megatron_grpo.megatron.optimizer import GRPODistributedOptimizer

    wire_counter().set_strict(True)

    def on_meta(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with torch.device("meta"):
                return fn(*args, **kwargs)
        return wrapped

    for cls, names in ((GRPOController, ("begin_step", "end_step")),
                       (GRPOBucketGroup, ("start_grad_sync", "finish_grad_sync", "start_param_sync")),
                       (GRPODistributedOptimizer, ("prepare_grads",))):
        for name in names:
            setattr(cls, name, on_meta(getattr(cls, name)))
    if old_bug:
        import torch.distributed as dist

        from megatron_grpo.grpo.replica import ReplicaLayout

        def old_sum(self, local_rows):  # what _finish_gvr did: a vector made without device=
            full = torch.zeros((self.num_global,) + tuple(local_rows.shape[1:]), dtype=local_rows.dtype)
            dist.all_reduce(full, group=self.group)
            return full
        ReplicaLayout.sum_over_replica = old_sum


def install_fake_streams(ctrl, log):
    """Give the controller a recording stand-in for its CUDA side stream, so a CPU run shows
    where the GPU path would enqueue work on it and where the main stream joins it again."""
    import contextlib

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name}<-{other.name}")

        def record_event(self):  # a compressed sync's "decoded" event (comm/streams.py)
            log.append(f"event:{self.name}")
            return self.name

        def wait_event(self, recorded_on):
            log.append(f"{self.name}<-{recorded_on}")

    main, side = Stream("main"), Stream("side")

    @contextlib.contextmanager
    def on(stream):
        log.append(f"enter:{stream.name}")
        try:
            yield
        finally:
            log.append(f"exit:{stream.name}")

    ctrl.side_stream = side
    ctrl.current_stream = lambda: main
    ctrl.stream_context = on
    original_end = ctrl.end_step

    def end_step():
        log.append("end_step")
        original_end()

    ctrl.end_step = end_step


def SignFlipInt4(chunk):
    from megatron_grpo.comm.compress import Int4Compressor
    return _signflip_class(Int4Compressor)(chunk)


def SignFlipInt8(chunk):
    from megatron_grpo.comm.compress import Int8Compressor
    return _signflip_class(Int8Compressor)(chunk)


def main():
    import torch.distributed as dist

    from megatron_grpo.comm.compress import build_compressor
    from megatron_grpo.megatron import grpo_hooks, grpo_optimizers
    from megatron_grpo.training.arguments import parse_args
    from megatron_grpo.training.loop import run

    out_path, argv = sys.argv[1], sys.argv[2:]
    damaging = "--probe-signflip-compressor" in argv  # a compressor that must be caught
    damaging_core = "--probe-signflip-core-compressor" in argv  # the same, for the core tier
    argv = [a for a in argv if a not in ("--probe-signflip-compressor", "--probe-signflip-core-compressor")]
    strict = "--probe-strict-devices" in argv  # tensors made without device= become meta
    old_bug = "--probe-old-gvr-bug" in argv    # the earlier GVR vector: a host tensor
    argv = [a for a in argv if a not in ("--probe-strict-devices", "--probe-old-gvr-bug")]
    if strict:
        install_strict_devices(old_bug)
    fake_streams = "--probe-fake-streams" in argv  # record side-stream use and joins (CPU)
    argv = [a for a in argv if a != "--probe-fake-streams"]
    inject = None  # --probe-inf ITER:TIER puts one Inf into a gradient of that tier on rank 1
    if "--probe-inf" in argv:
        i = argv.index("--probe-inf")
        it, tier = argv[i + 1].split(":")
        inject = (int(it), tier)
        argv = argv[:i] + argv[i + 2:]
    cfg = parse_args(argv, world_size=int(os.environ["WORLD_SIZE"]))
    hooks = grpo_hooks(cfg)
    records = []
    probe = {}
    base_after_build, base_before, base_after = hooks.after_build, hooks.before_step, hooks.after_step

    def after_build(built):
        base_after_build(built)
        probe["built"] = built
        probe["ctrl"] = next(iter(grpo_optimizers(built.optimizer))).grpo
        if damaging:
            probe["ctrl"].compressor = SignFlipInt4(probe["ctrl"].config.compress_chunk)
        if damaging_core:
            probe["ctrl"].core_compressor = SignFlipInt8(probe["ctrl"].config.compress_chunk)
        if fake_streams:
            install_fake_streams(probe["ctrl"], probe.setdefault("stream_log", []))

    def optimizer_moments(ctrl, unit):
        opt = next(iter(grpo_optimizers(probe["built"].optimizer)))
        params = set(ctrl.units[unit].params)
        out = []
        for model_param, shard in opt._pairs():
            if model_param in params:
                st = opt.optimizer.state.get(shard, {})
                out += [shard] + [st[k] for k in ("exp_avg", "exp_avg_sq") if k in st]
        return out

    def before_step(iteration):
        base_before(iteration)
        ctrl = probe["ctrl"]
        frozen = [i for i, t in enumerate(ctrl.tiers) if t == "stable" and not ctrl.step.stable_update]
        probe["frozen"] = frozen
        probe["before"] = {i: (digest(ctrl.units[i].params), digest(optimizer_moments(ctrl, i)))
                           for i in frozen}
        probe["requires_grad"] = {i: any(p.requires_grad for p in ctrl.units[i].params) for i in frozen}
        probe["injected"] = None
        if inject and inject[0] == iteration + 1:
            unit = next(u for u, t in zip(ctrl.units, ctrl.tiers) if t == inject[1])
            probe["injected"] = unit.index
            if dist.get_rank() == 1:
                param = unit.params[0]

                def poison(grad, param=param):
                    probe["hook"].remove()
                    grad = grad.clone()
                    grad.view(-1)[0] = float("inf")
                    return grad

                probe["hook"] = param.register_hook(poison)

    def after_step(iteration):
        ctrl = probe["ctrl"]
        # Read before end_step (it may re-plan tiers after a GVR check).
        frozen_checks = {}
        for i in probe["frozen"]:
            managed = [b.grpo_grads for b in ctrl.units[i].group.buckets if hasattr(b, "grpo_grads")]
            if managed:  # --grpo-release-grads: no storage at all (reading it would be invalid)
                grads_zero = all(g.resident_bytes() == 0 for g in managed)
            else:
                grads_zero = all(bool((p.main_grad == 0).all()) for p in ctrl.units[i].params)
            frozen_checks[i] = dict(
                params_same=digest(ctrl.units[i].params) == probe["before"][i][0],
                moments_same=digest(optimizer_moments(ctrl, i)) == probe["before"][i][1],
                grad_buffer_zero=grads_zero, requires_grad=probe["requires_grad"][i])
        # As this step ran (end_step may change them).
        tiers, core_exact, stable_fallback = list(ctrl.tiers), ctrl.core_exact, ctrl.stable_fallback
        from megatron_grpo.comm.wire import wire_counter

        # The step's collectives so far (the loop resets the counter after this hook): every
        # rank must issue the same ones whatever its data.
        wire = wire_counter().snapshot()
        base_after(iteration)
        pending = dict(ef_units=sorted({k[0] for k in ctrl.ef.keys()}),
                       carry_units=sorted({k[0] for k in ctrl.carry}), tiers_after=list(ctrl.tiers))
        all_params = [p for chunk in probe["built"].ddp_model for p in chunk.module.parameters()]
        # Parameters every tensor-parallel rank holds a copy of (layernorms, row-parallel biases).
        replicated = [p for p in all_params if not getattr(p, "tensor_model_parallel", False)]
        dp, comp = ctrl.dp_size, ctrl.compressor
        expected = {"core": 0, "dynamic": 0, "stable": 0}
        for unit, tier in zip(ctrl.units, tiers):
            if tier == "stable" and not ctrl.step.stable_update:
                continue
            # Core is compressed with --grpo-core-compressor after the exact warm-up, except a
            # unit pinned to core (copies on two pipeline stages) or once remediation sent core
            # exact; dp 1 sends nothing either way.
            unit_comp = comp if tier == "dynamic" else (
                ctrl.core_compressor if tier == "core" and ctrl.tiered and not unit.pinned
                and not core_exact else None)
            # --grpo-stable-mode compressed: stable sends its own compressor every step, the
            # dynamic tier's once remediation found it bad.
            if tier == "stable" and ctrl.config.stable_mode == "compressed" and ctrl.tiered:
                unit_comp = comp if stable_fallback else build_compressor(
                    ctrl.config.stable_compressor, ctrl.config.compress_chunk)
            for b in unit.group.buckets:
                n = b.grad_data.numel()
                if unit_comp is not None:
                    payload = unit_comp.payload_bytes(n // dp)
                    expected[tier] += 2 * (dp - 1) * payload  # all_to_all out + all-gather
                    rep = ctrl.replicated.get((unit.index, unit.group.buckets.index(b)))
                    if rep is not None:  # exact all-reduces of replicated grads and values
                        expected[tier] += 2 * (2 * (dp - 1) * 4 * rep.numel // dp)
                else:  # fp32 gradient reduce-scatter + all-gather of the parameters' own dtype
                    expected[tier] += (dp - 1) * (n // dp) * (4 + b.param_data.element_size())
        from megatron.core import parallel_state as ps

        if fake_streams:
            pending["stream_log"] = list(probe["stream_log"])
            probe["stream_log"].clear()
        records.append(dict(tp=ps.get_tensor_model_parallel_rank(),
                            pp=ps.get_pipeline_model_parallel_rank(), iteration=iteration, tiers="".join(t[0] for t in tiers),
                            digest=digest(all_params), replicated_digest=digest(replicated),
                            frozen=frozen_checks, expected=expected, calls=wire["calls"],
                            stable_update=ctrl.step.stable_update, skipped=ctrl.step_skipped,
                            injected=probe["injected"],
                            ef_digest=digest([ctrl.ef.residual(k) for k in sorted(ctrl.ef.keys())]),
                            accum_digest=digest([ctrl.accum[k][0] for k in sorted(ctrl.accum)]),
                            accum_counts=[ctrl.accum[k][1] for k in sorted(ctrl.accum)],
                            carry_digest=digest([ctrl.carry[k] for k in sorted(ctrl.carry)]),
                            **pending))

    hooks.after_build, hooks.before_step, hooks.after_step = after_build, before_step, after_step
    run(cfg, hooks)
    # Buckets whose shard on this rank holds no parameter element (only padding).
    from megatron_grpo.comm.replicated import bucket_ranges

    ctrl = probe["ctrl"]
    rank = dist.get_rank(ctrl.dp_group)
    padding_only = 0
    for unit in ctrl.units:
        for b in unit.group.buckets:
            shard = b.grad_data.numel() // ctrl.dp_size
            lo, hi = rank * shard, (rank + 1) * shard
            if not any(start < hi and end > lo for start, end in bucket_ranges(b).values()):
                padding_only += 1
    records[-1]["padding_only_shards"] = padding_only
    write_gathered(out_path, records, units=[u.numel for u in probe["ctrl"].units],
                   names=[u.name for u in probe["ctrl"].units])


if __name__ == "__main__":
    main()
    leave()
