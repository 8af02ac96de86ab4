#!/usr/bin/env bash
# FP8 (`fp8-mixed`) on the device, each mode one call of < 10 min (results in $OUT).
#
#   bash tools/device_fp8.sh gemm [..]    # a 2-layer step's HLO summary; one block GEMM, bf16 vs
#                                         # the FP8 forms, 0.1B/1.5B shapes (extra args:
#                                         # benchmarks/fp8_gemm.py's); two shapes again with
#                                         # XLA's Triton GEMMs off
#   bash tools/device_fp8.sh step [..]    # the 0.1B and 1.5B train steps, bf16-mixed then fp8-mixed
#                                         # (extra args: train_step.py's)
#   bash tools/device_fp8.sh parity       # 300 steps of the 0.1B parity run, bf16-mixed and fp8-mixed
#                                         # (~2.5 min each on an H100; needs .peer/parity/batches.npy:
#                                         # `python benchmarks/train_parity.py data --out .peer/parity`)
#   bash tools/device_fp8.sh profile [..] # the 0.1B step, bf16-mixed then fp8-mixed, top GPU ops of each
#                                         # (where FP8's extra time goes; extra args: train_step.py's)
#   bash tools/device_fp8.sh tests        # the FP8 test files on the GPU (deterministic reductions)
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mode=${1:-}; shift || true
case "$mode" in
  gemm)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    python3 benchmarks/fp8_gemm.py --step --hlo-dir "$OUT/hlo" 2>&1 | grep '^{' | tee "$OUT/fp8_step_hlo.jsonl"
    python3 benchmarks/fp8_gemm.py --out "$OUT/fp8_gemm.jsonl" --hlo-dir "$OUT/hlo" "$@" 2>&1 | grep '^{' | cut -c1-330
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 benchmarks/fp8_gemm.py \
      --shapes 0.1b-att,1.5b-ffn-key --variants bf16,xla --out "$OUT/fp8_gemm_no_triton.jsonl" \
      2>&1 | grep '^{' | cut -c1-330 ;;
  step)   # the 1.5B at RESULTS.md's runtime (no layer scan, no remat); ~9 min in all
    python3 benchmarks/train_step.py --models 0.1b --precisions bf16-mixed fp8-mixed \
      --steps 8 --warmup 2 --out "$OUT/fp8_step.jsonl" "$@"
    python3 benchmarks/train_step.py --models 1.5b --precisions bf16-mixed fp8-mixed \
      --steps 6 --warmup 2 --set runtime.scan_layers=false runtime.remat=false \
      --out "$OUT/fp8_step.jsonl" "$@" ;;
  parity)
    for p in bf16-mixed fp8-mixed; do
      python3 benchmarks/train_parity.py ours --data .peer/parity --precision "$p" \
        --out "$OUT/ours_${p}.jsonl" 2>&1 | tail -1
    done
    python3 benchmarks/train_parity.py report --runs "$OUT/ours_bf16-mixed.jsonl" \
      "$OUT/ours_fp8-mixed.jsonl" --reference ours_bf16-mixed --png "$OUT/parity_fp8.png" ;;
  profile)
    for p in bf16-mixed fp8-mixed; do
      python3 benchmarks/train_step.py --models 0.1b --precisions "$p" --steps 5 --warmup 2 \
        --profile "/tmp/prof_$p" --out "$OUT/fp8_profile.jsonl" "$@" 2>&1 | tail -40
    done ;;
  tests)   # deterministic GPU reductions: the resume tests compare bits with an uninterrupted run
    XLA_FLAGS=--xla_gpu_deterministic_ops=true python3 -m pytest -q -n 4 tests/test_fp8.py tests/train/test_fp8_training.py \
      tests/aot/test_compile_fp8.py tests/test_precision.py \
      tests/train/test_checkpoint_resume.py 2>&1 | tail -15 ;;
  *) echo "usage: $0 gemm|step|parity|profile|tests [args]" >&2; exit 2 ;;
esac
