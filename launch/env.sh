#!/usr/bin/env bash
# Check that this machine (or SLURM node) can run launch/pretrain_gpt.py, and say exactly what
# is missing. Prints one line per check; exits 1 if anything is missing, 0 otherwise.
#
#   bash launch/env.sh [--device auto|cuda|cpu] [--nproc N] [--slurm] [--data-path PREFIX ...]
#
#   --device   cuda: CUDA + NCCL with at least --nproc GPUs; cpu: gloo (CPU mode, docs/cpu_mode.md);
#              auto (default): cuda if nvidia-smi lists a GPU, else cpu
#   --slurm    also check the SLURM job variables and client commands (inside a job/step)
#   --data-path  dataset prefixes (PREFIX.bin/.idx/.meta.json); weights as in --data-path are skipped
# Environment: PYTHON (default $VENV/bin/python, then <repo>/.venv/bin/python, then python3).
# launch/slurm/node_task.sh runs this on every node before training, so a node that lacks
# something fails the job at once, naming itself, instead of hanging the rendezvous.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEVICE=auto NPROC=1 SLURM=0 DATA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs auto, cuda or cpu}; shift 2 ;;
    --nproc) NPROC=${2:?--nproc needs a number}; shift 2 ;;
    --slurm) SLURM=1; shift ;;
    --data-path) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do DATA+=("$1"); shift; done ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "launch/env.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
HOST=$(hostname)
PROBLEMS=0
ok() { echo "[env $HOST] ok       $*"; }
missing() { echo "[env $HOST] MISSING  $*"; PROBLEMS=$((PROBLEMS + 1)); }

if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VENV:-}" ] && [ -x "$VENV/bin/python" ]; then PYTHON=$VENV/bin/python
  elif [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python
  else PYTHON=$(command -v python3 || true); fi
fi
if [ "$DEVICE" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in cuda|cpu) ;; *) echo "launch/env.sh: --device must be auto, cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac

if [ -z "$PYTHON" ] || ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  missing "python >= 3.10: '${PYTHON:-python3}' not found or too old; create the environment with 'bash launch/setup_env.sh' or set PYTHON=/path/to/python"
else
  # One interpreter start for all package checks; megatron is found, not imported (imports
  # cost seconds and the training processes import it anyway).
  while IFS= read -r line; do
    case "$line" in ok\ *) ok "${line#ok }" ;; missing\ *) missing "${line#missing }" ;; *) echo "$line" ;; esac
  done < <(ROOT="$ROOT" DEVICE="$DEVICE" NPROC="$NPROC" "$PYTHON" - 2>&1 <<'PY'
import importlib.metadata as md, importlib.util as iu, os, sys
root, device, nproc = os.environ["ROOT"], os.environ["DEVICE"], int(os.environ["NPROC"])
print(f"ok python {sys.executable} ({sys.version.split()[0]})")
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
fix = "fix: bash launch/setup_env.sh (CPU) or 'pip install -e .[gpu]' in the site's CUDA torch environment"
try:
    import torch
    print(f"ok torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
except Exception as exc:
    torch = None
    print(f"missing torch: cannot import it with {sys.executable} ({exc}); {fix}")
mc = version("megatron-core")
if mc is None or iu.find_spec("megatron.core") is None:
    print(f"missing megatron-core: not installed for {sys.executable}; {fix}")
else:
    # The glue's own version gate, read by path (importing megatron_grpo.megatron would
    # import megatron-core, which costs seconds here).
    spec = iu.spec_from_file_location("grpo_compat", os.path.join(root, "megatron_grpo", "megatron", "compat.py"))
    compat = iu.module_from_spec(spec)
    spec.loader.exec_module(compat)
    problem = compat.version_problem(compat.parse_version(mc))
    print(f"missing megatron-core in the supported range: {problem}" if problem else f"ok megatron-core {mc}")
sys.path.insert(0, root)
for mod, hint in (("megatron_grpo", f"the checkout {root} is incomplete"), ("yaml", fix),
                  ("numpy", fix), ("psutil", "dist_checkpointing needs it: pip install psutil")):
    if iu.find_spec(mod) is None:
        print(f"missing python module {mod}: {hint}")
    elif mod == "megatron_grpo":
        print(f"ok megatron_grpo from {root}")
if torch is not None:
    import torch.distributed as dist
    if device == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < nproc:
            print(f"missing CUDA devices: {n} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}), "
                  f"{nproc} rank(s) per node need one each; fix the allocation (--gpus-per-node) or use "
                  f"GRPO_DEVICE=cpu for CPU mode")
        else:
            print(f"ok CUDA {torch.version.cuda}, {n} GPU(s): {torch.cuda.get_device_name(0)}")
        if not dist.is_nccl_available():
            print("missing NCCL: this torch build has no NCCL backend; install a CUDA build of torch")
        else:
            print(f"ok NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    elif not dist.is_gloo_available():
        print("missing gloo: this torch build has no gloo backend, which CPU mode needs")
    else:
        print(f"ok CPU mode: gloo backend, {nproc} rank(s) per node, {os.cpu_count()} CPU(s) visible")
PY
)
fi

if [ "$SLURM" = 1 ]; then
  for v in SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_JOB_NUM_NODES; do
    [ -n "${!v:-}" ] && ok "$v=${!v}" || missing "$v: not set; run inside a SLURM job (sbatch/salloc), or use launch/run_local.sh on one machine"
  done
  for c in scontrol srun; do
    command -v "$c" >/dev/null 2>&1 && ok "$c: $(command -v "$c")" || missing "$c: SLURM client command not on PATH"
  done
fi

for entry in ${DATA[@]+"${DATA[@]}"}; do
  case "$entry" in ''|*[!0-9.eE+-]*) ;; *) continue ;; esac      # a blend weight, not a prefix
  for suffix in .bin .idx .meta.json; do
    if [ -r "$entry$suffix" ]; then ok "data $entry$suffix"
    else missing "data $entry$suffix: not readable on $HOST; build it with launch/preprocess_data.py, or copy it to the same path on every node (without a shared filesystem)"; fi
  done
done

if [ "$PROBLEMS" -gt 0 ]; then
  echo "[env $HOST] $PROBLEMS problem(s): fix the MISSING lines above" >&2
  exit 1
fi
echo "[env $HOST] ready ($DEVICE mode)"
