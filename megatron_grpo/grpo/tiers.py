"""Tier planning: which DDP bucket is core, dynamic or stable, and when that changes.

Every data-parallel rank runs the planner on its own, on the all-reduced importance scores, and
must reach the same answer (different tiers mean mismatched collectives and a hang). So the
planner is pure Python over floats and ints, with every tie broken by bucket index.

Rounding rule (a bucket is never split): a tier is filled walking buckets in its order (core:
densest first; stable: least dense first) and takes the next bucket while that brings the tier's
element count strictly closer to its quota ``share * total``, i.e. while
``taken + numel / 2 < quota``; the first bucket that does not stops the fill. An exact
half-way bucket is not taken, and a bucket larger than twice the quota is never taken, so a tier
can end up empty. The fill stops rather than skipping ahead to a smaller, less dense bucket, so
(before hysteresis) core is always the densest buckets and stable the least dense.

Hysteresis (pairwise, relative margin ``h``): when the current tiers are given, buckets that are
core now rank for the core fill with density ``d * (1 + h)`` and buckets that are stable now
rank for the stable fill with ``d / (1 + h)``. So an incumbent is displaced only by a challenger
denser (core) or sparser (stable) than itself by more than the factor ``1 + h``: the "threshold"
a bucket must cross by the margin is the density of the bucket it would trade places with.
Quotas stay filled by the rounding rule above (unlike a fixed threshold per tier, which can empty
the core when the incumbent drops but the challenger sits just above the old boundary).
Constant scores give zero moves: incumbents only gain from the bonus. With unequal bucket sizes
the fill is order-dependent (a newcomer, once incumbent, can reorder the prefix), so a re-plan is
repeated with its own result as incumbent until it stops changing (at most ``SETTLE_ROUNDS``);
the plan returned is then a fixed point and the next re-plan on unchanged scores moves nothing.

Dynamic guard: if dynamic then holds more than ``max_dynamic_share`` of the elements, its densest
buckets (incumbent core first, as in the core ranking) move to core until it does not.

One unit: a model whose gradients fit in one bucket has nothing to partition, and compressing
its lone unit would only trade quality for bytes with no exact part left. GRPO then never tiers:
the unit stays core with megatron's exact collectives for the whole run, and the start-up says
so once (``lone_unit_notice``), so that GRPO can be switched on for any model.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_grpo.grpo.config import TIERS  # noqa: E402 - the one definition


@dataclass
class TierPlan:
    """The outcome of one planning: a tier per bucket and what changed."""

    tiers: List[str]
    """Tier of each bucket, in bucket order."""
    moved: List[Tuple[int, str, str]] = field(default_factory=list)
    """(bucket, old tier, new tier) for each bucket that changed, by bucket index."""
    shares: Dict[str, float] = field(default_factory=dict)
    """Share of all gradient elements held by each tier."""
    reason: str = ""
    """Why the plan was made (initial, re-tier, remediation) and what guards fired."""


def _as_floats(values, name: str) -> List[float]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    out = [float(v) for v in values]
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0.0:
            raise ValueError(f"{name}[{i}] must be a finite number >= 0, got {v}")
    return out


def _as_numels(values, n: int, name: str = "numels") -> List[int]:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    out = [operator.index(v) for v in values]
    if len(out) != n:
        raise ValueError(f"{name} must have one entry per bucket ({n}), got {len(out)}")
    for i, v in enumerate(out):
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
    return out


def _check_tiers(current: Sequence[str], n: int, name: str = "current") -> List[str]:
    out = list(current)
    if len(out) != n:
        raise ValueError(f"{name} must have one tier per bucket ({n}), got {len(out)}")
    for i, t in enumerate(out):
        if t not in TIERS:
            raise ValueError(f"{name}[{i}] must be one of {TIERS}, got {t!r}")
    return out


def _shares(tiers: Sequence[str], numels: Sequence[int]) -> Dict[str, float]:
    total = sum(numels)
    counts = {t: 0 for t in TIERS}
    for t, n in zip(tiers, numels):
        counts[t] += n
    return {t: (counts[t] / total if total else 0.0) for t in TIERS}


def _moves(old: Optional[Sequence[str]], new: Sequence[str]) -> List[Tuple[int, str, str]]:
    if old is None:
        return []
    return [(b, o, t) for b, (o, t) in enumerate(zip(old, new)) if o != t]


def _fill(order: Sequence[int], numels: Sequence[int], quota: float) -> List[int]:
    """Take buckets from the front of ``order`` while each brings the total closer to quota."""
    taken, total = [], 0
    for b in order:
        # |total + n - quota| < |total - quota|  <=>  total + n/2 < quota  (for n >= 0)
        if total + numels[b] / 2.0 < quota:
            taken.append(b)
            total += numels[b]
        else:
            break
    return taken


def lone_unit_notice(units: int, bucket_mb: float) -> str:
    """The start-up notice of a model replica with fewer than two tier units (see above)."""
    count = "one tier unit" if units == 1 else f"{units} tier units"
    return (f"GRPO has {count} in the whole model (its gradients fit in one --grpo-bucket-mb "
            f"{bucket_mb:g} MB bucket): nothing to tier, so it runs exactly as megatron would, "
            f"every step core with megatron's own collectives. For tiers, set --grpo-bucket-mb "
            f"smaller, below the model's gradient size (a few units at least); a DDP model built "
            f"by hand keeps its buckets without overlap_grad_reduce and on later pipeline stages "
            f"only as GRPODistributedDataParallel(..., grpo_config=<an enabled GRPOConfig>)")


def policy_density(policy: str, density: Sequence[float], k: int) -> List[float]:
    """The ranking key of each unit under ``--grpo-tier-policy`` (GRPOConfig.tier_policy).

    importance: the importance density itself. inverse: its reciprocal, so the planner's fill
    puts the least important units in core and the most important in stable (hysteresis still
    favours incumbents). random: uniform draws from a generator seeded by the iteration ``k``
    alone, so every rank of the job draws the same values without communicating.
    """
    d = _as_floats(density, "density")
    if policy == "importance":
        return d
    if policy == "inverse":
        return [1.0 / max(x, 1e-30) for x in d]
    if policy == "random":
        import torch

        gen = torch.Generator(device="cpu").manual_seed(0x9E3779B1 + int(k))
        return torch.rand(len(d), generator=gen, dtype=torch.float64).tolist()
    raise ValueError(f"tier policy must be importance, random or inverse, got {policy!r}")


class TierPlanner:
    """Assigns each bucket a tier from its importance density; see the module docstring."""

    SETTLE_ROUNDS = 8
    """Most extra hysteresis passes per re-plan (random trials needed at most 2)."""

    def __init__(self, core_share: float, dynamic_share: float, stable_share: float,
                 hysteresis: float, max_dynamic_share: float) -> None:
        for name, value in (("core_share", core_share), ("dynamic_share", dynamic_share),
                            ("stable_share", stable_share),
                            ("max_dynamic_share", max_dynamic_share)):
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        total = float(core_share) + float(dynamic_share) + float(stable_share)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"core_share + dynamic_share + stable_share must be 1, got "
                             f"{core_share} + {dynamic_share} + {stable_share} = {total:g}")
        if not 0.0 <= float(hysteresis) < 1.0:
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis!r}")
        if float(dynamic_share) > float(max_dynamic_share):
            raise ValueError(f"dynamic_share ({dynamic_share}) must not exceed "
                             f"max_dynamic_share ({max_dynamic_share})")
        self.core_share = float(core_share)
        self.dynamic_share = float(dynamic_share)
        self.stable_share = float(stable_share)
        self.hysteresis = float(hysteresis)
        self.max_dynamic_share = float(max_dynamic_share)
        self._last_numels: Optional[List[int]] = None

    @classmethod
    def from_config(cls, config) -> "TierPlanner":
        """Build from a ``GRPOConfig`` (or anything with the same field names)."""
        return cls(config.core_share, config.dynamic_share, config.stable_share,
                   config.hysteresis, config.max_dynamic_share)

    def plan(self, density: Sequence[float], numels: Sequence[int],
             current: Optional[Sequence[str]] = None, reason: Optional[str] = None,
             no_stable: Optional[Sequence[bool]] = None) -> TierPlan:
        """Tiers for buckets with importance ``density`` and ``numels`` gradient elements.

        ``current`` (the tiers in force, or None for the first plan) turns on hysteresis and
        fills ``moved``. Buckets flagged in ``no_stable`` rank for core and dynamic as usual but
        are skipped by the stable fill (sparse-gradient parameters, see GRPOConfig
        ``sparse_gradient_tier``). The result depends only on the arguments.
        """
        d = _as_floats(density, "density")
        n = len(d)
        sizes = _as_numels(numels, n)
        cur = _check_tiers(current, n) if current is not None else None
        keep_out = [bool(x) for x in no_stable] if no_stable is not None else [False] * n
        if len(keep_out) != n:
            raise ValueError(f"no_stable must have one entry per bucket ({n}), got {len(keep_out)}")
        tiers, guard = self._plan_once(d, sizes, cur, keep_out)
        if cur is not None:
            # Settle: re-plan with the result as incumbent until nothing changes, so that the
            # next re-tier on unchanged scores moves nothing. Only unequal bucket sizes need
            # this (the fill is order-dependent); random trials settled within 2 rounds. The
            # bound keeps it finite; any exit is still deterministic.
            for _ in range(self.SETTLE_ROUNDS):
                again, again_guard = self._plan_once(d, sizes, tiers, keep_out)
                if again == tiers:
                    break
                tiers, guard = again, again_guard
        notes = [reason or ("re-tier" if cur is not None else "initial plan")]
        if guard:
            notes.append(f"dynamic guard ({self.max_dynamic_share:g}) moved {len(guard)} "
                         f"bucket(s) to core: {guard}")
        self._last_numels = sizes
        return TierPlan(tiers=tiers, moved=_moves(cur, tiers), shares=_shares(tiers, sizes),
                        reason="; ".join(notes))

    def _plan_once(self, d: List[float], sizes: List[int], cur: Optional[List[str]],
                   no_stable: List[bool]) -> Tuple[List[str], List[int]]:
        """One pass of quota fill (with incumbency bonus when ``cur`` is given) and guard."""
        n = len(d)
        total = sum(sizes)
        bonus = 1.0 + self.hysteresis

        def core_key(b: int) -> Tuple[float, int]:
            # Densest first; ties by bucket index so every rank orders identically.
            boost = bonus if cur is not None and cur[b] == "core" else 1.0
            return (-d[b] * boost, b)

        def stable_key(b: int) -> Tuple[float, int]:
            # Least dense first; the reverse of the core order on ties (highest index first).
            damp = 1.0 / bonus if cur is not None and cur[b] == "stable" else 1.0
            return (d[b] * damp, -b)

        core = _fill(sorted(range(n), key=core_key), sizes, self.core_share * total)
        in_core = set(core)
        rest = [b for b in range(n) if b not in in_core and not no_stable[b]]
        stable = _fill(sorted(rest, key=stable_key), sizes, self.stable_share * total)
        tiers = ["dynamic"] * n
        for b in core:
            tiers[b] = "core"
        for b in stable:
            tiers[b] = "stable"
        return tiers, self._apply_guard(tiers, sizes, core_key)

    def _apply_guard(self, tiers: List[str], sizes: Sequence[int], core_key) -> List[int]:
        limit = self.max_dynamic_share * sum(sizes)
        dynamic = sorted((b for b, t in enumerate(tiers) if t == "dynamic"), key=core_key)
        held = sum(sizes[b] for b in dynamic)
        moved = []
        for b in dynamic:
            if held <= limit:
                break
            tiers[b] = "core"
            held -= sizes[b]
            moved.append(b)
        return moved

    def promote(self, current: Sequence[str], bucket_ids: Sequence[int], reason: str,
                numels: Optional[Sequence[int]] = None) -> TierPlan:
        """Remediation: move dynamic buckets ``bucket_ids`` to core.

        Buckets already core are left as they are (no move); a stable bucket is an error, since
        remediation only answers compression error in the dynamic tier. ``numels`` defaults to
        the sizes given to the last ``plan`` call and is used only for ``shares``. The promotion
        is not pinned: the next ``plan`` ranks the promoted buckets by density like any other
        core incumbent.
        """
        tiers = _check_tiers(current, len(current))
        n = len(tiers)
        if numels is None:
            if self._last_numels is None or len(self._last_numels) != n:
                raise ValueError("numels must be given when plan() has not been called for "
                                 f"these {n} buckets")
            sizes = self._last_numels
        else:
            sizes = _as_numels(numels, n)
        new = list(tiers)
        for raw in bucket_ids:
            b = operator.index(raw)
            if not 0 <= b < n:
                raise ValueError(f"bucket_ids entry {b} is out of range [0, {n})")
            if tiers[b] == "stable":
                raise ValueError(f"bucket_ids entry {b} is a stable bucket; only dynamic buckets "
                                 f"are promoted")
            new[b] = "core"
        return TierPlan(tiers=new, moved=_moves(tiers, new), shares=_shares(new, sizes),
                        reason=reason)


# ---------------------------------------------------------------------- GVR and remediation
def gradient_variance_ratio(applied: torch.Tensor, exact: torch.Tensor) -> float:
    """GVR of a tier on a sampled step: Var(applied) / Var(exact).

    ``applied`` is the gradient the optimizer actually receives for the tier's elements (after
    compression, error feedback, delay or freezing) and ``exact`` the exactly reduced gradient
    of the same elements on the same step, both flattened to one vector over all the tier's
    elements. Var is the element-wise variance across that vector (population form: with the
    same element count on both sides the ratio does not depend on the n / n-1 correction).
    GVR ~ 1: the applied gradient has the spread of the exact one; > 1: compression noise adds
    spread; < 1: updates are damped or dropped (a frozen stable step gives 0, so remediation
    watches the dynamic tier). Computed in float64. If the exact gradient has zero variance the
    result is 1.0 when the applied one does too, else inf. This reads a value back to the host;
    call it only on sampled steps.
    """
    if applied.numel() != exact.numel():
        raise ValueError(f"applied has {applied.numel()} elements but exact has {exact.numel()}")
    if exact.numel() == 0:
        raise ValueError("exact must have at least one element")
    a = applied.detach().reshape(-1).to(torch.float64)
    e = exact.detach().reshape(-1).to(torch.float64)
    var_a = float(a.var(unbiased=False))
    var_e = float(e.var(unbiased=False))
    if var_e == 0.0:
        return 1.0 if var_a == 0.0 else math.inf
    return var_a / var_e


def relative_error(applied: torch.Tensor, exact: torch.Tensor) -> float:
    """||applied - exact|| / ||exact|| (L2; 0 when both are zero, inf when only exact is)."""
    if applied.numel() != exact.numel():
        raise ValueError(f"applied has {applied.numel()} elements but exact has {exact.numel()}")
    a = applied.detach().reshape(-1).to(torch.float64)
    e = exact.detach().reshape(-1).to(torch.float64)
    num, den = float(torch.linalg.vector_norm(a - e)), float(torch.linalg.vector_norm(e))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


class GVRMonitor:
    """Counts bad health checks of one compressed tier in a row and picks the dynamic buckets to
    promote (megatron_grpo.grpo.health.HealthWatch keeps one per tier)."""

    def __init__(self, gvr_min: float, gvr_max: float, window: int, promote_share: float) -> None:
        if not 0.0 < float(gvr_min) < float(gvr_max):
            raise ValueError(f"gvr_min and gvr_max must satisfy 0 < gvr_min < gvr_max, got "
                             f"{gvr_min} and {gvr_max}")
        window = operator.index(window)
        if window <= 0:
            raise ValueError(f"window must be a positive integer, got {window}")
        if not 0.0 < float(promote_share) <= 1.0:
            raise ValueError(f"promote_share must be in (0, 1], got {promote_share!r}")
        self.gvr_min = float(gvr_min)
        self.gvr_max = float(gvr_max)
        self.window = window
        self.promote_share = float(promote_share)
        self.consecutive = 0
        """Out-of-range checks in a row so far."""

    @classmethod
    def from_config(cls, config) -> "GVRMonitor":
        return cls(config.gvr_min, config.gvr_max, config.gvr_window, config.remediation_promote)

    def update(self, tier_gvr: float) -> bool:
        """Record one GVR check; True on the ``window``-th out-of-range check in a row.

        The range is inclusive; NaN counts as out of range (a broken gradient is not healthy).
        After a trigger the count starts again, so a persisting problem triggers every
        ``window`` checks rather than on every check.
        """
        value = float(tier_gvr)
        return self.check(self.gvr_min <= value <= self.gvr_max)  # False for NaN

    def check(self, healthy: bool) -> bool:
        """Record one check judged elsewhere (e.g. relative compression error within its limit);
        True on the ``window``-th unhealthy check in a row, then the count starts again."""
        if healthy:
            self.consecutive = 0
            return False
        self.consecutive += 1
        if self.consecutive >= self.window:
            self.consecutive = 0
            return True
        return False

    def select_worst(self, dynamic_bucket_ids: Sequence[int],
                     per_bucket_error: Sequence[float]) -> List[int]:
        """The ``ceil(promote_share * len)`` buckets with the largest relative compression error.

        ``per_bucket_error[i]`` belongs to ``dynamic_bucket_ids[i]``. Worst first; ties by bucket
        index; NaN ranks as the worst. The product is rounded to 9 decimals before ``ceil`` so
        float noise (0.7 * 10 = 7.000000000000001) does not add a bucket.
        """
        ids = [operator.index(b) for b in dynamic_bucket_ids]
        errors = [float(e) for e in per_bucket_error]
        if len(errors) != len(ids):
            raise ValueError(f"per_bucket_error must have one entry per dynamic bucket "
                             f"({len(ids)}), got {len(errors)}")
        count = min(len(ids), math.ceil(round(self.promote_share * len(ids), 9)))
        ranked = sorted(range(len(ids)),
                        key=lambda i: (-math.inf if math.isnan(errors[i]) else -errors[i], ids[i]))
        return [ids[i] for i in ranked[:count]]


def describe_moves(plan: TierPlan, bucket_names: Sequence[str]) -> List[str]:
    """One line per moved bucket for the re-tier log, e.g. ``"layer 3: dynamic -> core"``."""
    names = list(bucket_names)
    lines = []
    for b, old, new in plan.moved:
        if not 0 <= b < len(names):
            raise ValueError(f"bucket_names has {len(names)} names but the plan moves bucket {b}")
        lines.append(f"{names[b]}: {old} -> {new}")
    return lines
