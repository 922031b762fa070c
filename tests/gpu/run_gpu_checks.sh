#!/usr/bin/env bash
# Device checks for a session that is lent a CUDA machine (not part of CI, which has no GPU).
# Expects megatron-core wheels in .whl/ (see docs/benchmarks.md) and writes logs under $OUT.
#   bash tests/gpu/run_gpu_checks.sh
set -uo pipefail
OUT="${OUT:-/tmp/gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
log() { echo "=== $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi -L | tee -a "$OUT/summary.txt"
python3 -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)' | tee -a "$OUT/summary.txt"

log "1. CPU mode must be a no-op where CUDA exists"
python3 - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import torch
from megatron_grpo.platform import enable_cpu_mode, cpu_mode_active, select_platform
t_before = torch.Tensor.type
print("enable_cpu_mode ->", enable_cpu_mode(), "| active", cpu_mode_active(),
      "| cuda available", torch.cuda.is_available(), "| Tensor.type untouched", torch.Tensor.type is t_before)
print("platform:", select_platform())
PY

log "2. compressors on the GPU (128 MiB fp32 bucket)"
python3 launch/bench_compress.py --device cuda --repeats 5 2>&1 | tee -a "$OUT/summary.txt"

log "2b. host time per bucket vs dp on CUDA (issue 7 item 5: batched path within 1.5x from dp=8 to 512)"
python3 launch/bench_compress.py --device cuda --dp 8 64 512 --bucket-numel 40000 --repeats 10 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
python3 launch/bench_compress.py --device cuda --dp 8 64 512 --bucket-numel 33554432 --repeats 3 2>&1 | tail -12 | tee -a "$OUT/summary.txt"

log "3. build the default corpus"
python3 launch/preprocess_data.py --default-corpus --output-prefix /tmp/data/stdlib 2>&1 | tail -1 | tee -a "$OUT/summary.txt"

run() {  # name, extra flags
  local name=$1; shift
  timeout 240 torchrun --nproc_per_node 1 --master_addr 127.0.0.1 --master_port 29555 launch/pretrain_gpt.py \
     --data-path /tmp/data/stdlib --metrics-file "$OUT/$name.jsonl" --run-name "$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
log "4. tiny GPT on CUDA/NCCL, baseline and GRPO (1 GPU: dp=1, no data-parallel traffic)"
run tiny_base --config launch/configs/tiny.yaml --train-iters 100 --eval-interval 100 --log-interval 50
# Strict comm: every tensor GRPO hands to a collective must be a CUDA tensor (NCCL); RU and
# importance time come from CUDA events (grpo_timing = cuda_events in the metrics).
MEGATRON_GRPO_STRICT_COMM=1 run tiny_grpo --config launch/configs/tiny.yaml --train-iters 100 --eval-interval 100 --log-interval 50 --grpo
log "5. 24-layer hidden-1024 GPT (~330M), bf16, baseline vs GRPO: importance overhead and step time"
BIG="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --micro-batch-size 8 --global-batch-size 8 --bf16 --train-iters 40 --eval-interval 40 --eval-iters 2 --log-interval 20 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 10"
run big_base $BIG
run big_grpo $BIG --grpo --grpo-bucket-mb 16 --grpo-warmup-iters 10 --grpo-retier-interval 10 --grpo-stable-interval 5
log "6. figures"
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, statistics, sys, os
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n + ".jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
for a, b in (("tiny_base", "tiny_grpo"), ("big_base", "big_grpo")):
    ra, rb = load(a), load(b)
    if not ra or not rb:
        print(a, b, "missing"); continue
    med = lambda rs, k: statistics.median(r[k] for r in rs[5:])
    print(f"{a}: loss {ra[0]['loss']:.3f}->{ra[-1]['loss']:.3f} val {ra[-1].get('val_loss')} step {med(ra,'step_time_s')*1e3:.1f} ms "
          f"peak_device {max(r.get('peak_device_bytes',0) for r in ra)/2**30:.2f} GiB")
    tiered = [r for r in rb if r.get("grpo_tiered")]
    imp = statistics.mean(r["grpo_importance_time_s"] / r["step_time_s"] for r in rb[5:])
    print(f"{b}: loss {rb[0]['loss']:.3f}->{rb[-1]['loss']:.3f} val {rb[-1].get('val_loss')} step {med(rb,'step_time_s')*1e3:.1f} ms "
          f"peak_device {max(r.get('peak_device_bytes',0) for r in rb)/2**30:.2f} GiB importance {100*imp:.2f}% "
          f"tier map {rb[-1]['grpo_tier_map']} step ratio {med(rb,'step_time_s')/med(ra,'step_time_s'):.3f} "
          f"timing {rb[-1].get('grpo_timing')} ru {rb[-1].get('grpo_ru')}")
PY
