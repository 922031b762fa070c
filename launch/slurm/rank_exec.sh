#!/usr/bin/env bash
# One training rank, started by torchrun (--no-python): runs "$@" (python launch/pretrain_gpt.py
# ...) with its output both in this rank's own log file and on stdout (torchrun -> srun -> the
# job's output file), and writes the process id beside the log so a test or an operator can
# signal exactly this rank.
#   GRPO_LOG_DIR  directory for rank-RRRRR.HOST.log / .pid (created if missing)
# If the training process is killed by a signal it cannot report itself; this wrapper then names
# the rank, host and signal, which is the first thing to look for when a job dies.
set -uo pipefail
rank=${RANK:?rank_exec.sh must be started by torchrun (RANK is not set)}
host=$(hostname)
mkdir -p "${GRPO_LOG_DIR:?set GRPO_LOG_DIR}"
base="$GRPO_LOG_DIR/rank-$(printf %05d "$rank").$host"
exec > >(tee -a "$base.log") 2>&1
echo "[rank $rank on $host] local rank ${LOCAL_RANK:-?} of node rank ${GROUP_RANK:-?}, world ${WORLD_SIZE:-?}, log $base.log"
# The torchrun agent is this wrapper's parent. The training process watches it and stops without
# saving if it dies (megatron_grpo/training/safety/launcher_watch.py): this wrapper outlives the agent,
# so the training process cannot tell from its own parent. Its start time tells a reused pid apart.
GRPO_LAUNCHER_PID=$PPID GRPO_LAUNCHER_START=
if [ -r "/proc/$PPID/stat" ]; then
  stat=$(< "/proc/$PPID/stat"); read -r -a fields <<< "${stat##*) }"; GRPO_LAUNCHER_START=${fields[19]}
fi
export GRPO_LAUNCHER_PID GRPO_LAUNCHER_START
# The training process gets its own process group (setsid) so that everything it spawns (e.g.
# dist_checkpointing's manager process) can be ended with it: if it is killed, orphans would
# keep the job's output pipe open and SLURM would wait 60 s for that pipe before ending the job.
# torchrun stops ranks by signalling this wrapper's group; the trap passes that on.
setsid "$@" &
pid=$!
echo "$pid" > "$base.pid"
trap 'kill -TERM -- "-$pid" 2>/dev/null' TERM INT HUP
while :; do
  wait "$pid"
  rc=$?
  kill -0 "$pid" 2>/dev/null || break   # still running: the wait was interrupted by the trap
done
kill -KILL -- "-$pid" 2>/dev/null       # whatever it left behind
if [ "$rc" -gt 128 ]; then
  echo "error (rank $rank on $host): training process $pid was killed by signal $(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))" >&2
fi
exit "$rc"
