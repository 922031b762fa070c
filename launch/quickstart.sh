#!/usr/bin/env bash
# README command 1: set up the CPU environment, build the default corpus (CPython standard
# library text, offline), and train the tiny GPT on 2 gloo ranks with the megatron baseline and
# with GRPO side by side, printing a summary and the ratios. Extra arguments go to main_job.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
PY="${VENV:-$ROOT/.venv}/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS=ignore
"$PY" "$ROOT/launch/preprocess_data.py" --default-corpus --output-prefix "$ROOT/data/stdlib"
exec "$PY" "$ROOT/launch/main_job.py" --data-path "$ROOT/data/stdlib" "$@"
