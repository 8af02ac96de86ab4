#!/usr/bin/env bash
# Scale-out measurements on a 2-GPU machine (nvidia-h200-x2 or nvidia-h100-x2), one part per
# device call (each < 10 min):
#
#   bash tools/device_scaleout.sh dp [MODEL] # data parallel, 0.1B and/or 1.5B (rows in $OUT/scaleout.jsonl)
#   bash tools/device_scaleout.sh fsdp       # FSDP of a model one GPU cannot hold (+ 1M tokens on H200s)
#   bash tools/device_scaleout.sh longest    # the longest 0.1B context two GPUs train (sequence=2)
#   bash tools/device_scaleout.sh longest1   # the longest 0.1B context one GPU plans (H200: and trains)
#   bash tools/device_scaleout.sh overlap    # 1.5B data parallel, and with XLA's overlap flags (2, 3)
#   bash tools/device_scaleout.sh flags      # 1.5B on two GPUs: collective overlap limit, NCCL channels/protocol
#   bash tools/device_scaleout.sh dpov       # after dp, same call: 1.5B on two GPUs with the overlap flags
#   bash tools/device_scaleout.sh cta        # 1.5B on two GPUs: NCCL_CTA_POLICY 1 / 2, NCCL user buffers
#   bash tools/device_scaleout.sh combine    # 1.5B on two GPUs: all-reduce combine thresholds
#   bash tools/device_scaleout.sh dpbest [MODEL] # 1 and 2 GPUs with the kept flags (both models)
#   bash tools/device_scaleout.sh dpbig      # 1.5B at 4 x 4096 per GPU: 1, 2 (kept flags), 2 (none), 1
#   bash tools/device_scaleout.sh dpprof     # profiles of the 1.5B step on 1 and 2 GPUs (exposed NCCL)
#   bash tools/device_scaleout.sh init       # where the state's init time goes (1.5B, one GPU)
#   bash tools/device_scaleout.sh kernels    # data parallel on two GPUs: the fused LayerNorm /
#        GroupNorm / ChannelMix kernels per device ("pallas") against "auto" (XLA's forms on a
#        mesh), both models, and the per-device kernel test against one device
# On a 4- or 8-GPU machine (nvidia-h200-x4/x8, nvidia-h100-x4/x8), N = the GPUs it has:
#   bash tools/device_scaleout.sh dpn [MODEL]   # data parallel 1 -> 2 -> 4 (-> 8) GPUs, kept flags
#   bash tools/device_scaleout.sh fsdpn [MODEL] # FSDP (ZeRO-3): 1 GPU, then 2 -> 4 (-> 8), kept flags
#   bash tools/device_scaleout.sh spn           # 0.1B at 1,048,576 tokens on N GPUs (sequence=N)
#   bash tools/device_scaleout.sh longestn      # the longest 0.1B context N GPUs train
#   bash tools/device_scaleout.sh alln          # one call: 1 GPU and N GPUs (FSDP, data) of both
#        models, .peer/rev's tree before this one for 0.1B FSDP, then spn (both trees) as time allows
#   AB=1 bash tools/device_scaleout.sh dpn|fsdpn|spn [MODEL]  # each multi-GPU case twice, same call:
#        .peer/rev's lwm_jax (an older commit, as for device_throughput.sh ab), then this tree
#
# 1. Data-parallel efficiency 1 -> 2 GPUs at the throughput shapes: 0.1B 8 x 4096 and 1.5B
#    2 x 4096 per GPU (the 1-GPU case sees one GPU through CUDA_VISIBLE_DEVICES).
# 2. FSDP at batch 2 x 4096, remat + layer scan: on one GPU only XLA's plan of the step against
#    the GPU's limit (compiled without GEMM autotuning, not run), and a run with mesh.fsdp=2 on
#    two. The model is sized by the GPU: ~7B (L32 D4096) on 141 GB H200s,
#    ~4B (L32 D3072; CPU plan 107.7 GiB on one device, 55.8 GiB each for fsdp=2) on 80 GB H100s.
# 3. Sequence parallelism: the 0.1B model at 1,048,576 tokens of context, mesh.sequence=2 (part
#    fsdp on H200s; on H100s part longest finds how long a context two GPUs train).
# Memory: XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's default 0.75) is raised to 0.95 unless set.
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rows="$OUT/scaleout.jsonl"
case_() {   # case_ TIMEOUT GPUS MODEL train_step.py-args...: the case's own process (`--one`),
  # its log kept, so one cut off by its limit still shows its STAGE lines and last words
  local t=$1 gpus=$2 model=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "$t" python3 benchmarks/train_step.py \
    --one "$model" bf16-mixed "$@" > "$OUT/case.log" 2>&1
  local rc=$?
  grep -h '^STAGE\|^ANALYSIS' "$OUT/case.log"
  if grep -q '^ROW ' "$OUT/case.log"; then
    grep '^ROW ' "$OUT/case.log" | cut -c5- | tee -a "$rows" | cut -c1-600
  else
    echo "{\"model\": \"$model\", \"args\": \"$*\", \"gpus\": \"$gpus\", \"rc\": $rc}" | tee -a "$rows"
    grep -v '^STAGE\|^ANALYSIS' "$OUT/case.log" | tail -3 | cut -c1-400
  fi
}
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mib:-0}" -ge 100000 ]; then big_c=4096; else big_c=3072; fi   # H200 : H100
BIG="model.n_layer=32 model.n_embd=$big_c runtime.remat=true runtime.scan_layers=true"
# XLA flag sets of the 1.5B data-parallel sweeps (docs/distributed.md says what each does)
OV="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_pipelined_all_reduce=true"
LIM="--xla_gpu_experimental_parallel_collective_overlap_limit=2"
BEST="$OV $LIM --xla_gpu_all_reduce_combine_threshold_bytes=4194304"     # kept (2026-11-25, two H100s)
two15() { case_ 150 0,1 1.5b --steps 8 --set train.batch_size=4 mesh.data=2; }   # 1.5B, 2 GPUs
# Time per case on a fresh H100 (2026-11-25): 1.5B init 6-9 s (63 s before the QRs ran one
# matrix at a time), compile 29-40 s; 4.1B over two GPUs init 10 s, compile 32 s; the 1.5B
# step without layer scan compiles in 111-123 s. One part per call keeps each call < 10 minutes.
ngpu=$(nvidia-smi -L | wc -l)
gpus_() { seq -s, 0 $(($1 - 1)); }   # gpus_ 4 -> 0,1,2,3
scale_() {   # scale_ MODEL PER_GPU_BATCH MESH_AXIS FIRST_N: 1 GPU, then FIRST_N, 2 FIRST_N, ... <= ngpu
  local model=$1 b=$2 axis=$3 n=$4 t=150
  case_ $t 0 "$model" --steps 8 --set train.batch_size="$b"
  while [ "$n" -le "$ngpu" ]; do
    local trees=$PWD
    [ -n "${AB:-}" ] && trees="$PWD/.peer/rev $PWD"
    for tree in $trees; do
      PYTHONPATH=$tree XLA_FLAGS="$BEST" case_ $t "$(gpus_ "$n")" "$model" --steps 8 \
        --set train.batch_size=$((b * n)) \
        mesh.data=$([ "$axis" = data ] && echo "$n" || echo 1) \
        mesh.fsdp=$([ "$axis" = fsdp ] && echo "$n" || echo 1)
    done
    n=$((n * 2))
  done
}
sp_() {      # sp_ TREE TIMEOUT: 0.1B at 1,048,576 tokens over all GPUs (mesh.sequence=N), TREE's lwm_jax
  PYTHONPATH=$1 case_ "$2" "$(gpus_ "$ngpu")" 0.1b --steps 3 --warmup 1 --set train.batch_size=1 \
    train.ctx_len=1048576 runtime.remat=true runtime.scan_layers=true mesh.data=1 \
    mesh.sequence="$ngpu"
}
part=${1:-dp}
if [ "$part" = dp ]; then           # `dp 0.1b` or `dp 1.5b`: one model only
  if [ "${2:-0.1b}" = 0.1b ]; then
    case_ 110 0   0.1b --steps 8
    case_ 120 0,1 0.1b --steps 8 --set train.batch_size=16 mesh.data=2
  fi
  if [ "${2:-1.5b}" = 1.5b ]; then
    case_ 150 0   1.5b --steps 6
    case_ 150 0,1 1.5b --steps 6 --set train.batch_size=4 mesh.data=2
  fi
elif [ "$part" = kernels ]; then   # same call: per-device kernels ("pallas") vs auto (XLA's forms on a mesh)
  # the kernels "auto" picks on one GPU: ln_x and ChannelMix at 0.1B (C 768 < the LayerNorm's
  # AUTO_MIN_CHANNELS), all three at 1.5B
  K01="runtime.ln_x_impl=pallas runtime.ffn_impl=pallas"
  K15="runtime.norm_impl=pallas $K01"
  case_ 120 0,1 0.1b --steps 8 --set train.batch_size=16 mesh.data=2
  case_ 120 0,1 0.1b --steps 8 --set train.batch_size=16 mesh.data=2 $K01
  XLA_FLAGS="$BEST" case_ 150 0,1 1.5b --steps 6 --set train.batch_size=4 mesh.data=2
  XLA_FLAGS="$BEST" case_ 150 0,1 1.5b --steps 6 --set train.batch_size=4 mesh.data=2 $K15
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_kernels_per_device.py \
    2>&1 | tail -3
elif [ "$part" = overlap ]; then   # same call: 1 GPU, 2 GPUs, 2 GPUs with the flags
  OV3="$OV --xla_gpu_enable_while_loop_double_buffering=true"
  case_ 150 0   1.5b --steps 6
  case_ 150 0,1 1.5b --steps 6 --set train.batch_size=4 mesh.data=2
  XLA_FLAGS="$OV" case_ 150 0,1 1.5b --steps 6 --set train.batch_size=4 mesh.data=2
  XLA_FLAGS="$OV3" case_ 150 0,1 1.5b --steps 6 --set train.batch_size=4 mesh.data=2
elif [ "$part" = flags ]; then     # same call: what the exposed collectives and NCCL's SMs cost
  case_ 150 0   1.5b --steps 8
  NCCL_DEBUG=INFO XLA_FLAGS="$OV" two15
  grep -h "NCCL version\|nChannels\|channels" "$OUT/case.log" | sort | uniq -c | head -5 | cut -c1-200
  XLA_FLAGS="$OV $LIM" two15
  NCCL_MAX_NCHANNELS=8 XLA_FLAGS="$OV $LIM" two15
  NCCL_PROTO=Simple XLA_FLAGS="$OV $LIM" two15
elif [ "$part" = dpov ]; then      # after `dp` in the same call: 1.5B on two GPUs, overlap flags
  XLA_FLAGS="$OV $LIM" two15
elif [ "$part" = cta ]; then       # same call: NCCL's CTA policy (fewer SMs taken from compute)
  UB="--xla_gpu_enable_nccl_user_buffers=true"
  case_ 150 0 1.5b --steps 8
  XLA_FLAGS="$OV $LIM" two15
  NCCL_CTA_POLICY=1 XLA_FLAGS="$OV $LIM" two15
  NCCL_CTA_POLICY=1 XLA_FLAGS="$OV $LIM $UB" two15
  NCCL_CTA_POLICY=2 XLA_FLAGS="$OV $LIM $UB" two15
elif [ "$part" = combine ]; then   # same call: all-reduce combining (a 16 MiB matrix was copied
  # into one buffer with an 8 KiB vector before each reduction); thresholds in bytes
  case_ 150 0 1.5b --steps 8
  XLA_FLAGS="$OV $LIM" two15
  XLA_FLAGS="$OV $LIM --xla_gpu_all_reduce_combine_threshold_bytes=1048576" two15
  XLA_FLAGS="$OV $LIM --xla_gpu_all_reduce_combine_threshold_bytes=4194304" two15
elif [ "$part" = dpbest ]; then    # same call: 1 GPU and 2 GPUs with the kept flags, BEST
  if [ "${2:-1.5b}" = 1.5b ]; then     # `dpbest 1.5b` or `dpbest 0.1b`: one model; none: both
    case_ 150 0   1.5b --steps 8
    XLA_FLAGS="$BEST" two15
  fi
  if [ "${2:-0.1b}" = 0.1b ]; then
    case_ 150 0   0.1b --steps 8
    XLA_FLAGS="$BEST" case_ 150 0,1 0.1b --steps 8 --set train.batch_size=16 mesh.data=2
  fi
elif [ "$part" = dpbig ]; then     # same call: 1.5B at twice the per-GPU batch, alternating
  case_ 150 0   1.5b --steps 8 --set train.batch_size=4
  XLA_FLAGS="$BEST" case_ 150 0,1 1.5b --steps 8 --set train.batch_size=8 mesh.data=2
  case_ 150 0,1 1.5b --steps 8 --set train.batch_size=8 mesh.data=2
  case_ 150 0   1.5b --steps 8 --set train.batch_size=4
elif [ "$part" = dpprof ]; then   # where the two-GPU 1.5B step loses time: profiles of both
  NOCB="--xla_gpu_enable_command_buffer="     # kernels named by HLO op in the trace
  XLA_FLAGS="$NOCB" case_ 150 0 1.5b --steps 5 --profile "$OUT/prof1"
  XLA_FLAGS="$OV $LIM $NOCB" case_ 150 0,1 1.5b --steps 5 --profile "$OUT/prof2" \
    --set train.batch_size=4 mesh.data=2
  python3 benchmarks/profile_summary.py "$OUT/prof1" --n 30 > "$OUT/prof1.txt"
  python3 benchmarks/profile_summary.py "$OUT/prof2" --n 30 --against "$OUT/prof1" \
    > "$OUT/prof2.txt"
  sed -n '/^-- by_kind/,/^-- by_scope/p;/^-- communication/,$p' "$OUT/prof2.txt" | cut -c1-200
elif [ "$part" = dpn ]; then      # same call: 1, 2, 4 (, 8) GPUs at the same per-GPU batch
  [ "${2:-0.1b}" = 0.1b ] && scale_ 0.1b 8 data 2
  [ "${2:-1.5b}" = 1.5b ] && scale_ 1.5b 2 data 2
elif [ "$part" = fsdpn ]; then    # same call: 1 GPU, then FSDP over 2, 4 (, 8)
  [ "${2:-1.5b}" = 1.5b ] && scale_ 1.5b 2 fsdp 2
  [ "${2:-0.1b}" = 0.1b ] && scale_ 0.1b 8 fsdp 2
elif [ "$part" = alln ]; then     # what of N GPUs one call (< 10 min) holds, in this order
  t0=$SECONDS; n=$ngpu; all=$(gpus_ "$ngpu")
  left() { [ $((SECONDS - t0)) -lt "$1" ] || { echo "alln: skipped the rest at $((SECONDS - t0)) s"; false; }; }
  case_ 150 0 0.1b --steps 8 --set train.batch_size=8
  for tree in "$PWD/.peer/rev" "$PWD"; do
    PYTHONPATH=$tree XLA_FLAGS="$BEST" case_ 150 "$all" 0.1b --steps 8 \
      --set train.batch_size=$((8 * n)) mesh.data=1 mesh.fsdp="$n"
  done
  XLA_FLAGS="$BEST" case_ 150 "$all" 0.1b --steps 8 --set train.batch_size=$((8 * n)) mesh.data="$n"
  case_ 150 0 1.5b --steps 8 --set train.batch_size=2
  XLA_FLAGS="$BEST" case_ 150 "$all" 1.5b --steps 8 --set train.batch_size=$((2 * n)) mesh.data=1 \
    mesh.fsdp="$n"
  left 450 && sp_ "$PWD" 130
  left 450 && XLA_FLAGS="$BEST" case_ 120 "$all" 1.5b --steps 8 --set train.batch_size=$((2 * n)) \
    mesh.data="$n"
  left 450 && sp_ "$PWD/.peer/rev" 130
  echo "alln: $((SECONDS - t0)) s"
elif [ "$part" = spn ]; then         # AB=1: .peer/rev's tree first, as in scale_
  trees=$PWD; [ -n "${AB:-}" ] && trees="$PWD/.peer/rev $PWD"
  for tree in $trees; do
    sp_ "$tree" 200
  done
elif [ "$part" = longestn ]; then  # searched in multiples of 512k tokens, then trained
  timeout 560 python3 benchmarks/longest_context.py --search-untuned \
    --model 0.1b --lo 1048576 --hi $((ngpu * 1572864)) --multiple 524288 --run \
    --out "$OUT/longest_sp$ngpu.jsonl" \
    --set runtime.remat=true runtime.scan_layers=true mesh.data=1 mesh.sequence="$ngpu"
elif [ "$part" = init ]; then
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 300 python3 benchmarks/init_time.py --model 1.5b --qr \
    --profile "$OUT/init_prof" --out "$OUT/init.jsonl" 2>&1 | grep '^STAGE\|^{' | cut -c1-3000
elif [ "$part" = longest ]; then
  if [ "${mib:-0}" -ge 100000 ]; then lo=1048576 hi=8388608 mult=524288
  else lo=1048576 hi=2097152 mult=262144; fi
  timeout 560 python3 benchmarks/longest_context.py --search-untuned \
    --model 0.1b --lo $lo --hi $hi --multiple $mult --run --out "$OUT/longest_sp.jsonl" \
    --set runtime.remat=true runtime.scan_layers=true mesh.data=1 mesh.sequence=2
elif [ "$part" = longest1 ]; then  # H200: searched, then trained; H100: the plan only
  if [ "${mib:-0}" -ge 100000 ]; then lo=1048576 hi=2097152 run=--run
  else lo=262144 hi=1048576 run=; fi
  CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/longest_context.py --search-untuned \
    --model 0.1b --lo $lo --hi $hi --multiple 131072 $run --out "$OUT/longest_1gpu.jsonl" \
    --set runtime.remat=true runtime.scan_layers=true
else
  if [ "${mib:-0}" -ge 100000 ]; then
    case_ 120 0,1 0.1b --steps 2 --warmup 1 --set train.batch_size=1 \
      train.ctx_len=1048576 runtime.remat=true runtime.scan_layers=true mesh.data=1 mesh.sequence=2
  fi
  # One GPU: only XLA's plan against the GPU's limit is wanted (the trainer's pre-flight rule,
  # compiled without GEMM autotuning, not run).
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 120 python3 benchmarks/longest_context.py --search-untuned \
    --model 1.5b --lo 4096 --hi 4096 --multiple 4096 --out "$OUT/fsdp_1gpu_plan.jsonl" \
    --set train.batch_size=2 $BIG 2>&1 | grep '^{' | cut -c1-500
  case_ 300 0,1 1.5b --steps 3 --warmup 1 --set train.batch_size=2 $BIG mesh.data=1 mesh.fsdp=2
fi
