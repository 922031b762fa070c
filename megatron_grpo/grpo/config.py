"""GRPOConfig: every setting of Gradient-aware Resource Partitioning Optimization.

Each field is a ``--grpo-<name>`` flag (``enabled`` is ``--grpo``) with its docstring as help.
``validate()`` runs before any process-group work and names the field, the accepted range and
the value it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_grpo.comm.link_decision import MODES as COMPRESS_MODES
from megatron_grpo.comm.residual_dtypes import RESIDUAL_DTYPES

TIERS = ("core", "dynamic", "stable")
"""The tier names, in rank order; the one definition (tiers.py, the bench and the glue import it)."""
COMPRESSORS = ("int4", "int8", "topk", "powersgd")
CORE_COMPRESSORS = ("none", "int8", "int4")
STABLE_MODES = ("frozen", "delayed", "compressed", "local")
STABLE_COMPRESSORS = ("int2", "int4", "int8")
SPARSE_TIERS = ("no-stable", "any")
TIER_POLICIES = ("importance", "random", "inverse")
IMPORTANCE_SCORES = ("grad-weight", "grad", "fisher")
INTERNODE_PRESETS = ("none", "source")
GRAD_ACCUMULATION = ("device", "host")
SAMPLE_DGRAD = ("none", "stable", "below-core")
SAMPLE_POLICIES = ("importance", "uniform")


class ConfigError(ValueError):
    """A user-facing configuration problem; the message names the flag/field and the fix.
    Defined here, the lowest layer, so the megatron glue raises it without importing the
    training entry (megatron_grpo.training.arguments re-exports it)."""


class GRPOConfigError(ValueError):
    """A GRPO setting is out of range; the message names the flag and the accepted values."""


def default_bucket_elements(dp: int) -> int:
    """megatron's DDP bucket size (elements) when none is given: max(4e7, 1e6 dp)
    (distributed_data_parallel.py, megatron-core 0.16.1). The one copy of the formula: the glue
    (megatron/ddp.py), the checkpoint layout and the planners use it."""
    return max(40_000_000, 1_000_000 * dp)


@dataclass
class GRPOConfig:
    """Gradient-aware Resource Partitioning Optimization (not Group Relative Policy Optimization)."""

    FLAG_PREFIX = "grpo-"
    FLAG_NAMES = {"enabled": "--grpo"}

    enabled: bool = False
    """Turn GRPO on: tiered communication/compute inside megatron DDP and the distributed optimizer."""
    core_share: float = 0.15
    """Share of parameters in the core tier (the most important units: int8 every step by
    default, exact with --grpo-core-compressor none)."""
    dynamic_share: float = 0.85
    """Share of parameters in the dynamic tier (compressed communication with error feedback).
    The defaults (core 0.15 int8, dynamic 0.85 int4, no stable tier) are the bytes-vs-quality
    front's best-quality compressed point; a stable tier saves compute or memory, not bytes
    (figures: docs/results.md)."""
    stable_share: float = 0.0
    """Share of parameters in the stable tier (updated every --grpo-stable-interval steps). Off
    by default: it buys backward compute (--grpo-stable-mode frozen) or memory (state offloaded
    between updates) at a quality cost; 0.2 was the former default."""
    bucket_mb: float = 128.0
    """Size of a tier unit (one DDP gradient bucket) in MB of fp32 gradients."""
    warmup_iters: int = 100
    """Exact (baseline) steps that gather importance before the first tiering."""
    retier_interval: int = 500
    """Iterations between re-tierings after warm-up."""
    importance_interval: int = 1
    """Measure importance every this many iterations."""
    importance_decay: float = 0.9
    """EMA decay of the importance score (weight of the previous value)."""
    importance_score: str = "grad-weight"
    """Per-parameter score behind the ranking: grad-weight = sum |g|*|w| (first-order loss change
    of a relative perturbation), grad = sum |g|, fisher = sum g^2 (diagonal empirical Fisher).
    Units are ranked by score per element (density)."""
    tier_policy: str = "importance"
    """How units are ranked into tiers: importance (production), or, as ablation settings only,
    random (a fresh seeded draw at every re-tier, the same on every rank, same shares) and
    inverse (the least important units go to core, the most important to stable)."""
    hysteresis: float = 0.1
    """Relative score margin a bucket must cross before it changes tier (no flapping)."""
    compressor: str = "int4"
    """Dynamic-tier compressor: int4 (~8:1 vs fp32), int8 (~4:1), topk, or powersgd (a
    PowerSGD-style rank-r peer for benchmarks: two all-reduces of the low-rank factors)."""
    core_compressor: str = "int8"
    """Core-tier compressor: int8 (default) or int4 with error feedback, like the dynamic tier
    but with its own residuals, or none (exact, bit-identical to megatron's own sync). The
    ranking then decides how many bits a unit gets (core int8, dynamic --grpo-compressor; what
    the ranking buys: docs/grpo.md). The warm-up and units with copies on several pipeline
    stages (the tied embedding) stay exact."""
    compress: str = "auto"
    """Where the tiers' formats are used: auto (where the compressed sync measured at start is
    at most 0.9x the exact one's time on this run's group, confirmed by an A/B of step time
    after the warm-up), all (every tier compresses everywhere), inter-node (only a group whose
    ranks span nodes) or none (every sync exact, megatron's own; importance, tiers, the memory
    tier and the sampled backward still run). docs/links.md."""
    compress_ab_steps: int = 4
    """Steps of each half of --grpo-compress auto's A/B (compressed, then exact) after the
    warm-up; 0: the start-up measurement alone decides."""
    compress_chunk: int = 256
    """Elements sharing one fp32 scale in int4/int8 quantisation."""
    topk_ratio: float = 0.05
    """Share of elements the top-k compressor keeps."""
    powersgd_rank: int = 4
    """Rank r of the powersgd compressor (bucket viewed as a ~square matrix; bytes ~ 2 r sqrt(N))."""
    compress_param_gather: bool = True
    """Send compressed buckets' parameter updates quantised (dynamic, and core with
    --grpo-core-compressor; the owner keeps exact master weights)."""
    stable_interval: int = 10
    """The stable tier is updated (wgrad, sync, optimizer step) every this many iterations; 0
    never updates it (the static-freeze ablation: units frozen at the first tiering stay frozen
    until a re-tier moves them)."""
    stable_mode: str = "delayed"
    """delayed: stable units compute their gradients every step and accumulate them locally;
    the mean goes out, exactly, every --grpo-stable-interval steps (no bytes in between, compute
    as the baseline). frozen: no weight-gradient compute between updates (saves backward work),
    but those steps' gradients are lost; delayed is the default because it measured better
    (docs/grpo.md). compressed: stable units sync every step like the dynamic tier, through
    --grpo-stable-compressor (2 bits by default) with error feedback of their own: the ranking
    then gives the least important units the fewest bits (--grpo-stable-interval is unused).
    local (needs --num-distributed-optimizer-instances > 1): stable units train every step
    inside their instance (megatron's exact sync there) and cross instances every
    --grpo-stable-interval steps as parameter deltas through the outer optimizer
    (--grpo-outer-lr), sent with --grpo-stable-compressor and error feedback."""
    stable_compressor: str = "int2"
    """Compressor of the stable tier in --grpo-stable-mode compressed: int2 (four levels per
    chunk set by its RMS, ~14:1 vs fp32), int4 or int8, one fp32 scale per chunk
    (--grpo-compress-chunk). A compressed stable tier whose relative compression error stays
    above --grpo-max-compression-error is sent with --grpo-compressor from then on."""
    gvr_interval: int = 10
    """Measure the dynamic tier's compression health (GVR, relative error, cosine) every this
    many iterations."""
    gvr_min: float = 0.7
    """Lower end of the GVR range reported as healthy (grpo_gvr_in_range; reported, no action)."""
    gvr_max: float = 1.2
    """Upper end of the GVR range reported as healthy (grpo_gvr_in_range; reported, no action)."""
    max_compression_error: float = 0.98
    """Remediation limit on the dynamic tier's relative compression error ||D(q) - c|| / ||c||
    (c = gradient + error-feedback residual). Error feedback needs it below 1 to converge;
    healthy compressors read int4 ~0.1, int8 ~0.01, top-k keeping 5 percent ~0.8."""
    gvr_window: int = 3
    """Consecutive monitoring checks above --grpo-max-compression-error that trigger remediation."""
    remediation_promote: float = 0.25
    """Share of dynamic buckets (the worst by relative compression error) promoted to core on
    remediation."""
    sparse_gradient_tier: str = "no-stable"
    """Tiering of units holding a sparse-gradient parameter (the word embedding: only the rows of
    tokens in the batch get a gradient). no-stable: core or dynamic, never stable (frozen stable
    mode would drop every gradient row seen between updates, 9 of 10 at --grpo-stable-interval
    10); any: tiered by importance like every other unit."""
    max_dynamic_share: float = 0.85
    """Guard: the dynamic tier never holds more than this share of parameters (the default
    dynamic share; units past it go to core)."""

    core_sync_interval: int = 1
    """Between distributed-optimizer instances (--num-distributed-optimizer-instances > 1, one
    per node): 1 syncs the core tier every step (exact, or --grpo-core-compressor); H > 1 trains
    it locally inside each instance and averages the instances' parameter deltas every H steps
    through the outer optimizer, sent with --grpo-core-compressor (none: exact)."""
    dynamic_sync_interval: int = 1
    """Between instances: 1 sends the dynamic tier's gradients compressed every step; H > 1
    trains it locally inside each instance (exact sync there) and averages the instances'
    parameter deltas every H steps through the outer optimizer, compressed with --grpo-compressor
    and error feedback (local updates, as DiLoCo). 1 stays the default: local updates cut the
    inter-node bytes far more and cost validation loss (docs/internode.md, "Measured")."""
    outer_lr: float = 1.0
    """Outer learning rate of the periodic tiers: at a sync each instance's shard becomes
    anchor - lr * (Nesterov step on the instances' mean delta, anchor - local). 1.0 with
    --grpo-outer-momentum 0 is plain parameter averaging; DiLoCo uses 0.7 with momentum 0.9."""
    outer_momentum: float = 0.0
    """Nesterov momentum of the outer optimizer (0: none). Its buffer is per unit and shard,
    identical on every instance, and checkpointed. DiLoCo's 0.7 / 0.9 (made for ~500-step
    periods) cost quality with syncs every 4-10 steps (docs/internode.md), hence plain averaging
    by default."""
    internode_preset: str = "none"
    """none, or source: the source material's per-tier sync periods 100 / 50 / 200, read as
    core exact every 100 steps, dynamic every 50 (int4, ~8:1), stable (20 %, local mode) every
    200, re-tier every 200 so tiers change only when every instance agrees. It sets
    core/dynamic/stable shares 0.15/0.65/0.2, --grpo-core-compressor none, --grpo-stable-compressor
    int4 and the intervals above, overriding those flags. Needs instances > 1."""

    release_grads: bool = True
    """Gradient memory per tier unit: each unit (DDP bucket) gets storage of its own, allocated
    when backward writes its first gradient and released once its sync has finished; only this
    rank's shard stays, until the optimizer step has used it. Frozen stable units hold none.
    Off: megatron's one gradient buffer for the whole model, resident all the time
    (docs/offload.md, "Gradient memory")."""
    first_batch_overlap: bool = True
    """With --overlap-grad-reduce and gradient release: in the first iteration too, a unit's
    sync starts once each of its parameters' gradients is ready. megatron's first batch waits
    for the end of backward instead (it learns how often each gradient hook fires), so every
    unit's full gradient is resident at once: the run's peak. A hook firing again after its
    unit's sync started is an error naming the parameter; turn this off for such a model."""
    grad_accumulation: str = "device"
    """Where a unit's gradient adds up over a step's micro-batches. device: megatron's, in the
    unit's gradient storage, full from the first micro-batch to the last one's sync. host: once
    a micro-batch's backward has produced every gradient of a unit (before the last
    micro-batch), the unit's gradient is added into an fp32 accumulator in host memory and its
    device storage freed; the last micro-batch adds it back just before the unit's sync. The
    sum is the same in fp32 (bit for bit on CPU); the device then holds a few units' gradients
    at a time instead of the whole model's, for host memory (4 bytes per element) and PCIe
    traffic (docs/offload.md). Needs gradient release, the distributed optimizer and
    --overlap-grad-reduce."""
    grad_units_in_flight: int = 2
    """With --overlap-grad-reduce: at most this many units' syncs are outstanding during
    backward; before another starts, the oldest is waited for and its full gradient released.
    Larger keeps more communication overlapped at the cost of that many units' gradients."""
    residual_dtype: str = "int8"
    """Storage of the error-feedback residuals: int8 with one fp32 scale per
    --grpo-compress-chunk elements (a quarter of fp32's bytes), bf16 (half) or fp32. The
    residual is kept in this precision between steps; the compressed sync itself is unchanged.
    int8 is the default because it cost less than 0.1 point of late loss against fp32
    (docs/studies/2026-12-03-residual-dtype.md; memory: docs/offload.md, "Gradient memory")."""

    sampled_backward: bool = False
    """Compute the weight gradients of the dynamic and stable tiers' linear layers from a sample
    of token rows, kept with probability ~ |dy_i| |x_i| and reweighted by 1/p (unbiased; core
    stays exact). Each unit's keep ratio follows --grpo-sample-variance-budget (docs/compute.md)."""
    sample_variance_budget: float = 0.25
    """Variance the sampled weight gradient may add, as a share of the micro-batch's own
    gradient variance (estimated from the same rows): 0.25 adds the noise of a batch 0.8 the
    size. Each unit's keep ratio is the smallest that meets it, within the floor and ceiling."""
    sample_min_keep: float = 0.1
    """Floor of a unit's keep ratio (share of token rows whose weight gradient is computed)."""
    sample_max_keep: float = 1.0
    """Ceiling of a unit's keep ratio (1: a unit whose gradient needs every row stays exact)."""
    sample_interval: int = 10
    """Measure the keep ratio the budget needs every this many iterations (one small
    all-reduce over the job each time, so every rank keeps the same ratios)."""
    sample_dgrad: str = "none"
    """Sample data gradients too (rows kept with probability ~ |dy_i|, reweighted): none, stable
    (the stable tier's layers) or below-core (dynamic and stable). The layers below then see
    zero rows and their own sampling skips them."""
    sample_policy: str = "importance"
    """How rows are chosen: importance (probability ~ leverage, production) or uniform (every
    row with the unit's keep ratio: the ablation that asks whether importance matters)."""

    PRESETS = {"source": {"core_share": 0.15, "dynamic_share": 0.65, "stable_share": 0.2,
                          "core_compressor": "none", "core_sync_interval": 100,
                          "compressor": "int4", "dynamic_sync_interval": 50,
                          "stable_mode": "local", "stable_interval": 200,
                          "stable_compressor": "int4", "retier_interval": 200}}

    def apply_preset(self) -> None:
        """Set the fields --grpo-internode-preset names (before validate)."""
        if self.internode_preset not in INTERNODE_PRESETS:
            raise GRPOConfigError(f"--grpo-internode-preset must be one of "
                                  f"{', '.join(INTERNODE_PRESETS)}, got {self.internode_preset!r}")
        for field, value in self.PRESETS.get(self.internode_preset, {}).items():
            setattr(self, field, value)

    def sync_interval(self, tier: str) -> int:
        """Steps between the tier's syncs across instances (1: every step, no local updates)."""
        if tier == "core":
            return self.core_sync_interval
        if tier == "dynamic":
            return self.dynamic_sync_interval
        return self.stable_interval if self.stable_local else 1

    # The stable modes, asked by name (the one place their strings are compared).
    @property
    def stable_frozen(self) -> bool:
        """--grpo-stable-mode frozen: no gradient between updates, nothing sent."""
        return self.stable_mode == "frozen"

    @property
    def stable_delayed(self) -> bool:
        """--grpo-stable-mode delayed: gradients summed locally, their mean sent at updates."""
        return self.stable_mode == "delayed"

    @property
    def stable_local(self) -> bool:
        """--grpo-stable-mode local: trained inside each instance, averaged between them every
        --grpo-stable-interval steps (compressed inside the instance every step)."""
        return self.stable_mode == "local"

    @property
    def stable_compressed(self) -> bool:
        """--grpo-stable-mode compressed: every step, through --grpo-stable-compressor."""
        return self.stable_mode == "compressed"

    @property
    def stable_every_step(self) -> bool:
        """The stable tier syncs every step through its compressor (compressed, or local inside
        an instance), so it has no updates to wait for."""
        return self.stable_compressed or self.stable_local

    @property
    def periodic(self) -> bool:
        """Some tier trains locally between syncs across instances."""
        return any(self.sync_interval(t) > 1 for t in TIERS) or self.stable_local

    def validate(self, world_size: Optional[int] = None) -> None:
        def fail(field: str, accepted: str, value) -> None:
            flag = self.FLAG_NAMES.get(field, "--" + self.FLAG_PREFIX + field.replace("_", "-"))
            raise GRPOConfigError(f"{flag} must be {accepted}, got {value!r}")

        for name in ("core_share", "dynamic_share", "stable_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                fail(name, "in [0, 1]", value)
        total = self.core_share + self.dynamic_share + self.stable_share
        if abs(total - 1.0) > 1e-6:
            raise GRPOConfigError(
                f"--grpo-core-share + --grpo-dynamic-share + --grpo-stable-share must sum to 1, got "
                f"{self.core_share} + {self.dynamic_share} + {self.stable_share} = {total:g}")
        if not self.bucket_mb > 0:
            fail("bucket_mb", "a positive number of MB", self.bucket_mb)
        if self.compress not in COMPRESS_MODES:
            fail("compress", "one of " + ", ".join(COMPRESS_MODES), self.compress)
        if isinstance(self.compress_ab_steps, bool) or not isinstance(self.compress_ab_steps, int) \
                or self.compress_ab_steps < 0:
            fail("compress_ab_steps", "an integer >= 0 (0: no A/B)", self.compress_ab_steps)
        if isinstance(self.stable_interval, bool) or not isinstance(self.stable_interval, int) \
                or self.stable_interval < 0:
            fail("stable_interval", "an integer >= 0 (0: never, the static-freeze ablation)",
                 self.stable_interval)
        for name in ("retier_interval", "importance_interval",
                     "gvr_interval", "gvr_window", "compress_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                fail(name, "a positive integer", value)
        if not isinstance(self.warmup_iters, int) or self.warmup_iters < 0:
            fail("warmup_iters", "an integer >= 0", self.warmup_iters)
        if not 0.0 <= self.importance_decay < 1.0:
            fail("importance_decay", "in [0, 1)", self.importance_decay)
        if not 0.0 <= self.hysteresis < 1.0:
            fail("hysteresis", "in [0, 1)", self.hysteresis)
        if self.compressor not in COMPRESSORS:
            fail("compressor", "one of " + ", ".join(COMPRESSORS), self.compressor)
        if self.core_compressor not in CORE_COMPRESSORS:
            fail("core_compressor", "one of " + ", ".join(CORE_COMPRESSORS), self.core_compressor)
        if not 0.0 < self.topk_ratio <= 1.0:
            fail("topk_ratio", "in (0, 1]", self.topk_ratio)
        if isinstance(self.powersgd_rank, bool) or not isinstance(self.powersgd_rank, int) \
                or self.powersgd_rank < 1:
            fail("powersgd_rank", "an integer >= 1", self.powersgd_rank)
        if self.importance_score not in IMPORTANCE_SCORES:
            fail("importance_score", "one of " + ", ".join(IMPORTANCE_SCORES), self.importance_score)
        if self.tier_policy not in TIER_POLICIES:
            fail("tier_policy", "one of " + ", ".join(TIER_POLICIES), self.tier_policy)
        if self.sparse_gradient_tier not in SPARSE_TIERS:
            fail("sparse_gradient_tier", "one of " + ", ".join(SPARSE_TIERS), self.sparse_gradient_tier)
        if self.stable_mode not in STABLE_MODES:
            fail("stable_mode", "one of " + ", ".join(STABLE_MODES), self.stable_mode)
        if self.stable_compressor not in STABLE_COMPRESSORS:
            fail("stable_compressor", "one of " + ", ".join(STABLE_COMPRESSORS), self.stable_compressor)
        if not 0.0 < self.gvr_min < self.gvr_max:
            raise GRPOConfigError(f"--grpo-gvr-min and --grpo-gvr-max must satisfy 0 < min < max, "
                                  f"got {self.gvr_min} and {self.gvr_max}")
        if not self.max_compression_error > 0.0:
            fail("max_compression_error", "a positive number", self.max_compression_error)
        if not 0.0 < self.remediation_promote <= 1.0:
            fail("remediation_promote", "in (0, 1]", self.remediation_promote)
        if not 0.0 <= self.max_dynamic_share <= 1.0:
            fail("max_dynamic_share", "in [0, 1]", self.max_dynamic_share)
        for name in ("core_sync_interval", "dynamic_sync_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, "an integer >= 1 (1: every step)", value)
        if self.stable_local and self.stable_interval < 1:
            fail("stable_interval", "an integer >= 1 with --grpo-stable-mode local", self.stable_interval)
        if not 0.0 < self.outer_lr <= 2.0:
            fail("outer_lr", "in (0, 2]", self.outer_lr)
        if not 0.0 <= self.outer_momentum < 1.0:
            fail("outer_momentum", "in [0, 1)", self.outer_momentum)
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            fail("grad_accumulation", "one of " + ", ".join(GRAD_ACCUMULATION), self.grad_accumulation)
        if self.grad_accumulation == "host" and not self.release_grads:
            fail("release_grads", "on with --grpo-grad-accumulation host (the units' gradient "
                 "storage is what leaves the device)", self.release_grads)
        if isinstance(self.grad_units_in_flight, bool) or not isinstance(self.grad_units_in_flight, int) \
                or self.grad_units_in_flight < 1:
            fail("grad_units_in_flight", "an integer >= 1", self.grad_units_in_flight)
        if self.residual_dtype not in RESIDUAL_DTYPES:
            fail("residual_dtype", "one of " + ", ".join(RESIDUAL_DTYPES), self.residual_dtype)
        if self.internode_preset not in INTERNODE_PRESETS:
            fail("internode_preset", "one of " + ", ".join(INTERNODE_PRESETS), self.internode_preset)
        if self.periodic and self.compressor in ("topk", "powersgd") and self.dynamic_sync_interval > 1:
            fail("compressor", "int4 or int8 with --grpo-dynamic-sync-interval > 1 (the deltas "
                 "are quantised)", self.compressor)
        if not 0.0 < self.sample_variance_budget:
            fail("sample_variance_budget", "a positive number", self.sample_variance_budget)
        if not 0.0 < self.sample_min_keep <= self.sample_max_keep <= 1.0:
            raise GRPOConfigError(f"--grpo-sample-min-keep and --grpo-sample-max-keep must satisfy "
                                  f"0 < min <= max <= 1, got {self.sample_min_keep} and "
                                  f"{self.sample_max_keep}")
        if isinstance(self.sample_interval, bool) or not isinstance(self.sample_interval, int) \
                or self.sample_interval < 1:
            fail("sample_interval", "an integer >= 1", self.sample_interval)
        if self.sample_dgrad not in SAMPLE_DGRAD:
            fail("sample_dgrad", "one of " + ", ".join(SAMPLE_DGRAD), self.sample_dgrad)
        if self.sample_policy not in SAMPLE_POLICIES:
            fail("sample_policy", "one of " + ", ".join(SAMPLE_POLICIES), self.sample_policy)
        if self.dynamic_share > self.max_dynamic_share:
            raise GRPOConfigError(f"--grpo-dynamic-share ({self.dynamic_share}) exceeds "
                                  f"--grpo-max-dynamic-share ({self.max_dynamic_share})")

    @property
    def bucket_elements(self) -> int:
        """DDP bucket size in elements (fp32 gradients: 4 bytes each)."""
        return max(1, int(self.bucket_mb * 1024 * 1024 / 4))
