"""Phase c: the small bf16 model on one rank (NCCL on the device, gloo on the CPU).

Four runs: the megatron baseline (with GRPO's unit size as its bucket size, so both sum
gradient norms in the same order) twice, GRPO, and GRPO with the memory tier (--grpo-offload
cpu: optimizer state and residuals streamed to host memory). What must hold:

* the baseline twice gives the same losses (the control: the comparisons below are bit for bit,
  so they need deterministic kernels; CUBLAS_WORKSPACE_CONFIG is fixed for these runs);
* GRPO's warm-up (every unit core: megatron's own exact sync) gives the baseline's losses bit
  for bit: GRPO's hooks, side stream and importance measurement change nothing before tiering;
* the memory tier changes no bit: same losses every iteration, same validation loss, and state
  did leave the device. Its hidden share (copies overlapped with compute) is
  reported.
"""

from __future__ import annotations

from typing import List

from . import specs
from .common import Expect, finite, median, table
from .runs import TrainRun


def runs(ctx) -> List[TrainRun]:
    n = specs.iters(ctx.cpu)
    model, grpo = specs.model(ctx.cpu, n), specs.grpo(ctx.cpu)
    bucket = specs.bucket_elements([*model, *grpo], world_size=1)
    base = [*model, "--ddp-bucket-size", str(bucket)]
    env = specs.DETERMINISTIC_ENV
    return [TrainRun("c_base", "c", base, env=dict(env)),
            TrainRun("c_base_again", "c", base, env=dict(env)),
            TrainRun("c_grpo", "c", [*model, *grpo], env=dict(env)),
            TrainRun("c_grpo_offload", "c", [*model, *grpo, *specs.OFFLOAD], env=dict(env))]


def check_run(ex: Expect, run: TrainRun) -> bool:
    """Finished, every loss finite, no skipped step."""
    if not ex.that(run.ok, run.describe()):
        return False
    bad = [r["iteration"] for r in run.records if not finite(r.get("loss")) or r.get("skipped")]
    return ex.that(not bad, f"{run.name}: finite losses, no skipped step" + (f"; not at {bad[:6]}" if bad else ""))


def check_warmup(ex: Expect, base: List[dict], grpo: List[dict], warmup: int) -> None:
    maps = [r.get("grpo_tier_map", "") for r in grpo]
    ex.that(len(maps) > warmup and all(set(m) == {"c"} for m in maps[:warmup])
            and {"c", "d", "s"} <= set(maps[warmup]),
            f"GRPO: iterations 1-{warmup} all core, then tiers {maps[warmup] if len(maps) > warmup else None!r}")
    ex.equal([r["loss"] for r in grpo[:warmup]], [r["loss"] for r in base[:warmup]],
             f"GRPO warm-up losses (iterations 1-{warmup}) = the baseline's, bit for bit")


def check_offload(ex: Expect, plain: List[dict], offload: List[dict], label: str) -> None:
    ex.equal([r["loss"] for r in offload], [r["loss"] for r in plain],
             f"{label}: losses with the memory tier = without")
    ex.equal(offload[-1].get("val_loss") if offload else None, plain[-1].get("val_loss") if plain else None,
             f"{label}: validation loss with the memory tier = without")
    moved = max((r.get("offload_bytes_dynamic_cpu", 0) + r.get("offload_bytes_stable_cpu", 0)
                 for r in offload), default=0)
    ex.that(moved > 0, f"{label}: the dynamic and stable tiers' state left the device "
            f"(up to {moved:,} B in host memory)")
    shares = [r.get("offload_hidden_share") for r in offload if "offload_hidden_share" in r]
    ex.info(f"{label}: offload copies hidden behind compute, median share {median(shares):.3f} "
            f"(offload_hidden_share)")


def row(run: TrainRun) -> list:
    r = run.records
    peak = max((x.get("peak_device_bytes", 0) for x in r), default=0)
    return [run.name, f"{len(r)}/{run.train_iters}",
            f"{r[0]['loss']:.4f} -> {r[-1]['loss']:.4f}" if r else "-",
            r[-1].get("val_loss") if r else None, run.platform,
            1e3 * median([x.get("step_time_s") for x in r[2:]]) if r else None,
            round(peak / 2**20, 1) if peak else None]


HEADERS = ["run", "iters", "loss first -> last", "val loss", "platform", "median step ms", "peak MiB"]


def analyze(ex: Expect, ctx, train_runs: List[TrainRun]) -> str:
    by = {r.name: r for r in train_runs}
    base, again, grpo, off = by["c_base"], by["c_base_again"], by["c_grpo"], by["c_grpo_offload"]
    ok = [check_run(ex, r) for r in (base, grpo, off)]
    if not ctx.cpu:
        for r in (base, grpo, off):
            ex.that(bool(r.platform) and r.platform.startswith("nccl/cuda"),
                    f"{r.name}: platform {r.platform} (nccl/cuda)")
    if ok[0] and check_run(ex, again):  # the control: without it a mismatch below could be the device's
        ex.equal(again.losses, base.losses, "the baseline twice: the same losses (these kernels are "
                 "deterministic here, which the bit-for-bit comparisons rely on)")
    if ok[0] and ok[1]:
        check_warmup(ex, base.records, grpo.records, specs.warmup(ctx.cpu))
    if ok[1] and ok[2]:
        check_offload(ex, grpo.records, off.records, "1 rank")
    return table(HEADERS, [row(r) for r in (base, again, grpo, off)])
