#!/usr/bin/env bash
# Throughput measurements on the device, each a call of < 10 min (results in $OUT).
#
#   bash tools/device_throughput.sh prefill       # prefill [1, 4096]: ours then FLA, logits on both sides
#   bash tools/device_throughput.sh profile [..]  # ours, 0.1B + 1.5B bf16-mixed, top GPU ops (extra args: train_step.py's)
#   bash tools/device_throughput.sh train MODEL [..]  # FLA amp first (autotune), then ours bf16-mixed, same call
#                                                    # (extra args: train_step.py's, e.g. the 1.5B runtime
#                                                    # of RESULTS.md: --set runtime.scan_layers=false
#                                                    # runtime.remat=false (since 2026-11-26);
#                                                    # FLA_S=seconds caps FLA's run, default 420)
#   bash tools/device_throughput.sh peer-tune MODEL [S] # FLA alone for S seconds (540), to keep its
#                                                    # autotuning (see peer())
#   bash tools/device_throughput.sh fla-best MODEL [..] # FLA at its best, then ours, same call:
#                                                    # tools/device_fla_best.sh (its header: runs
#                                                    # fused / linear cross-entropy, torch.compile,
#                                                    # expandable segments, each its own process)
#
# FLA's first steps on a fresh machine include minutes of Triton autotuning (1.5B: over 380 s
# from nothing, 235 s with 22 results restored on 2026-11-25; 0.1B did not finish in 240 s on
# 2026-11-23): one model per call, the peer first.
#   bash tools/device_throughput.sh precisions    # ours fp32-fast and fp32 (the price of fp32)
#   bash tools/device_throughput.sh reset [..]    # 0.1B, documents of ~1000 tokens: state carried
#                                                 # across them vs data.reset_at_document_boundary
#   bash tools/device_throughput.sh longest [..]  # 0.1B: the longest context one GPU trains
#                                                 # (remat + layer scan; compile-only search)
#   bash tools/device_throughput.sh remat15 [K..] # 1.5B fast runtime (no layer scan, save_dots)
#                                                 # with runtime.remat_layers = each K (default
#                                                 # 2 1 0): step time against peak memory
#   bash tools/device_throughput.sh ab MODEL [..] # same-call A/B: .peer/rev's lwm_jax (an older
#                                                 # commit) against this tree, twice, alternating
#                                                 # (AB_REPS=1: once each, for long cases)
# For `ab`, snapshot the older commit first (here, not on the device; .peer is carried):
#   rm -rf .peer/rev && mkdir -p .peer/rev && git archive REV lwm_jax | tar -x -C .peer/rev
#
# Needs the fla-core, flash-linear-attention and einops wheels in .peer/ (carried).
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# FLA's Triton autotuning outlasts a call on a fresh machine (0.1B: 445 s on an H100,
# 2026-11-24; restored, 31 s). FLA asks Triton to keep its autotuning results
# (`cache_results`, FLA_CACHE_RESULTS defaults to 1) in TRITON_CACHE_DIR:
# `peer-tune MODEL` runs FLA alone and returns those small
# JSON files as $OUT/fla_autotune_<gpu>.tgz; copy it into .peer/ and later calls restore it, so
# the peer compiles its tuned configs without re-timing every candidate.
gpu_tag() { nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cs 'A-Za-z0-9' _ | sed 's/_$//'; }
peer() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/*.whl 2>&1 | tail -2
  export TRITON_CACHE_DIR=/tmp/triton_cache
  mkdir -p "$TRITON_CACHE_DIR"
  local tuned=.peer/fla_autotune_$(gpu_tag).tgz
  if [ -f "$tuned" ]; then tar -xzf "$tuned" -C "$TRITON_CACHE_DIR" && echo "restored $tuned"; fi
}
fla_train() {   # fla_train SECONDS MODEL: FLA's amp train step (fla_train.py's defaults: fused
                # cross-entropy, eager, 30 timed steps), rows in $OUT/fla_train.log
  PYTHONPATH=/tmp/site timeout "$1" python3 -W ignore benchmarks/peers/fla_train.py \
    --models "$2" --modes amp 2>&1 | tee "$OUT/fla_train.log" | grep '^{'
}
save_peer_tuning() {
  (cd "$TRITON_CACHE_DIR" && find . -name '*autotune*.json' > /tmp/tuned.list
   echo "$(wc -l < /tmp/tuned.list) autotuning results"
   [ -s /tmp/tuned.list ] && tar -czf "$OUT/fla_autotune_$(gpu_tag).tgz" -T /tmp/tuned.list)
}
# sourced (tools/device_fla_best.sh takes peer, gpu_tag, save_peer_tuning from here): no part runs
[ "${BASH_SOURCE[0]}" != "$0" ] && return 0
mode=${1:-}; shift || true
case "$mode" in
  prefill)
    peer
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 240 python3 benchmarks/generate.py --reps 5 --decode-batches 2>&1 | tee "$OUT/prefill_ours.log" | grep -v "^{"
    PYTHONPATH=/tmp/site timeout 300 python3 benchmarks/peers/fla_generate.py --reps 5 \
      --decode-batches 2>&1 | tee "$OUT/prefill_fla.log" | tail -4 ;;
  profile)
    python3 benchmarks/train_step.py --profile /tmp/prof --out "$OUT/ours_profile.jsonl" "$@" ;;
  train)
    model=${1:?usage: $0 train 0.1b|1.5b [train_step.py args]}; shift
    peer
    fla_train "${FLA_S:-420}" "$model"   # FLA_S: its time limit in seconds
    save_peer_tuning
    python3 benchmarks/train_step.py --models "$model" --out "$OUT/ours_train.jsonl" "$@" ;;
  peer-tune)
    model=${1:?usage: $0 peer-tune 0.1b|1.5b [seconds]}
    peer
    fla_train "${2:-540}" "$model"
    save_peer_tuning ;;
  fla-best)
    exec bash "$(dirname "$0")/device_fla_best.sh" "$@" ;;
  precisions)
    python3 benchmarks/train_step.py --precisions fp32-fast fp32 --out "$OUT/ours_precisions.jsonl" "$@" ;;
  reset)
    for r in false true; do
      python3 benchmarks/train_step.py --models 0.1b --doc-len 1000 --out "$OUT/ours_reset.jsonl" \
        --set data.reset_at_document_boundary=$r "$@"
    done ;;
  longest)
    # probes without GEMM autotuning (each is a compile: the search needs only XLA's memory
    # plan); the final 2-step run is autotuned as `lwm-jax train` is. JAX takes 75% of the GPU
    # unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (docs/distributed.md).
    timeout 560 python3 benchmarks/longest_context.py --search-untuned \
      --model 0.1b --lo 1048576 --hi 4194304 --multiple 262144 --run --out "$OUT/longest.jsonl" \
      --set runtime.remat=true runtime.scan_layers=true "$@" ;;
  remat15)
    # each case compiles the unrolled 1.5B step (~110-130 s): three fit one call
    for k in ${@:-2 1 0}; do
      python3 benchmarks/train_step.py --models 1.5b --steps 8 --out "$OUT/remat15.jsonl" \
        --set runtime.scan_layers=false runtime.remat_policy=save_dots runtime.remat_layers="$k"
    done ;;
  ab)
    model=${1:?usage: $0 ab 0.1b|1.5b [train_step.py args]}; shift
    test -d .peer/rev/lwm_jax || { echo "ab: no .peer/rev/lwm_jax (see the header)" >&2; exit 2; }
    for i in $(seq "${AB_REPS:-2}"); do
      PYTHONPATH=$PWD/.peer/rev python3 benchmarks/train_step.py --models "$model" \
        --out "$OUT/ab_rev.jsonl" "$@"
      python3 benchmarks/train_step.py --models "$model" --out "$OUT/ab_head.jsonl" "$@"
    done ;;
  *) echo "usage: $0 prefill|profile|train MODEL|peer-tune MODEL|fla-best MODEL|precisions|reset|longest|remat15 [K..]|ab MODEL [train_step.py args]" >&2
     exit 2 ;;
esac
