"""NaN and Inf in one gradient element of one rank, in a unit of each GRPO tier: the step is
skipped on every rank and nothing moves (parameters, error-feedback residuals); training goes on.

The test injects all six (NaN and Inf x core, dynamic, stable) in one run through
fault_probe.py. The probe option of tests/multiproc/grpo_probe.py (--probe-inf ITER:TIER, one Inf
per run, delayed stable mode too) is tested in tests/multiproc/test_grpo.py, not repeated here."""

import math

import pytest

from harness import GRPO_SMALL, SMALL_MODEL, read_metrics
from reliability_harness import run_job

GROUP = "NaN/Inf in a gradient of each tier"
# Tiered from iteration 9 (--grpo-warmup-iters 6, re-tier at multiples of the stable interval);
# 9 and 10 step normally so error-feedback residuals exist before the first injection (a skipped
# step must leave them as they were, not merely empty); frozen stable units compute gradients only
# on stable-update iterations (multiples of 4).
INJECT = {11: ("core", "inf"), 12: ("stable", "nan"), 13: ("dynamic", "nan"), 15: ("dynamic", "inf"),
          16: ("stable", "inf"), 17: ("core", "nan")}
ITERS = 18
EMPTY = "e3b0c44298fc1c14"  # the digest of no tensors: no residual yet


def test_nan_and_inf_in_every_tier_skip_the_step_and_keep_state(stdlib_data, tmp_path, table):
    metrics = str(tmp_path / "m.jsonl")
    job = run_job(tmp_path / "job", 2, [*SMALL_MODEL, *GRPO_SMALL, "--data-path", stdlib_data,
                                        "--train-iters", ITERS, "--eval-iters", "0", "--eval-interval",
                                        ITERS, "--metrics-file", metrics],
                  faults=[f"nonfinite:{k}:{t}:{v}" for k, (t, v) in INJECT.items()])
    assert job.rc == 0, job.text[-4000:]
    m = read_metrics(metrics)
    assert [r["iteration"] for r in m if r["skipped"]] == sorted(INJECT)
    assert m[-1]["grpo_skipped_steps"] == len(INJECT)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"] or 0.0) for r in m)
    ranks = [job.records(0), job.records(1)]
    assert all(len(r) == ITERS for r in ranks)
    for k, (tier, value) in INJECT.items():
        for rank, recs in enumerate(ranks):
            rec = recs[k - 1]
            assert rec["injected"] == {"unit": rec["injected"]["unit"], "tier": tier, "value": value}
            assert rec["tiers"][rec["injected"]["unit"]] == tier[0]
            assert rec["skipped"], (k, rank)
            assert rec["before"] == rec["after"], (k, rank)  # no parameter, no residual moved
            assert rec["before"]["ef"] != EMPTY
        assert ranks[1][k - 1]["fired"], f"the {value} at iteration {k} never reached a gradient"
        if tier == "stable":
            assert ranks[1][k - 1]["stable_update"]
    normal = [i for i in range(1, ITERS + 1) if i not in INJECT]
    for i in normal[1:]:  # iteration 1 runs at lr 0 (warm-up starts at 0): nothing moves
        for recs in ranks:
            assert not recs[i - 1]["skipped"] and recs[i - 1]["before"]["params"] != recs[i - 1]["after"]["params"]
    for a, b in zip(*ranks):  # residuals are each rank's own; parameters must agree bit for bit
        assert a["after"]["params"] == b["after"]["params"]
    for k, (tier, value) in INJECT.items():
        rec = ranks[0][k - 1]
        table.row(GROUP, f"{value.upper()} in one gradient element on rank 1, {tier} unit "
                         f"{rec['injected']['unit']}, iteration {k} (one run, 6 injections, "
                         f"--grpo-stable-mode frozen)",
                  "step skipped on every rank; parameters and error-feedback residuals unchanged; "
                  "training goes on",
                  f"skipped on both ranks (metrics skipped=true); parameter and residual digests before "
                  f"= after on both ranks; grpo_skipped_steps {m[-1]['grpo_skipped_steps']} at the end; "
                  f"{len(normal)} other iterations stepped normally, losses finite, parameters "
                  f"bit-identical across ranks")

