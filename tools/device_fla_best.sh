#!/usr/bin/env bash
# FLA's training step at its best beside ours, one device call of < 10 min (results in $OUT):
#
#   bash tools/device_fla_best.sh MODEL [train_step.py args]    # MODEL: 0.1b or 1.5b
#   (the same: bash tools/device_throughput.sh fla-best MODEL [..])
#   device run, 1.5B with the runtime of RESULTS.md (carry [".peer"], timeout_s 600):
#     bash tools/device_fla_best.sh 1.5b --set runtime.scan_layers=false runtime.remat=false
#
# FLA's Triton autotuning is restored from .peer/ by the `train` part's own code (peer() of
# tools/device_throughput.sh, sourced; without .peer/fla_autotune_<gpu>.tgz for this GPU the
# first FLA run autotunes for minutes: run `peer-tune MODEL` first and copy its tgz into .peer/),
# then every run of FLA_BEST_RUNS goes in its own process under its own `timeout`, in the order
# given:
#   CE[+expandable][+compile]   benchmarks/peers/fla_train.py --models MODEL --modes amp --ce CE
#                               (CE: fused = FLA's default fused cross-entropy on full logits,
#                               linear = its fused linear cross-entropy), +compile adds
#                               --compile (torch.compile; a failure says so in its row and the
#                               run goes on eagerly), +expandable adds
#                               --alloc-conf expandable_segments:True
#   ours                        benchmarks/train_step.py --models MODEL --steps $STEPS [args],
#                               as the `train` part runs it (args after MODEL come last, so
#                               a --steps there wins)
# Env: FLA_BEST_RUNS (default "fused linear linear+expandable linear+compile ours": the compiled
#      run last among FLA's, where its compile time can only cut itself; to alternate, e.g.
#      "linear ours linear ours" or "fused linear linear fused ours"),
#      STEPS (30) and WARMUP (3): FLA's timed and warm-up steps (STEPS also ours),
#      FLA_BEST_BUDGET (s, default 555 from the script's start: a run that would start with
#      < 30 s left is skipped with a note; each timeout is cut to what is left),
#      FLA_S (180: the limit of an FLA run; the first one compiles FLA's Triton kernels),
#      FLA_COMPILE_S (300: the limit of a +compile run), OURS_S (300: the limit of `ours`),
#      OURS_RESERVE (s kept back for each `ours` still to come; 0.1b 120, 1.5b 180).
# $OUT gets fla_best.jsonl (a "gpu" row with the allocator variables of the environment, every
# run's JSON rows tagged "run" and "run_index", then one "run-status" row per run: rc, seconds
# and, on failure, its error line), fla_best.log (all output), fla_best_table.md (the table
# printed at the end), fla_best_clocks.csv (nvidia-smi clocks / power every 500 ms) and
# fla_autotune_<gpu>.tgz (the autotuning results afterwards, as the `train` part saves them).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_throughput.sh"   # OUT, peer, save_peer_tuning
source "$(dirname "${BASH_SOURCE[0]}")/device_budget.sh"       # budgeted
model=${1:?usage: $0 0.1b|1.5b [train_step.py args]}; shift
case $model in 0.1b) reserve_default=120 ;; 1.5b) reserve_default=180 ;;
  *) echo "device_fla_best.sh: MODEL is 0.1b or 1.5b, not $model" >&2; exit 2 ;; esac
RUNS=${FLA_BEST_RUNS:-"fused linear linear+expandable linear+compile ours"}
BUDGET=${FLA_BEST_BUDGET:-555}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-3}
OURS_RESERVE=${OURS_RESERVE:-$reserve_default}
RES=$OUT/fla_best.jsonl; LOG=$OUT/fla_best.log
: >"$RES"; : >"$LOG"
T0=$SECONDS

# record NAME INDEX RC SECONDS LOGFILE: the log's JSON rows tagged with the run, then its status
record() {
  python3 - "$@" <<'PY' | tee -a "$RES" | grep -E '"case": "(run-status|compile-failed)"'
import json, re, sys
name, index, rc, secs, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
lines = [l.rstrip("\n") for l in open(log, errors="replace")]
rows = []
for line in lines:
    if line.startswith("{"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
            print(json.dumps({"run": name, "run_index": index, **row}))
status = {"case": "run-status", "run": name, "run_index": index, "rc": rc, "seconds": secs}
results = [r for r in rows if "step_ms" in r]
failed = [r for r in rows if "error" in r and "case" not in r]   # train_step.py's failed case
if rc == 0 and results and not failed:
    status["ok"] = True
else:
    status["ok"] = False
    if failed:
        pick = str(failed[-1]["error"])
    else:
        text = [l.strip() for l in lines if l.strip() and not l.startswith("{")]
        errs = [l for l in text if re.search(r"Error|error|Exception|Traceback|Killed|No such", l)]
        pick = (errs or text or ["(no output)"])[-1]
    status["error"] = ("timeout: " if rc in (124, 137) else "") + pick[:400]
broken = [r["error"] for r in rows if r.get("case") == "compile-failed"]
if broken:
    status["compile"] = broken[-1]
print(json.dumps(status), flush=True)
PY
}

# note NAME INDEX TEXT: the status of a run that did not start
note() {
  python3 -c 'import json, sys; print(json.dumps({"case": "run-status", "run": sys.argv[1],
    "run_index": int(sys.argv[2]), "rc": None, "ok": False, "error": sys.argv[3]}))' "$@" \
    | tee -a "$RES"
}

# one NAME INDEX TIMEOUT RESERVE CMD...: CMD under `timeout`, cut to the budget less RESERVE
one() {
  local name=$1 index=$2 tmo=$3 keep=$4; shift 4
  local f=/tmp/fla_best_$index.log
  echo "===== $index $name" | tee -a "$LOG"
  if ! budgeted "$f" "$tmo" "$keep" "$@"; then
    note "$name" "$index" "skipped: budget spent (${BUDGET_LEFT}s left, ${keep}s kept for ours)"
    return
  fi
  record "$name" "$index" "$BUDGET_RC" "$BUDGET_SECONDS" "$f"
}

# the fla_train.py arguments of CE[+expandable][+compile], in the array `fla_args`
fla_args_of() {
  local parts p
  IFS=+ read -ra parts <<<"$1"
  case ${parts[0]} in fused|linear) ;; *) return 1 ;; esac
  fla_args=(--ce "${parts[0]}")
  for p in "${parts[@]:1}"; do
    case $p in
      compile) fla_args+=(--compile) ;;
      expandable) fla_args+=(--alloc-conf expandable_segments:True) ;;
      *) return 1 ;;
    esac
  done
}

python3 - "$model" "$RUNS" >>"$RES" <<'PY'
import json, os, subprocess, sys
q = "name,memory.total,driver_version,clocks.max.sm"
try:
    gpu = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError as e:
    gpu = f"nvidia-smi failed: {e}"
env = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                                      "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                      "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")}
print(json.dumps({"case": "gpu", "model": sys.argv[1], "runs": sys.argv[2].split(),
                  "nvidia_smi": gpu, "env": env}))
PY
peer >>"$LOG" 2>&1            # FLA's wheels into /tmp/site, its autotuning restored
restored=false; grep -q "^restored" "$LOG" && restored=true
echo "{\"case\": \"autotune-restore\", \"file\": \".peer/fla_autotune_$(gpu_tag).tgz\", \"restored\": $restored}" \
  | tee -a "$RES"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv -lms 500 >"$OUT/fla_best_clocks.csv" 2>/dev/null &
clocks=$!

read -ra runs <<<"$RUNS"
for i in "${!runs[@]}"; do
  r=${runs[$i]}
  later=0   # `ours` runs after this one: the time kept back for them
  for r2 in "${runs[@]:$((i + 1))}"; do [ "$r2" = ours ] && later=$((later + 1)); done
  keep=$((later * OURS_RESERVE))
  if [ "$r" = ours ]; then
    one ours "$i" "${OURS_S:-300}" "$keep" python3 benchmarks/train_step.py --models "$model" \
      --out "$OUT/ours_train.jsonl" --steps "$STEPS" "$@"
  elif fla_args_of "$r"; then
    tmo=${FLA_S:-180}
    [[ $r == *compile* ]] && tmo=${FLA_COMPILE_S:-300}
    one "$r" "$i" "$tmo" "$keep" env PYTHONPATH=/tmp/site python3 -W ignore \
      benchmarks/peers/fla_train.py --models "$model" --modes amp --steps "$STEPS" \
      --warmup "$WARMUP" "${fla_args[@]}"
  else
    note "$r" "$i" "unknown run (known: ours, fused|linear[+expandable][+compile])"
  fi
done
kill "$clocks" 2>/dev/null
save_peer_tuning | tee -a "$LOG"
echo "done in $((SECONDS - T0))s" | tee -a "$LOG"

python3 - "$RES" <<'PY' | tee "$OUT/fla_best_table.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
status = [r for r in rows if r.get("case") == "run-status"]
result = {}
for r in rows:
    if "run_index" in r and "step_ms" in r:
        result[r["run_index"]] = r
def cell(x):   # a table cell: no '|' inside
    return str(x).replace("|", "/")
ours = [result[s["run_index"]] for s in status if s["run"] == "ours" and s["run_index"] in result]
ours_ms = ours[-1]["step_ms"] if ours else None
print("\n| # | run | step ms median (min-max) | steps | ktok/s | MFU % | peak GiB "
      "(reserved) | warm-up s | compile | allocator | median / ours | fastest / ours |")
print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|")
for s in status:
    i, r = s["run_index"], result.get(s["run_index"])
    if r is None:
        print(f"| {i} | {cell(s['run'])} | {cell(s.get('error', 'no result'))[:120]} | | | | | | | | | |")
        continue
    lo, hi = r.get("step_ms_min_max") or [None, None]
    n = r.get("steps") or len(r.get("step_ms_all", [])) or ""
    peak = f"{r.get('peak_gib')}" + (f" ({r['peak_reserved_gib']})" if "peak_reserved_gib" in r else "")
    warm = r.get("warmup_s", r.get("compile_s", ""))
    comp = r.get("compile", "")
    if comp is True:
        comp = f"yes ({r.get('compile_graphs', '?')} graphs, {r.get('compile_graph_breaks', '?')} breaks)"
    elif comp is False:
        comp = "no"
    alloc = ""
    if r.get("peer") == "fla":
        alloc = f"{r.get('alloc_conf') or 'default'}, expandable={r.get('expandable_segments')}"
    ratio = fast = ""
    if ours_ms and s["run"] != "ours":
        ratio = f"{r['step_ms'] / ours_ms:.3f}x"
        if lo is not None:
            fast = f"{lo / ours_ms:.3f}x"
    print(f"| {i} | {cell(s['run'])} | {r['step_ms']} ({lo}-{hi}) | {n} | {r.get('ktok_s')} | "
          f"{r.get('mfu_pct')} | {peak} | {warm} | {cell(comp)[:80]} | {cell(alloc)} | {ratio} | "
          f"{fast} |")
PY
