#!/usr/bin/env bash
# GPU check with assertions (issue 8 item 5; replaces tests/gpu/run_gpu_checks.sh): on one CUDA
# device, in under 8 minutes, it checks CPU mode is a no-op, the compressors / error feedback /
# importance / CUDA-event timer on CUDA against the CPU, bench_compress --device cuda (and the
# dp=512 vs dp=8 goal), the side-stream overlap, GRPO runs with strict comm and CUDA-event timing,
# bf16 baseline vs GRPO (tiny and ~330M; transformer-engine spec when importable), and the
# pinned-memory offload when it exists. Every check prints PASS/FAIL with its numbers, or SKIP
# with the reason; a summary table ends the output (also in $OUT/summary.txt).
#
#   bash launch/gpu_check.sh                     # from anywhere; runs from the repository root
#   bash launch/gpu_check.sh --list              # the checks
#   bash launch/gpu_check.sh --only compress_cuda side_stream_overlap
#
# Environment: OUT (logs, metrics, summary; default /tmp/gpu_out), PYTHON (default python3),
# GPU_CHECK_NO_WHEELS=1 to skip installing .whl/*.whl (megatron-core wheels, see
# docs/benchmarks.md) into /tmp/site, GPU_CHECK_TIMEOUT (hard limit on the Python part, s).
# Exit status: 0 no check failed; 1 a check failed; 2 nothing checked (no CUDA device, or setup
# failed); 124 the hard time limit was hit.
set -uo pipefail
START=$(date +%s)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT" || exit 2
export OUT PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY="${PYTHON:-python3}"

for arg in "$@"; do  # listing and help need no wheels, no device and no time limit
  case "$arg" in --list|-h|--help) exec "$PY" launch/gpu_check.py "$@" ;; esac
done

if [ -z "${GPU_CHECK_NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "=== installing .whl/*.whl into /tmp/site"
  if ! timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl; then
    echo "FAIL setup: pip install of .whl/*.whl into /tmp/site failed; nothing was checked" \
      | tee "$OUT/summary.txt"
    exit 2
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 20 nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi.txt"
else
  echo "nvidia-smi: not found"
fi

# gpu_check.py keeps its own 480 s budget counted from START (each command's timeout is the
# smaller of its cap and what is left); this outer limit only catches a hang of the script itself.
LIMIT="${GPU_CHECK_TIMEOUT:-$((500 - ($(date +%s) - START)))}"
[ "$LIMIT" -lt 30 ] && LIMIT=30
timeout -k 15 "$LIMIT" "$PY" launch/gpu_check.py --out "$OUT" --started-at "$START" "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAIL: launch/gpu_check.py was killed at the hard limit (${LIMIT} s); see $OUT/*.log" \
    | tee -a "$OUT/summary.txt"
  rc=124
fi
echo "=== gpu_check exit status $rc (elapsed $(( $(date +%s) - START )) s; logs in $OUT)"
exit "$rc"
