"""The checks of launch/gpu_check.py (the runner): common.py (shared records, Expect, the table
of checks), tensor_checks.py (subprocess tensor checks), run_checks.py (training runs, bench,
transformer-engine spec, offload, budget)."""
