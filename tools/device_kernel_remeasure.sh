#!/usr/bin/env bash
# One device call: WKV7 kernel precision probe, then ours vs FLA kernel speed (same timer).
#   bash tools/device_kernel_remeasure.sh      # needs the FLA wheels in .peer/ (see RESULTS.md)
# Results land in $OUT (JSON lines). The IEEE-fp32 ("highest") compile runs last, capped.
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/wkv7.py precision --names default tf32x3 2>&1 | tee "$OUT/precision.jsonl"
python3 benchmarks/wkv7.py speed --chunk 32 2>&1 | tee "$OUT/ours_speed.jsonl"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/*.whl
PYTHONPATH=/tmp/site:$PWD python3 benchmarks/peers/fla_wkv7.py 2>&1 | tee "$OUT/fla_speed.jsonl"
timeout "${HIGHEST_CAP_S:-200}" python3 benchmarks/wkv7.py precision --names highest 2>&1 \
  | tee -a "$OUT/precision.jsonl"
echo "highest probe exit: $?" | tee -a "$OUT/precision.jsonl"
