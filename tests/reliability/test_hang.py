"""A collective that never completes: one rank stops before a collective and never comes back.
Every other rank must fail with an error naming itself within the distributed timeout (+ slack),
and the job must end: no silent hang. Every job here is bounded by the test (killed if need be)."""

import pytest

from reliability_harness import first_line, start_job, torchrun_failure, wait_for_fault

pytestmark = pytest.mark.reliability_slow

GROUP = "A collective that never completes"
TIMEOUT_MIN = 0.1      # --distributed-timeout-minutes: 6 s
SLACK_S = 20           # a loaded 2-core machine
TORCHRUN_GRACE_S = 30  # torchrun waits this long after SIGTERM before SIGKILL

CASES = {
    # rank 1 stops before iteration 5: rank 0 waits in the step's data-parallel collectives, on
    # a group initialize_model_parallel made with --distributed-timeout-minutes (model_parallel_init)
    "data-parallel group": (["hang:1:5"], "rank 1 sleeps forever before iteration 5: rank 0 waits "
                            "in the step's gradient reduce-scatter (megatron's data-parallel group)"),
    # rank 1 stops after its step: rank 0 waits in the loop's SIGTERM agreement (world group)
    "world group": (["hang-after:1:4"], "rank 1 sleeps forever after the optimizer step of iteration 4: "
                    "rank 0 waits in the loop's per-iteration SIGTERM agreement (world group)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rank_that_never_joins_a_collective(reference, tmp_path, table, case):
    faults, tried = CASES[case]
    bound = TIMEOUT_MIN * 60 + SLACK_S
    running = start_job(tmp_path / "job", 2, [*reference["args"], "--distributed-timeout-minutes",
                                              TIMEOUT_MIN], faults=faults)
    fault = wait_for_fault(running, timeout=240)
    seen = running.wait_for_text("error (rank 0 on", until=fault["time"] + bound)
    # Rank 0 failed (or not) in time; now the job must end: torchrun SIGTERMs the sleeping rank,
    # which only notes it (the preemption handler) and is SIGKILLed after torchrun's grace.
    job = running.finish(timeout=(TORCHRUN_GRACE_S + 15) if seen else 0)
    said = first_line(job.err, "error (rank 0 on")
    expected = (f"rank 0 fails within the timeout (+{SLACK_S} s slack) with an error naming itself; "
                f"the job ends")
    assert seen is not None, f"rank 0 reported nothing within {bound} s:\n{job.text[-3000:]}"
    reported = seen - fault["time"]
    assert "peer failure" in said and "another rank died or stopped responding" in said, said
    assert job.rc not in (0, None), job.text[-3000:]
    total = job.ended_at - fault["time"]
    assert total < bound + TORCHRUN_GRACE_S + 15, f"{total:.1f} s"
    assert not job.leftovers
    table.row(GROUP, f"{tried}; --distributed-timeout-minutes {TIMEOUT_MIN}", expected,
              f"rank 0 failed {reported:.1f} s after the hang: \"{said[:220]}\"; torchrun ended the "
              f"job {total:.1f} s after the hang (the sleeping rank 1 only notes torchrun's SIGTERM "
              f"and is SIGKILLed after its {TORCHRUN_GRACE_S} s grace); rc {job.rc}; "
              f"{torchrun_failure(job.err)}; no process left")
