#!/usr/bin/env bash
# The per-node task of launch/slurm/pretrain_gpt_grpo.sbatch (srun starts one per node):
# check this node, build its dataset index cache if caches are node-local, then run torchrun,
# which joins the c10d rendezvous and starts NPROC_PER_NODE ranks through rank_exec.sh.
#   bash node_task.sh TRAINING FLAGS...
# Reads the variables the batch script exports (GRPO_ROOT, PYTHON, GRPO_DEVICE, NNODES,
# NPROC_PER_NODE, RDZV_HOST, RDZV_PORT, RDZV_TIMEOUT, NODE_LOCAL_DIR, DATA_CACHE, GRPO_LOG_DIR,
# GRPO_DATA_PREFIXES, GRPO_DATA_CACHE_DIR); not meant to be run by hand.
set -uo pipefail
host=$(hostname)
node="node $host (node index ${SLURM_NODEID:-?} of job ${SLURM_JOB_ID:-?})"
fail() { echo "error ($node): $*" >&2; exit 1; }
say() { echo "[$node] $*"; }
# The batch script raised the open-file limit (the SSD memory tier and torch_dist saves open many
# files) and srun passes that value on, but a node may refuse a value above its own hard limit:
# raise the soft limit to this node's hard limit. Guarded: a refused raise never fails the node.
ulimit -Sn "$(ulimit -Hn)" 2>/dev/null || true

# shellcheck disable=SC2086  # GRPO_DATA_PREFIXES is a space-separated list of prefixes
bash "$GRPO_ROOT/launch/env.sh" --device "$GRPO_DEVICE" --nproc "$NPROC_PER_NODE" --slurm \
  --data-path $GRPO_DATA_PREFIXES || fail "environment check failed (MISSING lines above); fix this node or exclude it (sbatch --exclude=$host)"

extra=()
if [ "$DATA_CACHE" = local ]; then
  # Node-local: the hostname keeps nodes apart even where NODE_LOCAL_DIR happens to be shared
  # (the local test cluster's "nodes" share one /tmp); jobs on the same node reuse it.
  cache=${GRPO_DATA_CACHE_DIR:-$NODE_LOCAL_DIR/megatron_grpo_data_cache.$host}
  [ -z "$GRPO_DATA_CACHE_DIR" ] && extra+=(--data-cache-dir "$cache")
  t0=$(date +%s)
  PYTHONWARNINGS=ignore "$PYTHON" "$GRPO_ROOT/launch/slurm/job_setup.py" build-cache \
    --cache-dir "$cache" --world-size "$((NNODES * NPROC_PER_NODE))" -- "$@" ${extra[@]+"${extra[@]}"} \
    || fail "could not build the dataset index cache in $cache (error above)"
  say "dataset index cache ready in $cache ($(( $(date +%s) - t0 )) s)"
fi

if [ "$GRPO_DEVICE" = cuda ]; then
  # A collective that fails or times out kills its process (3 = tear down without cleanup),
  # so torchrun sees a dead rank and the job ends instead of hanging until the time limit.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  # InfiniBand retransmission timeout 4.096 us * 2^22 (~17 s): rides out link flaps that the
  # NCCL default (2^18, ~1 s) turns into job failures on large clusters.
  export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
else
  extra+=(--cpu)
  # One thread per rank unless told otherwise: ranks share the node's cores.
  cores=${SLURM_CPUS_ON_NODE:-$(nproc)}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / NPROC_PER_NODE > 0 ? cores / NPROC_PER_NODE : 1 ))}
fi
export MEGATRON_GRPO_RANK_LOG=1 PYTHONUNBUFFERED=1 GRPO_LOG_DIR
mkdir -p "$GRPO_LOG_DIR" || fail "cannot create the per-rank log directory $GRPO_LOG_DIR"

say "torchrun: $NPROC_PER_NODE rank(s), rendezvous $RDZV_HOST:$RDZV_PORT (join timeout ${RDZV_TIMEOUT} s), logs $GRPO_LOG_DIR, ulimit -n $(ulimit -Sn)"
"$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "${SLURM_JOB_ID:-grpo}" \
  --rdzv-conf "join_timeout=$RDZV_TIMEOUT,read_timeout=$RDZV_TIMEOUT" \
  --max-restarts 0 --monitor-interval 1 \
  --no-python bash "$GRPO_ROOT/launch/slurm/rank_exec.sh" \
  "$PYTHON" "$GRPO_ROOT/launch/pretrain_gpt.py" "$@" ${extra[@]+"${extra[@]}"}
rc=$?
if [ "$rc" -ne 0 ]; then
  if ! ls "$GRPO_LOG_DIR"/rank-*."$host".log >/dev/null 2>&1; then
    fail "torchrun exited $rc before starting any rank: the rendezvous at $RDZV_HOST:$RDZV_PORT did not complete within ${RDZV_TIMEOUT} s (all $NNODES node(s) must start and reach that address; set RDZV_HOST/RDZV_TIMEOUT if needed)"
  fi
  fail "torchrun exited $rc; per-rank logs: $GRPO_LOG_DIR/rank-*.$host.log (look for 'error (rank')"
fi
say "done"
