#!/usr/bin/env bash
# The GPU half of the training-trust work (docs/precision-nan.md), as device calls of < 10 min.
#
#   bash tools/device_training_trust.sh tests    # GPU tests: 0.1B 100 steps, chunked memory, kernels
#   bash tools/device_training_trust.sh islands  # the fp32 islands and hand-written VJPs on the GPU
#   bash tools/device_training_trust.sh ours     # parity: ours bf16-mixed on text and on random tokens
#   bash tools/device_training_trust.sh fp32     # parity: ours fp32 on text (IEEE matmuls: ~7 min)
#   bash tools/device_training_trust.sh fla      # parity: FLA from the same initial weights
#
# Needs (carried in .peer/): the fla-core, flash-linear-attention and einops wheels, and
# .peer/parity/batches.npy from `python benchmarks/train_parity.py data --out .peer/parity`.
# `ours` writes the initial weights to /tmp/parity/init_hf, which `fla` reads: run them on the
# same warm machine, or first `python3 benchmarks/train_parity.py init --init-hf /tmp/parity/init_hf`
# (the same deterministic initial weights). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
case "${1:-}" in
  tests)     # 6-8 min on an H100 (2026-11-24)
    python3 -m pytest -q -rf tests/train/test_gpu_training.py tests/ops/wkv7/test_wkv7_pallas.py \
      tests/ops/wkv7/test_wkv7_aligned_keys.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
  islands)   # ~3 min: the fp32 islands and the hand-written backward rules, on the GPU
    python3 -m pytest -q -rf tests/layers/test_norms.py tests/layers/test_rms_norm.py \
      tests/models/rwkv7/test_kk_normalise.py tests/models/rwkv7/test_squared_relu.py \
      tests/test_fp32_islands.py 2>&1 | tee "$OUT/gpu_islands.log" | tail -15 ;;
  ours)
    for run in "bf16-mixed ours_bf16 --init-hf /tmp/parity/init_hf" \
               "bf16-mixed ours_bf16_random --random-tokens"; do
      set -- $run
      python3 benchmarks/train_parity.py ours --data .peer/parity --precision "$1" \
        --out "$OUT/$2.jsonl" "${@:3}" 2>&1 | tail -14
    done ;;
  fp32)   # XLA's GEMM autotuning of the fp32 step takes ~8 min on an H200: off (RESULTS.md)
    export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0}"
    python3 benchmarks/train_parity.py ours --data .peer/parity --precision fp32 \
      --out "$OUT/ours_fp32.jsonl" 2>&1 | tail -14 ;;
  fla)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/peers/fla_train_parity.py --data .peer/parity \
      --init-hf /tmp/parity/init_hf --out "$OUT/fla_amp.jsonl" 2>&1 | tail -14 ;;
  *) echo "usage: $0 tests|islands|ours|fp32|fla" >&2; exit 2 ;;
esac
