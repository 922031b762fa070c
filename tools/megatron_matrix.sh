#!/usr/bin/env bash
# Version matrix: the project's megatron glue against other megatron-core releases, one side
# environment per version, never the project's .venv (docs/versions.md).
#
#   bash tools/megatron_matrix.sh 0.19.2                      # one version (10-15 min on 2 cores)
#   bash tools/megatron_matrix.sh 0.16.1 0.17.1 0.18.2 0.19.2
#   bash tools/megatron_matrix.sh --plan 0.16.1 0.19.2        # the recipe each would get; installs nothing
#   bash tools/megatron_matrix.sh --download-sources 0.17.1 0.18.2 0.19.2   # sdists into MATRIX_DIR/src, unpacked
#
# Per version: a virtual environment MATRIX_DIR/venv-<version>-py<X.Y> (built once, reused while
# its recipe is unchanged) with torch==2.13.0, that megatron-core, setup.py's requirements and this
# checkout (pip install --no-deps -e); then in it (a) pytest tests/unit, (b) the multi-rank tests
# of the megatron glue (GLUE_TESTS and GLUE_SLOW_TESTS below), (c) a 2-rank GRPO run of the
# training entry (--grpo-offload cpu --clip-grad 0.05) whose metrics must show a gradient norm
# > 0 at every iteration and a finite validation loss. One line per version, a table at the end,
# rows appended to MATRIX_DIR/results.md; logs in MATRIX_DIR/logs/<version>/.
#
# megatron-core 0.17.0 and later declare Python >= 3.12. With such an interpreter on PATH
# (python3.12, python3.13; or MATRIX_PYTHON) they get a normal install; otherwise a *test install*
# on the older Python, labelled as such in every line: pip install --no-build-isolation --no-deps
# --ignore-requires-python (PyPI has cp311 wheels of 0.17.1-0.19.2 despite the declaration; where
# a release has none, pip builds its sdist with the prerequisites installed first). The code
# parses and runs on 3.11. tools/megatron_matrix/plan.py makes that choice.
#
# Environment:
#   MATRIX_DIR          side environments, logs, corpus, results (default /tmp/megatron-matrix;
#                       must be outside the checkout)
#   MATRIX_PYTHON       the interpreter to build every environment from (default: python3, or
#                       python3.12 / python3.13 for versions that declare >= 3.12)
#   MATRIX_STEPS        which of "unit glue grpo" to run (default all three)
#   MATRIX_GLUE_SLOW    0 (default): GLUE_TESTS as the default suite selects them (about 5 min);
#                       1: their slow tests too (about 5 min more)
#   MATRIX_GRPO_ITERS   iterations of the GRPO run (default 30)
#   MATRIX_TIMEOUT      limit of each pytest session, s (default 1500); the GRPO run gets 600
# Exit status: 0 every version passed; 1 a version failed; 2 bad arguments or environment.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MATRIX_DIR="${MATRIX_DIR:-/tmp/megatron-matrix}"
HOST_PY="${MATRIX_HOST_PYTHON:-python3}"
PLAN_PY="$ROOT/tools/megatron_matrix/plan.py"
REPORT_PY="$ROOT/tools/megatron_matrix/report.py"
STEPS="${MATRIX_STEPS:-unit glue grpo}"
GRPO_ITERS="${MATRIX_GRPO_ITERS:-30}"
TEST_TIMEOUT="${MATRIX_TIMEOUT:-1500}"
GLUE_SLOW="${MATRIX_GLUE_SLOW:-0}"

# The multi-rank tests whose subject is the glue (megatron_grpo/megatron: the DDP and bucket-group
# subclasses, the distributed optimizer, gradient storage, offload) rather than GRPO's own policy.
GLUE_TESTS=(
  tests/multiproc/test_ddp_transparent.py
  tests/multiproc/test_grad_release.py
  tests/multiproc/test_offload_training.py
  tests/multiproc/test_hierarchy.py
  tests/multiproc/test_periodic.py
  tests/multiproc/test_ddp_options_gloo.py
  tests/multiproc/test_stream_safety_gloo.py
  tests/multiproc/test_megatron_versions_gloo.py
)
# Marked slow in the default suite (its stand-in there, in test_grpo.py, is outside this set) but
# run here every time: a model of one bucket takes the glue's single-unit path end to end.
GLUE_SLOW_TESTS=(
  tests/multiproc/test_single_unit.py
)

fail() { echo "error (megatron_matrix): $*" >&2; exit 2; }
usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

mode=run
versions=()
for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
    --plan) mode=plan ;;
    --download-sources) mode=download ;;
    -*) fail "unknown option '$arg' (options: --plan, --download-sources, --help)" ;;
    *) versions+=("$arg") ;;
  esac
done
[ ${#versions[@]} -gt 0 ] || fail "give one or more megatron-core versions, e.g. bash tools/megatron_matrix.sh 0.19.2"
command -v "$HOST_PY" >/dev/null 2>&1 || fail "no '$HOST_PY' to run tools/megatron_matrix/plan.py; set MATRIX_HOST_PYTHON"
"$HOST_PY" "$PLAN_PY" check "${versions[@]}" || exit 2
for s in $STEPS; do
  case "$s" in unit|glue|grpo) ;; *) fail "MATRIX_STEPS: unknown step '$s' (steps: unit glue grpo)" ;; esac
done
case "$GLUE_SLOW" in 0|1) ;; *) fail "MATRIX_GLUE_SLOW must be 0 or 1, got '$GLUE_SLOW'" ;; esac
[[ "$GRPO_ITERS" =~ ^[1-9][0-9]*$ ]] || fail "MATRIX_GRPO_ITERS must be a positive number, got '$GRPO_ITERS'"

MATRIX_DIR="$(realpath -m "$MATRIX_DIR")"
case "$MATRIX_DIR/" in
  "$(realpath "$ROOT")/"*) fail "MATRIX_DIR=$MATRIX_DIR is inside the checkout; put it outside (default /tmp/megatron-matrix) so environments and logs stay out of git and out of pytest's reach" ;;
esac
mkdir -p "$MATRIX_DIR" || fail "cannot create MATRIX_DIR=$MATRIX_DIR"

if [ "$mode" = download ]; then
  # Sources to read, not to install: the sdist is the released tree (megatron/core/...).
  mkdir -p "$MATRIX_DIR/src"
  for v in "${versions[@]}"; do
    "$HOST_PY" -m pip download -q --no-deps --no-binary :all: --ignore-requires-python \
      -d "$MATRIX_DIR/src" "megatron-core==$v" || fail "pip download megatron-core==$v failed (network? is $v on PyPI?)"
    tar -xzf "$MATRIX_DIR/src/megatron_core-$v.tar.gz" -C "$MATRIX_DIR/src" \
      || fail "cannot unpack $MATRIX_DIR/src/megatron_core-$v.tar.gz"
    echo "megatron-core $v: $MATRIX_DIR/src/megatron_core-$v/megatron/core"
  done
  exit 0
fi

# Interpreters as PATH=X.Y, python3 first so versions it satisfies keep the project's own Python.
# Each is run, not just looked up: a pyenv shim exists for versions that are not selected.
interpreters() {
  local names=(python3 python3.12 python3.13) p v out seen=" "
  [ -n "${MATRIX_PYTHON:-}" ] && names=("$MATRIX_PYTHON")
  for p in "${names[@]}"; do
    out=$("$p" -c 'import sys; print("%d.%d %s" % (*sys.version_info[:2], sys.executable))' 2>/dev/null) || continue
    v=${out%% *}
    case "$seen" in *" $v "*) continue ;; esac
    seen="$seen$v "
    echo "${out#* }=$v"
  done
}
mapfile -t CANDIDATES < <(interpreters)
[ ${#CANDIDATES[@]} -gt 0 ] || fail "no working Python interpreter (tried ${MATRIX_PYTHON:-python3 python3.12 python3.13}); set MATRIX_PYTHON"
reqs=$("$HOST_PY" "$PLAN_PY" requirements "$ROOT/setup.py") || exit 2
mapfile -t PROJECT_REQS <<< "$reqs"

if [ "$mode" = plan ]; then
  for v in "${versions[@]}"; do
    eval "$("$HOST_PY" "$PLAN_PY" recipe "$v" "${CANDIDATES[@]}")" || exit 2
    echo "megatron-core $v | $RECIPE_LABEL | $MATRIX_DIR/$RECIPE_VENV from $RECIPE_PYTHON"
    for step in "${RECIPE_STEPS[@]}"; do echo "  pip install $step"; done
    echo "  pip install ${PROJECT_REQS[*]}"
    echo "  pip install --no-deps -e $ROOT"
  done
  exit 0
fi

# Python that exits 0 when the environment's megatron-core is release $1. From 0.18 on,
# package_info appends '+<git sha>' to __version__ when the installed package sits inside a git
# work tree (a venv inside a checkout), so only the release part is compared.
version_is() {
  echo "import sys, megatron.core as m, megatron_grpo; sys.exit(m.__version__.split('+')[0] != '$1')"
}

# Build (or reuse) one version's environment; the recipe is recorded in it so a changed recipe
# (another interpreter, setup.py's requirements) rebuilds rather than tests a stale install.
install_env() {
  local v=$1 venv=$2 log=$3 stamp step
  stamp=$(printf '%s\n' "$RECIPE_LABEL" "$RECIPE_PYTHON" "${RECIPE_STEPS[@]}" "${PROJECT_REQS[@]}" "$ROOT")
  if [ -f "$venv/.matrix-recipe" ] && [ "$(cat "$venv/.matrix-recipe")" = "$stamp" ] \
     && "$venv/bin/python" -c "$(version_is "$v")" 2>/dev/null; then
    echo "[matrix] $v: reusing $venv"
    return 0
  fi
  echo "[matrix] $v: building $venv ($RECIPE_LABEL; log $log)"
  {
    "$RECIPE_PYTHON" -m venv --clear "$venv" || return 1
    local pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
    for step in "${RECIPE_STEPS[@]}"; do
      read -ra args <<< "$step"
      echo "+ pip install ${args[*]}"
      "${pip[@]}" "${args[@]}" || return 1
    done
    # The test install's numpy pin is repeated so the project's plain 'numpy' cannot lift it.
    local keep=()
    [ "$RECIPE_KIND" = test ] && keep=("numpy<2.3")
    echo "+ pip install ${PROJECT_REQS[*]} ${keep[*]}"
    "${pip[@]}" "${PROJECT_REQS[@]}" ${keep[@]+"${keep[@]}"} || return 1
    echo "+ pip install --no-deps -e $ROOT"
    "${pip[@]}" --no-deps -e "$ROOT" || return 1
    "$venv/bin/python" -c "import megatron.core as m, megatron_grpo, torch; print('megatron-core', m.__version__, 'torch', torch.__version__)" || return 1
    "$venv/bin/python" -c "$(version_is "$v")" || { echo "megatron.core.__version__ is not $v"; return 1; }
  } >"$log" 2>&1 || return 1
  echo "$stamp" > "$venv/.matrix-recipe"
}

reset_counts() { T_PASSED=0; T_FAILED=0; T_SKIPPED=0; T_ERRORS=0; T_NOTE=""; T_OK=1; }
counts_text() {
  local t="$1 $T_PASSED passed, $T_FAILED failed, $T_SKIPPED skipped"
  [ "$T_ERRORS" -gt 0 ] && t="$t, $T_ERRORS errors"
  echo "$t$T_NOTE"
}

# One pytest session in the side environment; its counts are added to the T_ totals, its
# FAILED/ERROR lines to the version's failures.txt.
run_pytest() {
  local log=$1 rc; shift
  ( cd "$ROOT" && timeout -k 30 "$TEST_TIMEOUT" "$VPY" -m pytest -q -p no:cacheprovider "$@" ) >"$log" 2>&1
  rc=$?
  eval "$("$VPY" "$REPORT_PY" pytest "$log")"
  T_PASSED=$((T_PASSED + PASSED)); T_FAILED=$((T_FAILED + FAILED))
  T_SKIPPED=$((T_SKIPPED + SKIPPED)); T_ERRORS=$((T_ERRORS + ERRORS))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    T_NOTE="$T_NOTE (killed after ${TEST_TIMEOUT} s: $log)"
  elif [ "$FOUND" -ne 1 ]; then
    T_NOTE="$T_NOTE (pytest ended without a summary, exit code $rc: $log)"
  fi
  [ "$rc" -eq 0 ] || T_OK=0
  "$VPY" "$REPORT_PY" failures "$log" >>"$LOGDIR/failures.txt"
}

run_grpo() {
  local log=$1 metrics=$2
  rm -f "$metrics"
  # The corpus is built once for every version (the same tokens, so validation losses compare).
  if [ ! -f "$MATRIX_DIR/data/stdlib.idx" ]; then
    "$VPY" "$ROOT/launch/preprocess_data.py" --default-corpus --output-prefix "$MATRIX_DIR/data/stdlib" >"$log.data" 2>&1 \
      || { GRPO_NOTE="grpo: building the corpus failed (see $log.data)"; GRPO_OK=0; return; }
  fi
  ( cd "$ROOT" && OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1 timeout -k 30 600 \
      "$VPY" -m torch.distributed.run --standalone --nproc-per-node 2 launch/pretrain_gpt.py \
      --config launch/configs/tiny.yaml --data-path "$MATRIX_DIR/data/stdlib" \
      --grpo --grpo-warmup-iters 5 --grpo-offload cpu --clip-grad 0.05 \
      --train-iters "$GRPO_ITERS" --eval-interval "$GRPO_ITERS" --log-interval 5 \
      --metrics-file "$metrics" --run-name "matrix-$V" ) >"$log" 2>&1
  local rc=$?
  eval "$("$VPY" "$REPORT_PY" grpo "$metrics" "$GRPO_ITERS")"
  if [ "$rc" -ne 0 ]; then GRPO_OK=0; GRPO_NOTE="$GRPO_NOTE; exit code $rc (see $log)"; fi
}

LINES=()
any_failed=0
for V in "${versions[@]}"; do
  start=$(date +%s)
  eval "$("$HOST_PY" "$PLAN_PY" recipe "$V" "${CANDIDATES[@]}")" || exit 2
  VENV="$MATRIX_DIR/$RECIPE_VENV"
  VPY="$VENV/bin/python"
  LOGDIR="$MATRIX_DIR/logs/$V"
  mkdir -p "$LOGDIR"
  : >"$LOGDIR/failures.txt"
  parts=()
  ran=()
  pass=1
  if ! install_env "$V" "$VENV" "$LOGDIR/install.log"; then
    parts+=("install FAILED (tail of $LOGDIR/install.log: $(tail -n 1 "$LOGDIR/install.log"))")
    pass=0
  else
    for s in $STEPS; do
      case "$s" in
        unit)
          echo "[matrix] $V: pytest tests/unit"
          reset_counts
          MEGATRON_GRPO_SLOW=0 run_pytest "$LOGDIR/unit.log" tests/unit
          parts+=("$(counts_text unit)"); ran+=("tests/unit")
          [ "$T_OK" -eq 1 ] && [ "$T_PASSED" -gt 0 ] || pass=0 ;;
        glue)
          nglue=$(( ${#GLUE_TESTS[@]} + ${#GLUE_SLOW_TESTS[@]} ))
          echo "[matrix] $V: pytest $nglue glue files (MATRIX_GLUE_SLOW=$GLUE_SLOW)"
          reset_counts
          MEGATRON_GRPO_SLOW="$GLUE_SLOW" run_pytest "$LOGDIR/glue.log" "${GLUE_TESTS[@]}"
          MEGATRON_GRPO_SLOW=1 run_pytest "$LOGDIR/glue-slow.log" "${GLUE_SLOW_TESTS[@]}"
          parts+=("$(counts_text glue)"); ran+=("$nglue glue files")
          [ "$T_OK" -eq 1 ] && [ "$T_PASSED" -gt 0 ] || pass=0 ;;
        grpo)
          echo "[matrix] $V: GRPO run, 2 ranks, $GRPO_ITERS iterations"
          run_grpo "$LOGDIR/grpo.log" "$LOGDIR/grpo.jsonl"
          parts+=("$GRPO_NOTE"); ran+=("GRPO run ${GRPO_ITERS} it"); [ "$GRPO_OK" -eq 1 ] || pass=0 ;;
      esac
    done
  fi
  verdict=PASS
  [ "$pass" -eq 1 ] || { verdict=FAIL; any_failed=1; }
  secs=$(( $(date +%s) - start ))
  detail=$(IFS='|'; echo "${parts[*]}" | sed 's/|/ | /g')
  line="megatron-core $V | $RECIPE_LABEL | $detail | $verdict | ${secs} s"
  LINES+=("$line")
  echo "$line"
  if [ -s "$LOGDIR/failures.txt" ]; then sed 's/^/    /' "$LOGDIR/failures.txt"; fi
  ran_text=$(IFS=','; echo "${ran[*]:-install}" | sed 's/,/, /g')
  "$HOST_PY" "$REPORT_PY" row "$MATRIX_DIR/results.md" "$V" "$RECIPE_LABEL" "$ran_text" \
    "$verdict: $detail ($secs s)" >/dev/null
done

echo
echo "=== megatron-core version matrix ($(date +%F); rows also in $MATRIX_DIR/results.md, logs in $MATRIX_DIR/logs/)"
printf '%s\n' "${LINES[@]}"
exit "$any_failed"
