#!/usr/bin/env bash
# One device call: our WKV7 kernel beside two of its peers, same shapes, inputs, timer and accuracy
# check (benchmarks/wkv7.py speed / accuracy at chunk 32, our GPU default), each run in its own process
# under its own `timeout`:
#   ours           python3 benchmarks/wkv7.py accuracy --chunk 32; ... speed --chunk 32
#   jla            benchmarks/peers/jla_wkv7.py  (jax-linear-attention 0.1.0, Mosaic GPU, lower_bound -0.61)
#   rwkvlm-v3 / rwkvlm-clampw / rwkvlm-v3alt
#                  benchmarks/peers/rwkvlm_clampw.py --variant ...  (RWKV-LM's train_temp CUDA kernels)
# Not here, each in its own call: FLA = tools/device_kernel_remeasure.sh (benchmarks/peers/fla_wkv7.py);
# flashrwkv2 (TileLang JIT and autotuning, minutes on a fresh machine); the training-step peers
# (benchmarks/peers/fla_train.py, benchmarks/peers/jla_train.py).
#
# Needs .peer/ (git-ignored, so name it in the call's carry): jax_linear_attention-0.1.0-py3-none-any.whl
# and rwkvlm_cuda/ holding RWKV-LM's RWKV-v7/train_temp/cuda/rwkv7_clampw*.{cu,cpp}. No network there:
# the wheel installs with pip --no-index --no-deps --target /tmp/site (its deps, equinox and optax, are
# in the device image). Filling rwkvlm_cuda/ from a clone of BlinkDL/RWKV-LM (or the search tool's mirror):
#   for f in rwkv7_clampw.cu rwkv7_clampw.cpp rwkv7_clampw_v3.cpp rwkv7_clampw_v3_for_h100.cu \
#     rwkv7_clampw_v3_for_h100_alt.cu; do git -C RWKV-LM show HEAD:RWKV-v7/train_temp/cuda/$f >.peer/rwkvlm_cuda/$f; done
#   device run:  bash tools/device_peers.sh       (carry [".peer"], timeout_s 600)
# Env: PEERS (default "ours jla rwkvlm-v3 rwkvlm-clampw rwkvlm-v3alt"; also jla-exact, jla-wab-f32),
#      PEERS_BUDGET (s, default 570: peers that would start with < 30 s left are skipped).
# $OUT gets peers.jsonl (every JSON row, tagged "run": <peer>, then one "peer-status" row per peer with
# its rc, seconds and, on failure, its last error line) and peers.log (all output, build logs included).
set -uo pipefail
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
RES=$OUT/peers.jsonl; LOG=$OUT/peers.log
: >"$RES"; : >"$LOG"
T0=$SECONDS
BUDGET=${PEERS_BUDGET:-570}
PEER_DIR=${PEER_DIR:-.peer}
SRC=$PEER_DIR/rwkvlm_cuda
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_ext}
PEERS=${PEERS:-"ours jla rwkvlm-v3 rwkvlm-clampw rwkvlm-v3alt"}

# status NAME RC SECONDS LOGFILE: one JSON row; on failure, the last line that names an error
status() {
  python3 - "$@" <<'PY' | tee -a "$RES"
import json, re, sys
name, rc, secs, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
row = {"case": "peer-status", "peer": name, "rc": rc, "seconds": secs, "ok": rc == 0}
if rc:
    lines = [l.strip() for l in open(log, errors="replace") if l.strip()]
    errs = [l for l in lines if re.search(r"Error|error|Exception|Traceback|FAILED|No such", l)]
    pick = (errs or lines or ["(no output)"])[-1]
    if pick.startswith("{"):   # the script's own error row: its message
        try:
            pick = str(json.loads(pick).get("error", pick))
        except (ValueError, AttributeError):
            pass
    row["error"] = ("timeout: " if rc in (124, 137) else "") + pick[:400]
print(json.dumps(row), flush=True)
PY
}

# tag NAME LOGFILE: the log's JSON rows, each with "run": NAME, into peers.jsonl
tag() {
  python3 - "$1" "$2" >>"$RES" <<'PY'
import json, sys
for line in open(sys.argv[2], errors="replace"):
    if line.startswith("{"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            print(json.dumps({"run": sys.argv[1], **row}))
PY
}

# note NAME TEXT: a peer-status row for a peer that did not run
note() {
  python3 -c 'import json, sys; print(json.dumps({"case": "peer-status", "peer": sys.argv[1],
    "rc": None, "ok": False, "error": sys.argv[2]}))' "$1" "$2" | tee -a "$RES"
}

source "$(dirname "${BASH_SOURCE[0]}")/device_budget.sh"      # budgeted

# one NAME TIMEOUT CMD...: run CMD under timeout (cut to the budget), log it, tag its rows, say how it went
one() {
  local name=$1 tmo=$2; shift 2
  local f=/tmp/peer_$name.log
  echo "===== $name" | tee -a "$LOG"
  if ! budgeted "$f" "$tmo" 0 "$@"; then
    note "$name" "skipped: budget spent (${BUDGET_LEFT}s left)"
    return
  fi
  tag "$name" "$f"
  status "$name" "$BUDGET_RC" "$BUDGET_SECONDS" "$f"
}

python3 - >>"$RES" <<'PY'
import json, subprocess
q = "name,memory.total,driver_version"
try:
    gpu = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError as e:
    gpu = f"nvidia-smi failed: {e}"
print(json.dumps({"case": "gpu", "nvidia_smi": gpu}))
PY

# 1. install jla (no network: the carried wheel), start the RWKV-LM builds (nvcc, CPU only) in the
#    background; they overlap our accuracy check (CPU float64 reference) and are waited for before any timing
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$PEER_DIR"/jax_linear_attention-0.1.0-py3-none-any.whl >>"$LOG" 2>&1 \
  || echo '{"case": "install", "ok": false, "error": "pip install of the jla wheel failed (see peers.log)"}' | tee -a "$RES"
pids=()
if [ -d "$SRC" ]; then    # (without it each rwkvlm peer fails with the missing files named)
  for p in $PEERS; do
    case $p in rwkvlm-*)
      ( timeout -k 5 "${BUILD_TIMEOUT:-240}" nice -n 10 python3 benchmarks/peers/rwkvlm_clampw.py \
          --variant "${p#rwkvlm-}" --src "$SRC" --build-only >"/tmp/build_$p.log" 2>&1
        echo "build $p rc=$?" >>"/tmp/build_$p.log" ) &
      pids+=($!);;
    esac
  done
fi

# 2. ours: accuracy first (CPU-heavy reference; the builds run beside it), then, after the builds, speed
if [[ " $PEERS " == *" ours "* ]]; then
  one ours-accuracy 240 env PYTHONPATH=$PWD python3 benchmarks/wkv7.py accuracy --chunk 32
fi
for p in ${pids[@]+"${pids[@]}"}; do wait "$p"; done
for f in /tmp/build_rwkvlm-*.log; do [ -f "$f" ] && { echo "===== $f"; cat "$f"; } >>"$LOG"; done
[[ " $PEERS " == *" ours "* ]] && one ours 240 env PYTHONPATH=$PWD python3 benchmarks/wkv7.py speed --chunk 32

# 3. the peers, in the order given
for p in $PEERS; do
  case $p in
    ours) ;;
    jla) one jla 300 env PYTHONPATH=/tmp/site:$PWD python3 benchmarks/peers/jla_wkv7.py ;;
    jla-exact) one "$p" 300 env PYTHONPATH=/tmp/site:$PWD python3 benchmarks/peers/jla_wkv7.py --exact ;;
    jla-wab-f32) one "$p" 300 env PYTHONPATH=/tmp/site:$PWD python3 benchmarks/peers/jla_wkv7.py \
                   --wab-f32 ;;
    rwkvlm-*) one "$p" 150 env PYTHONPATH=$PWD python3 benchmarks/peers/rwkvlm_clampw.py \
                --variant "${p#rwkvlm-}" --src "$SRC" ;;
    *) note "$p" "unknown peer (known: ours jla jla-exact jla-wab-f32 rwkvlm-v3 rwkvlm-clampw rwkvlm-v3alt)" ;;
  esac
done
echo "done in $((SECONDS - T0))s" | tee -a "$LOG"
grep -E '"case": "(speed|accuracy|peer-status|speed-error|error)"' "$RES"
