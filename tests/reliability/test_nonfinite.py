"""NaN and Inf in one gradient element of one rank, in a unit of each GRPO tier: the step is
skipped on every rank and nothing moves (parameters, error-feedback residuals); training goes on.

The test injects all six (NaN and Inf x core, dynamic, stable) in one run through
fault_probe.py. The probe option of tests/multiproc/grpo_probe.py (--probe-inf ITER:TIER, one Inf
per run, delayed stable mode too) is tested in tests/multiproc/test_grpo.py, not repeated here."""

import math
import os

from harness import GRPO_SMALL, REPO, SMALL_MODEL, read_metrics
from megatron_grpo.training.checkpointing import TRACKER
from reliability_harness import rank_errors, run_job

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



# -- a diverged run stops ---------------------------------------------------------
# The reproduction: the quickstart's tiny config on 2 ranks with a learning rate that blows
# up. The loss is finite up to iteration 6 (3.7e9 at 5, 7.4e10 at 6) and NaN from iteration 7.
TINY = os.path.join(REPO, "launch", "configs", "tiny.yaml")
DIVERGE = ["--config", TINY, "--lr", "1000", "--min-lr", "100", "--lr-warmup-iters", "1",
           "--train-iters", "40", "--log-interval", "1000"]
DIVERGED_GROUP = "A diverged run"


def _iters(ckpt):
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))


def test_a_nan_loss_stops_the_run_before_its_next_save(stdlib_data, tmp_path, table):
    ckpt, metrics = tmp_path / "ckpt", str(tmp_path / "m.jsonl")
    job = run_job(tmp_path / "job", 2, [*DIVERGE, "--data-path", stdlib_data, "--save", ckpt,
                                        "--save-interval", "5", "--metrics-file", metrics],
                  probe=False, timeout=240)
    assert job.rc not in (0, None), f"rc {job.rc}: the diverged run did not stop\n{job.text[-3000:]}"
    said = rank_errors(job.err)
    assert sorted(said) == [0, 1], job.err[-3000:]
    for rank, line in said.items():
        assert "iteration 7 of 40: the loss is nan on 2 of 2 rank(s) (first: rank 0)" in line, line
        assert "--check-for-nan-in-loss-and-grad" in line and "lower --lr" in line, line
        assert f"the latest complete checkpoint, iteration 5 in {ckpt}, is kept" in line, line
    m = read_metrics(metrics)
    assert [r["iteration"] for r in m] == list(range(1, 8))  # the failing iteration is logged too
    assert math.isnan(m[-1]["loss"]) and all(math.isfinite(r["loss"]) for r in m[:-1])
    assert _iters(ckpt) == ["iter_0000005"] and (ckpt / TRACKER).read_text() == "5"
    assert not job.leftovers
    table.row(DIVERGED_GROUP, "tiny.yaml, --lr 1000 --min-lr 100 --lr-warmup-iters 1 (loss NaN from "
                              "iteration 7), --save every 5, baseline",
              "the run stops at the first non-finite loss, naming it; no checkpoint after it",
              f"rc {job.rc} at iteration 7; rank 0: \"{said[0][:200]}...\"; {ckpt.name} holds "
              f"{', '.join(_iters(ckpt))} only", case="30.5")


def test_non_finite_weights_are_never_saved(stdlib_data, tmp_path, table):
    # Both stops switched off: megatron applies the non-finite update (the baseline does not skip
    # steps), the weights are NaN from iteration 7, and the save at 10 must refuse them.
    ckpt = tmp_path / "ckpt"
    job = run_job(tmp_path / "job", 2, [*DIVERGE, "--data-path", stdlib_data, "--save", ckpt,
                                        "--save-interval", "5", "--no-check-for-nan-in-loss-and-grad",
                                        "--max-consecutive-skipped-steps", "0"],
                  probe=False, timeout=240)
    assert job.rc not in (0, None), f"rc {job.rc}: non-finite weights were saved\n{job.text[-3000:]}"
    said = rank_errors(job.err)
    assert sorted(said) == [0, 1], job.err[-3000:]
    for line in said.values():
        assert f"--save {ckpt}: refusing to save iteration 10: the weights are non-finite" in line, line
        assert f"the latest complete checkpoint, iteration 5, is kept: resume with --load {ckpt}" in line
    assert "on rank(s) 0, 1" in said[0], said[0]
    assert _iters(ckpt) == ["iter_0000005"] and (ckpt / TRACKER).read_text() == "5"
    assert not list(ckpt.glob("*.tmp"))
    table.row(DIVERGED_GROUP, "the same run with --no-check-for-nan-in-loss-and-grad "
                              "--max-consecutive-skipped-steps 0 (weights NaN from iteration 7)",
              "the save at iteration 10 is refused, the previous checkpoint kept",
              f"rc {job.rc}; rank 0: \"{said[0][:200]}...\"; {ckpt.name} holds {', '.join(_iters(ckpt))}",
              case="30.5")


def test_consecutive_skipped_steps_stop_the_run(stdlib_data, tmp_path, table):
    # GRPO skips a step whose gradient is non-finite (isolated ones: the test above); three in a
    # row with --max-consecutive-skipped-steps 3 stop the run at the third.
    metrics = str(tmp_path / "m.jsonl")
    job = run_job(tmp_path / "job", 2, [*SMALL_MODEL, *GRPO_SMALL, "--data-path", stdlib_data,
                                        "--train-iters", "10", "--eval-iters", "0", "--eval-interval", "10",
                                        "--max-consecutive-skipped-steps", "3", "--metrics-file", metrics],
                  faults=[f"nonfinite:{k}:core:nan" for k in (3, 4, 5)], timeout=240)
    assert job.rc not in (0, None), f"rc {job.rc}: the run did not stop\n{job.text[-3000:]}"
    said = rank_errors(job.err)
    assert sorted(said) == [0, 1], job.err[-3000:]
    for line in said.values():
        assert ("iteration 5 of 10: 3 consecutive steps skipped (iterations 3-5: a non-finite gradient "
                "on some rank") in line, line
        assert "--max-consecutive-skipped-steps 3" in line and "no --save" in line, line
    m = read_metrics(metrics)
    assert [r["iteration"] for r in m if r["skipped"]] == [3, 4, 5] and m[-1]["iteration"] == 5
    table.row(DIVERGED_GROUP, "NaN in a core gradient on rank 1 at iterations 3, 4, 5 (GRPO), "
                              "--max-consecutive-skipped-steps 3",
              "the run stops after the third skipped step in a row, naming the flag",
              f"rc {job.rc} at iteration {m[-1]['iteration']}; rank 0: \"{said[0][:200]}...\"", case="30.5")
