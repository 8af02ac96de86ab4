#!/usr/bin/env bash
# A/B of up to one variant per GPU at once, on a multi-GPU host (nvidia-h100-x4: four variants in
# the time of one). Each variant is its own `benchmarks/train_step.py` process on its own GPU;
# between rounds the variants move one GPU along, so each runs on ROUNDS different GPUs and a
# GPU's own speed does not pass for a variant's. Rows in $OUT/par_<round>_gpu<i>_<name>.jsonl.
#
#   bash tools/device_ab_parallel.sh MODEL ROUNDS VARIANT... -- [train_step.py args]
#
# VARIANT is NAME=TREE or NAME=TREE@XLA_FLAGS: TREE a directory holding a `lwm_jax` package
# (`.` for this tree; snapshot others under .peer/, which is carried, e.g.
#   mkdir -p .peer/t_x && git archive REV lwm_jax | tar -x -C .peer/t_x
# and patch that copy), XLA_FLAGS the flags its process gets (spaces allowed: quote the variant).
# The 2026-11-26 measurements (tree 5bbb32c) ran this rotation as one-off scripts before the tool existed; as the tool
# (benchmarks/RESULTS-log.md, 2026-11-26, 5bbb32c):
#   bash tools/device_ab_parallel.sh 0.1b 2 base=. norms=.peer/t_norms mixes=.peer/t_mixes \
#     nm=.peer/t_nm -- --steps 10
#   bash tools/device_ab_parallel.sh 0.1b 2 base=. "lt=.@--xla_gpu_enable_cublaslt=true" \
#     "notri=.@--xla_gpu_enable_triton_gemm=false" -- --steps 10
# Variants that share a host also share its CPUs: compiles overlap the others' timed steps.
# JAX's steps are enqueued ahead and did not move (the same tree on two GPUs, two rounds:
# within 0.3%); a PyTorch peer's host-bound steps did (FLA's 1.5B median 1321 ms beside three
# compiles, 322-332 ms alone), so peers are never timed this way.
set -uo pipefail
model=${1:?usage: $0 MODEL ROUNDS VARIANT... -- [train_step.py args]}
rounds=${2:?rounds}; shift 2
names=() trees=() flags=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  spec=$1; shift
  name=${spec%%=*} rest=${spec#*=}
  [ "$name" != "$spec" ] || { echo "variant '$spec': want NAME=TREE[@XLA_FLAGS]" >&2; exit 2; }
  tree=${rest%%@*}; fl=""; [ "$tree" != "$rest" ] && fl=${rest#*@}
  [ -d "$tree/lwm_jax" ] || { echo "variant '$name': no lwm_jax package under '$tree'" >&2; exit 2; }
  names+=("$name") trees+=("$(cd "$tree" && pwd)") flags+=("$fl")
done
[ "${1:-}" = -- ] && shift
OUT=${OUT:-/tmp/lwm-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
ngpu=$(nvidia-smi -L | wc -l)
n=${#names[@]}
[ "$n" -le "$ngpu" ] || { echo "$n variants but $ngpu GPUs" >&2; exit 2; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$SECONDS
for r in $(seq 0 $((rounds - 1))); do
  for j in $(seq 0 $((n - 1))); do
    v=$(( (j + n - r % n) % n ))      # round r: GPU j runs variant j - r (mod n)
    base="$OUT/par_${r}_gpu${j}_${names[$v]}"
    CUDA_VISIBLE_DEVICES=$j PYTHONPATH=${trees[$v]} XLA_FLAGS="${flags[$v]}" \
      timeout -k 10 "${PAR_TIMEOUT:-300}" python3 benchmarks/train_step.py --models "$model" \
      --out "$base.jsonl" "$@" > "$base.log" 2>&1 &
  done
  wait
  for f in "$OUT"/par_${r}_gpu*.log; do
    b=${f%.log}
    if [ -s "$b.jsonl" ]; then
      python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); print(sys.argv[2],
        *[r[k] for k in ('step_ms', 'step_ms_min_max', 'peak_gib', 'last_loss')] if 'step_ms' in r
        else ['failed:', r.get('error', r)])" "$b.jsonl" "${b##*/}"
    else
      echo "${b##*/} failed: $(tail -1 "$f" | cut -c1-300)"
    fi
  done
  echo "round $r done at $((SECONDS - t0)) s"
done
