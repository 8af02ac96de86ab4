# Sourced by the device scripts that run several commands in one call under one time budget
# (tools/device_peers.sh, tools/device_fla_best.sh). Needs BUDGET (s), T0 (the script's start,
# $SECONDS) and LOG (the call's combined log) set by the caller.
#
# budgeted FILE TIMEOUT RESERVE CMD...: run CMD under `timeout -k 10`, its timeout cut to what
#   is left of the budget less RESERVE seconds; its output in FILE, appended to LOG. Sets
#   BUDGET_RC (CMD's exit status) and BUDGET_SECONDS (its run time) and returns 0; returns 1
#   without running it, BUDGET_LEFT set, when fewer than 30 s would be left for it.
budgeted() {
  local file=$1 tmo=$2 keep=$3; shift 3
  BUDGET_LEFT=$((BUDGET - (SECONDS - T0)))
  local left=$((BUDGET_LEFT - keep))
  [ "$left" -lt 30 ] && return 1
  [ "$tmo" -gt "$left" ] && tmo=$left
  local t1=$SECONDS
  echo "===== (timeout ${tmo}s, at $((SECONDS - T0))s): $*" | tee -a "$LOG"
  timeout -k 10 "$tmo" "$@" >"$file" 2>&1
  BUDGET_RC=$?
  BUDGET_SECONDS=$((SECONDS - t1))
  cat "$file" >>"$LOG"
  return 0
}
