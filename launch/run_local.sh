#!/usr/bin/env bash
# Train on one machine: torchrun --standalone with NPROC_PER_NODE ranks, the same per-rank logs,
# environment check and CUDA_DEVICE_MAX_CONNECTIONS rule as the SLURM script (docs/launch.md).
#
#   bash launch/run_local.sh TRAINING FLAGS...
#   e.g. bash launch/run_local.sh --config launch/configs/tiny.yaml --data-path data/stdlib --grpo \
#          --metrics-file runs/tiny_grpo.jsonl
# TRAINING FLAGS are launch/pretrain_gpt.py's (--help). Environment:
#   NPROC_PER_NODE  ranks (default: the GPUs in cuda mode, 2 in cpu mode)
#   GRPO_DEVICE     auto (default: cuda if nvidia-smi lists a GPU) | cuda | cpu (adds --cpu)
#   LOG_DIR         per-rank logs (default runs/local-<date>-<pid>.ranks)
#   PYTHON          interpreter (default .venv/bin/python, else python3)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fail() { echo "error (run_local on $(hostname)): $*" >&2; exit 2; }
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
GRPO_DEVICE=${GRPO_DEVICE:-auto}
if [ "$GRPO_DEVICE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then GRPO_DEVICE=cuda; else GRPO_DEVICE=cpu; fi
fi
case "$GRPO_DEVICE" in
  cuda) NPROC_PER_NODE=${NPROC_PER_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')} ;;
  cpu) NPROC_PER_NODE=${NPROC_PER_NODE:-2} ;;
  *) fail "GRPO_DEVICE must be auto, cuda or cpu, got '$GRPO_DEVICE'" ;;
esac
[ "$NPROC_PER_NODE" -ge 1 ] 2>/dev/null || fail "NPROC_PER_NODE='$NPROC_PER_NODE' must be a positive number"

PLAN=$("$PYTHON" "$ROOT/launch/slurm/job_setup.py" plan --world-size "$NPROC_PER_NODE" -- "$@") \
  || fail "the training flags were refused (error above)"
eval "$PLAN"
# shellcheck disable=SC2086  # a space-separated list of prefixes
bash "$ROOT/launch/env.sh" --device "$GRPO_DEVICE" --nproc "$NPROC_PER_NODE" --data-path $GRPO_DATA_PREFIXES \
  || fail "environment check failed (MISSING lines above)"

extra=()
if [ "$GRPO_DEVICE" = cuda ]; then
  # job_setup.py decided (empty: leave it as it is; a value the user set is kept)
  if [ -n "$GRPO_CUDA_MAX_CONNECTIONS" ]; then export CUDA_DEVICE_MAX_CONNECTIONS=$GRPO_CUDA_MAX_CONNECTIONS; fi
  if [ -n "$GRPO_CUDA_MAX_CONNECTIONS_WARNING" ]; then echo "warning (run_local): $GRPO_CUDA_MAX_CONNECTIONS_WARNING" >&2; fi
  echo "[run_local] CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-unset} ($GRPO_CUDA_MAX_CONNECTIONS_WHY)"
else
  extra+=(--cpu)
  cores=$(nproc)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))}
fi
export GRPO_LOG_DIR=${LOG_DIR:-$ROOT/runs/local-$(date +%Y%m%d-%H%M%S)-$$.ranks}
export MEGATRON_GRPO_RANK_LOG=1 PYTHONUNBUFFERED=1
echo "[run_local] $NPROC_PER_NODE rank(s) ($GRPO_DEVICE), TP $GRPO_TP x PP $GRPO_PP x DP $GRPO_DP, rank logs $GRPO_LOG_DIR"
# --standalone: a private c10d rendezvous on a free localhost port.
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE" \
  --max-restarts 0 --monitor-interval 1 \
  --no-python bash "$ROOT/launch/slurm/rank_exec.sh" \
  "$PYTHON" "$ROOT/launch/pretrain_gpt.py" "$@" ${extra[@]+"${extra[@]}"}
