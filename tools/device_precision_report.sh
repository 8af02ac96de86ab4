#!/usr/bin/env bash
# `lwm-jax precision-report` on the GPU (issue 14): TF32 and cuBLAS/Pallas rounding only show
# there. One device call of a few minutes (0.1B at 2 x 128 tokens: the float64 references run
# on the host CPU and grow with the tokens); report.json, heatmap.png and the log per case in $OUT.
#
#   bash tools/device_precision_report.sh
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
report() {   # name, then precision-report arguments
  local name=$1; shift
  timeout 200 python3 -m lwm_jax.cli precision-report -o "$OUT/precision_$name" "$@" \
    2>&1 | tee "$OUT/precision_$name.log" | tail -25
}
report tiny_bf16 --policy bf16-mixed
report tiny_fp32fast --policy fp32-fast
report 0.1b_bf16 --config configs/rwkv7-0.1b.yaml --policy bf16-mixed --seq-len 128
report 0.1b_fp16 --config configs/rwkv7-0.1b.yaml --policy fp16-mixed --seq-len 128 --no-gradients
