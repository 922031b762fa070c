#!/usr/bin/env bash
# Create (or reuse) the CPU virtual environment and install megatron-grpo into it.
# torch is pinned to the CPU build 2.13.0 *before* anything else: megatron-core's bare 'torch'
# requirement would otherwise pull a multi-GB CUDA build.
#   VENV=path  (default .venv in the repository root)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  pip_q torch==2.13.0
fi
if ! "$VENV/bin/python" -c 'import megatron_grpo, megatron.core, pytest, transformers, einops, triton, ruff' 2>/dev/null; then
  echo "[setup] installing megatron-grpo with megatron-core==0.16.1, triton==3.7.1 and test extras"
  # setup.py allows megatron-core >=0.16.1,<0.20 (users keep theirs); the CPU set-up pins
  # the version the default suite and CI run on, so a fresh machine gets the same one.
  # triton: the CPU torch wheel does not bring it; 3.7.1 is the one torch 2.13.0's CUDA wheels
  # pin. The tests run the fused codec kernels in its interpreter and compile them for sm_90.
  pip_q -e "$ROOT[test]" "megatron-core==0.16.1" "triton==3.7.1"
fi
# Megatron-LM's training package (megatron.training), for the tests of the Megatron-LM runner
# (tests/megatron_lm): megatron-core's wheels carry it from 0.17 on, 0.16.1's does not. A test
# install beside the venv, never on its path: megatron-core 0.19.2 declares Python >= 3.12, and
# its cp311 wheel runs on 3.11 with one back-port the tests put first on PYTHONPATH.
MLM_DIR="$VENV/megatron-lm-0.19.2"
if [ ! -f "$MLM_DIR/megatron/training/training.py" ]; then
  echo "[setup] test install of megatron-core 0.19.2 (megatron.training) into $MLM_DIR"
  rm -rf "$MLM_DIR"
  pip_q --no-deps --ignore-requires-python --target "$MLM_DIR" "megatron-core==0.19.2"
fi
echo "[setup] ready: $VENV ($("$VENV/bin/python" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'))"
