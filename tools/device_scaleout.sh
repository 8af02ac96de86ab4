#!/usr/bin/env bash
# Scale-out measurements on a 2-GPU machine (nvidia-h200-x2), two device calls (< 10 min each):
#
#   bash tools/device_scaleout.sh dp         # data parallel, 0.1B and 1.5B (rows in $OUT/scaleout.jsonl)
#   bash tools/device_scaleout.sh fsdp       # 1M-token sequence parallel, then FSDP of a ~7B model
#   bash tools/device_scaleout.sh longest    # the longest 0.1B context two GPUs train (sequence=2)
#
# 1. Data-parallel efficiency 1 -> 2 GPUs at the throughput shapes: 0.1B 8 x 4096 and 1.5B
#    2 x 4096 per GPU (the 1-GPU case sees one GPU through CUDA_VISIBLE_DEVICES).
# 2. FSDP: an RWKV-7 of ~7B (L32 D4096) at batch 2 x 4096 on one GPU (expected not to fit)
#    and with mesh.fsdp=2 on two.
# 3. Sequence parallelism: the 0.1B model at 1,048,576 tokens of context, mesh.sequence=2.
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rows="$OUT/scaleout.jsonl"
case_() {   # case_ TIMEOUT GPUS train_step.py-args...
  local t=$1 gpus=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus timeout "$t" python3 benchmarks/train_step.py --out "$rows" "$@" \
    2>&1 | grep '^{' | cut -c1-600
}
BIG="model.n_layer=32 model.n_embd=4096 runtime.remat=true runtime.scan_layers=true"
# Cold compiles on a fresh machine (2026-11-24): 0.1B ~45 s, 1.5B more than 80 s, the ~7B case
# more than 120 s. Pass `dp` or `fsdp` to run one half per call (each < 10 min).
part=${1:-dp}
if [ "$part" = dp ]; then
  case_ 110 0   --models 0.1b --steps 8
  case_ 120 0,1 --models 0.1b --steps 8 --set train.batch_size=16 mesh.data=2
  case_ 150 0   --models 1.5b --steps 6
  case_ 150 0,1 --models 1.5b --steps 6 --set train.batch_size=4 mesh.data=2
elif [ "$part" = longest ]; then
  timeout 560 python3 benchmarks/longest_context.py --search-untuned \
    --model 0.1b --lo 1048576 --hi 8388608 --multiple 524288 --run --out "$OUT/longest_sp.jsonl" \
    --set runtime.remat=true runtime.scan_layers=true mesh.data=1 mesh.sequence=2
else
  case_ 120 0,1 --models 0.1b --steps 2 --warmup 1 --set train.batch_size=1 train.ctx_len=1048576 \
    runtime.remat=true runtime.scan_layers=true mesh.data=1 mesh.sequence=2
  # One GPU: only the pre-flight's answer is wanted (XLA's memory analysis of the compiled step
  # against the GPU's limit; on CPU the analysis reads 186 GiB for one device, 95 GiB each for
  # fsdp=2), so GEMM autotuning, most of the >120 s compile, is off for this case.
  XLA_FLAGS=--xla_gpu_autotune_level=0 \
    case_ 150 0 --models 1.5b --steps 3 --warmup 1 --set train.batch_size=2 $BIG
  case_ 300 0,1 --models 1.5b --steps 3 --warmup 1 --set train.batch_size=2 $BIG mesh.data=1 mesh.fsdp=2
fi
