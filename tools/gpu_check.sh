#!/usr/bin/env bash
# Device check of the GPU path: one CUDA device, about 6 minutes on an H200, phases a-f
# (tools/gpu_check.py says what each asserts). Logs: OUT/phase_<x>.log, OUT/summary.txt,
# OUT/results.json (7 files; a device machine returns at most 8).
#
#   bash tools/gpu_check.sh                 # on the device; from anywhere (runs from the repo root)
#   bash tools/gpu_check.sh --cpu           # the CPU dry run (tests/unit/test_gpu_check_script.py)
#   bash tools/gpu_check.sh --phases a b    # some phases only
#   bash tools/gpu_check.sh --phases a f    # the sampled backward alone (f runs last: a budget cut
#                                           # of the whole check falls on it)
#   bash tools/gpu_check.sh --list
#   bash tools/gpu_check.sh --fetch-wheels  # fill .whl/ (needs the network; do it before a loan)
#   bash tools/gpu_check.sh --megatron 0.19.2 --phases a b c d   # the same phases on megatron-core 0.19.2
#   bash tools/gpu_check.sh --codec         # the codec check instead (tools/gpu_checks/codec.py: codec
#                                           # GB/s, launches, fused = eager, GPT step with and without
#                                           # GRPO; ~3 minutes on an H100, limit 300 s; OUT/codec.*)
#   bash tools/gpu_check.sh --codec --cpu   # its CPU dry run (tests/unit/test_gpu_check_codec.py)
#
# The device image has torch (CUDA) and transformers but no megatron-core: the check carries it
# as wheels in .whl/ (git-ignored, about 10 MB: carry it to the device machine with the working
# tree), installed offline by phase a. --fetch-wheels downloads megatron-core 0.16.1 for CPython
# 3.10-3.13 and 0.19.2 (the newest supported; Python >= 3.12) for 3.12-3.13 (manylinux x86_64),
# and einops and psutil (megatron-core uses them undeclared). --megatron VERSION: phase a
# installs that megatron-core from .whl/ instead of 0.16.1 (GPU_CHECK_MEGATRON).
#
# Environment: OUT (default /tmp/gpu_out), PYTHON (default python3), GPU_CHECK_NO_WHEELS=1 (do
# not install .whl/), GPU_CHECK_TIMEOUT (hard limit on the Python part, s).
# Exit status: 0 no phase failed; 1 a phase failed; 2 nothing checked (no CUDA device without
# --cpu); 124 the hard time limit was hit.
set -uo pipefail
START=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT" || exit 2
export OUT PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY="${PYTHON:-python3}"

ARGS=()
SCRIPT=tools/gpu_check.py
RESULT=summary.txt
while [ $# -gt 0 ]; do
  case "$1" in
    --codec) SCRIPT=tools/gpu_checks/codec.py; RESULT=codec.txt; shift ;;
    --megatron)
      [ $# -ge 2 ] || { echo "tools/gpu_check.sh: --megatron needs a version, e.g. --megatron 0.19.2" >&2; exit 2; }
      export GPU_CHECK_MEGATRON="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
set -- "${ARGS[@]+"${ARGS[@]}"}"

for arg in "$@"; do
  case "$arg" in
    --list|-h|--help) exec "$PY" "$SCRIPT" "$@" ;;
    --fetch-wheels)
      set -e
      mkdir -p .whl
      for v in 3.10 3.11 3.12 3.13; do
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" \
          --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
      done
      for v in 3.12 3.13; do
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" \
          --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
      done
      "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d .whl einops psutil
      ls -l .whl
      exit 0 ;;
  esac
done

if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi -L 2>&1
fi

# gpu_check.py (and codec.py) keep their own budget counted from START (every process they start
# has a timeout inside it); this outer limit only catches a hang of the script itself.
LIMIT="${GPU_CHECK_TIMEOUT:-}"
if [ -z "$LIMIT" ]; then
  case "$SCRIPT: $* " in
    *codec.py:*" --cpu "*) LIMIT=240 ;;
    *codec.py:*) LIMIT=300 ;;  # the codec check must leave most of a 15-minute loan to the rest
    *" --cpu "*) LIMIT=360 ;;
    *) LIMIT=540 ;;
  esac
  LIMIT=$((LIMIT - ($(date +%s) - START)))
fi
[ "$LIMIT" -lt 30 ] && LIMIT=30
timeout -k 15 "$LIMIT" "$PY" "$SCRIPT" --out "$OUT" --started-at "$START" "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAIL: $SCRIPT was killed at the hard limit (${LIMIT} s); see $OUT/" \
    | tee -a "$OUT/$RESULT"
  rc=124
fi
echo "=== gpu_check exit status $rc (elapsed $(( $(date +%s) - START )) s; logs in $OUT)"
exit "$rc"
