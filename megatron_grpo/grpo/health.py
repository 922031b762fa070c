"""Compression health of the compressed tiers: what a sampled step measures and how it is judged.

On a monitoring step every compressed bucket (dynamic, core with --grpo-core-compressor, stable
with --grpo-stable-mode compressed)
reports, before sending, what this rank delivers
(a = D(q)) and what it owed (c = g + r: this step's gradient plus the error-feedback residual).
Per unit, sums are kept in float64 over all elements: sum a, sum a^2, sum c, sum c^2, sum a*c,
count (fp32 partial sums over bounded chunks, added up in float64: see ``HealthSums.add``).
They are summed over every rank of the job (all data-parallel and model-parallel
ranks, one all-reduce of a small vector laid out over all units of the model replica; see
megatron_grpo.grpo.replica), so every rank derives the same figures:

* ``gvr``: Var(a) / Var(c), the gradient variance ratio of the design notes. Kept as a report.
  It is blind to sign errors and to error that leaves the variance alone (an int4 chunk with one
  outlier zeroes the other 255 elements and still reads ~1), and top-k reads ~0.3 by
  construction, so it cannot say "bad" reliably and drives no action.
* ``rel_error``: ||a - c|| / ||c||, the share of what was owed that this step held back.
  Error feedback converges when the compressor is contractive (rel_error < 1: what is held back
  is smaller than what was owed); a compressor at or above 1 (sign errors, noise, a broken
  decode) makes the residual grow without bound. Every healthy compressor reads below 1:
  int4 ~0.1, int8 ~0.01, top-k 5 % ~0.7-0.9 (it holds back most elements, but error feedback
  delivers them later). This is what remediation watches (``--grpo-max-compression-error``).
* ``cosine``: a.c / (||a|| ||c||), direction agreement; -1 for a sign flip.

All figures are pooled per tier; ``rel_error`` is also kept per unit to pick the dynamic units
to promote. ``HealthWatch`` judges each tier with a monitor of its own: a dynamic tier that
stays bad has its worst units promoted to core; a compressed core that stays bad goes exact
(promoting to it would not help); a compressed stable tier that stays bad is sent with the
dynamic tier's compressor.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

FIELDS = 6
"""Per-unit sums: a, a^2, c, c^2, a*c, count."""

HEALTH_CHUNK_ELEMENTS = 1 << 20
"""Elements of a bucket reduced at once by ``HealthSums.add``: bounds its temporaries (two fp32
chunks of 4 MB each at the default) and the length of each fp32 partial sum.
Read at call time, so tests can lower it."""


class HealthSums:
    """Per-unit sums of one monitoring step, on the device (no host sync while collecting)."""

    def __init__(self, num_units: int, device) -> None:
        self.values = torch.zeros(num_units, FIELDS, dtype=torch.float64, device=device)
        self.units: set = set()

    def add(self, unit: int, applied: torch.Tensor, owed: torch.Tensor) -> None:
        """Add one bucket's sums to ``unit``'s row. ``applied`` and ``owed`` are flat over the
        bucket, fp32 or bf16 (bf16 gradient buffers), contiguous (a strided one is copied whole).

        This runs inside the backward hook, on the stream of the compressed send, on every
        compressed bucket of a monitoring step. So it reduces one chunk at a time: each chunk is
        widened to fp32 (a no-op for fp32 input) and reduced to fp32 partial sums by sum/dot
        (dot accumulates without TF32, unlike a matmul), which are added into an fp64
        accumulator on the device. At most two chunk-sized fp32 temporaries live at once, and
        nothing waits on the host: the count is a Python number added in place (a kernel
        argument), never a tensor built from a float (a blocking host-to-device copy).

        The fifth partial is sum (a-c)^2, not sum a*c: rel_error needs ||a-c||^2, and taking it
        as saa - 2 sac + scc cancels catastrophically in fp32 (for int8, ||a-c||^2 is 1e-4 of
        each term). a.c = (saa + scc - sdd) / 2 is formed once, in fp64, from the accumulated
        sums, so the row keeps its layout (FIELDS) and rel_error its fp32 accuracy."""
        if applied.numel() != owed.numel():
            raise ValueError(f"HealthSums.add: applied has {applied.numel()} elements and owed "
                             f"{owed.numel()} for unit {unit}; the compressed path must report "
                             f"both flat over the same bucket")
        a, c = applied.reshape(-1), owed.reshape(-1)
        work = torch.float64 if torch.float64 in (a.dtype, c.dtype) else torch.float32
        n, step = a.numel(), max(1, int(HEALTH_CHUNK_ELEMENTS))
        acc = torch.zeros(FIELDS - 1, dtype=torch.float64, device=self.values.device)
        for start in range(0, n, step):
            a_part, c_part = a[start:start + step], c[start:start + step]
            ac, cc = a_part.to(work), c_part.to(work)
            sa, saa, sc, scc = ac.sum(), torch.dot(ac, ac), cc.sum(), torch.dot(cc, cc)
            # a - c into a's widened copy when there is one; the caller's tensor is never written.
            diff = ac.sub_(cc) if ac is not a_part else ac - cc
            del ac, cc  # so at most two chunk-sized temporaries are alive at once
            acc.add_(torch.stack([sa, saa, sc, scc, torch.dot(diff, diff)]))  # fp32 -> fp64
            del diff
        acc[4].mul_(-0.5).add_(acc[1] + acc[3], alpha=0.5)  # sdd -> sac, in fp64
        row = self.values[unit]
        row[:FIELDS - 1].add_(acc)
        row[FIELDS - 1].add_(n)
        self.units.add(unit)


def _figures(row: List[float]) -> Dict[str, float]:
    sa, saa, sc, scc, sac, n = row
    if n <= 0:
        return {}
    var_a = saa / n - (sa / n) ** 2
    var_c = scc / n - (sc / n) ** 2
    err2 = max(saa - 2.0 * sac + scc, 0.0)
    norm_a, norm_c = math.sqrt(max(saa, 0.0)), math.sqrt(max(scc, 0.0))
    return {
        "gvr": var_a / var_c if var_c > 0 else (1.0 if var_a == 0 else math.inf),
        "rel_error": math.sqrt(err2) / norm_c if norm_c > 0 else (0.0 if err2 == 0 else math.inf),
        "cosine": sac / (norm_a * norm_c) if norm_a > 0 and norm_c > 0 else 1.0,
    }


def health_figures(global_sums: torch.Tensor, dynamic_units: List[int]) -> Optional[Dict]:
    """Pooled figures over ``dynamic_units`` and per-unit rel_error, from summed HealthSums
    values ([units, FIELDS], identical on every rank). None when nothing was measured."""
    rows = global_sums.detach().cpu().tolist()
    pooled = [0.0] * FIELDS
    per_unit = {}
    for u in dynamic_units:
        for j in range(FIELDS):
            pooled[j] += rows[u][j]
        fig = _figures(rows[u])
        if fig:
            per_unit[u] = fig["rel_error"]
    out = _figures(pooled)
    if not out:
        return None
    out["unit_rel_error"] = per_unit
    return out


class HealthWatch:
    """Per-tier verdicts of the monitoring steps, identical on every rank (the sums are).

    ``monitors`` hold the consecutive-bad counts (megatron_grpo.grpo.tiers.GVRMonitor: the window and
    the share to promote), ``last`` each tier's figures at its last check, ``measured`` the
    tiers checked on the current step (reset by ``new_step``)."""

    TIERS = ("dynamic", "core", "stable")

    def __init__(self, monitor_factory, limit: float) -> None:
        self.monitors = {t: monitor_factory() for t in self.TIERS}
        self.limit = float(limit)
        self.last: Dict[str, Dict] = {}
        self.measured: set = set()

    def new_step(self) -> None:
        self.measured = set()

    def judge(self, global_sums: torch.Tensor, units: Dict[str, List[int]]) -> Dict[str, Dict]:
        """``units``: tier -> the replica units it pools. Returns the tiers whose monitor
        triggered on this check, each with its figures (the relative error above the limit for
        the window's number of checks in a row; NaN counts as bad)."""
        triggered = {}
        for tier in self.TIERS:
            if tier not in units:
                continue
            figures = health_figures(global_sums, units[tier])
            if figures is None:
                continue
            self.last[tier] = figures
            self.measured.add(tier)
            if self.monitors[tier].check(figures["rel_error"] <= self.limit):  # False for NaN
                triggered[tier] = figures
        return triggered

    def state_dict(self) -> Dict:
        # Keys of the checkpoints written before the core monitor existed, kept for dynamic.
        return {"monitor": dict(vars(self.monitors["dynamic"])), "last_health": self.last.get("dynamic"),
                "core_monitor": dict(vars(self.monitors["core"])),
                "last_core_health": self.last.get("core"),
                "stable_monitor": dict(vars(self.monitors["stable"])),
                "last_stable_health": self.last.get("stable")}

    def load_state_dict(self, state: Dict) -> None:
        vars(self.monitors["dynamic"]).update(state["monitor"])
        vars(self.monitors["core"]).update(state.get("core_monitor", {}))
        vars(self.monitors["stable"]).update(state.get("stable_monitor", {}))
        self.last = {t: state.get(k) for t, k in (("dynamic", "last_health"), ("core", "last_core_health"),
                                                   ("stable", "last_stable_health"))
                     if state.get(k) is not None}
