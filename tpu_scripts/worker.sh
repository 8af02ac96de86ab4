#!/bin/sh
# tpu_scripts/worker.sh: runs ON each TPU VM worker. `python -m tpu_scripts setup` ships it
# with the source; the other commands call it through
# `gcloud compute tpus tpu-vm ssh --worker=all --command='sh lwm_jax/tpu_scripts/worker.sh ...'`.
#
# Every path is relative to $HOME, where those ssh commands start: the source in lwm_jax/, the
# virtual environment in lwm_venv/, and one directory per job, lwm_jobs/JOB/, holding
# train.log (appended by every start), train.pid, exit_status and run_dir (written by launch).
#
#   worker.sh setup ARCHIVE PYTHON REQUIREMENT...
#       unpack ARCHIVE (a `git archive` tarball) into lwm_jax/ and install it, with the
#       REQUIREMENTs, into lwm_venv/ (Python PYTHON, made by uv). Refused while a job runs;
#       a no-op when this archive and these requirements are already installed.
#   worker.sh start JOB_DIR COMMAND...
#       run COMMAND detached from the ssh session, output appended to JOB_DIR/train.log. On a
#       multi-host slice it exports LWM_COORDINATOR_ADDRESS, LWM_NUM_PROCESSES and
#       LWM_PROCESS_ID (lwm_jax/train/distributed.py) from the VM's metadata. Refused while the
#       job runs.
#   worker.sh status JOB_DIR
#       one line: "lwm-job HOST running SECONDS" (seconds since the log was last written),
#       "lwm-job HOST exited STATUS" or "lwm-job HOST none" (never started here).
#   worker.sh stop JOB_DIR GRACE_SECONDS
#       SIGTERM to the job (lwm-jax train checkpoints and exits 143); SIGKILL to its process
#       group if it still runs GRACE_SECONDS later.
#   worker.sh tail JOB_DIR log|metrics LINES
#       the last LINES of train.log (each line's latest progress-bar state) or of the run's
#       metrics.jsonl, every line prefixed with [HOST].
#   worker.sh follow JOB_DIR
#       tail -f of train.log.
#   worker.sh endpoints ENDPOINTS WORKER_ID
#       print the LWM_* variables `start` would export for this metadata (a test hook).
set -eu

COORDINATOR_PORT=8482      # the port JAX's own Cloud TPU cluster detection uses
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$HOME"

die() {
    echo "worker.sh: $*" >&2
    exit 2
}

running() {  # JOB_DIR: true while the job's wrapper process is alive
    [ -f "$1/train.pid" ] && kill -0 "$(cat "$1/train.pid")" 2>/dev/null
}

metadata() {  # KEY: a TPU VM metadata attribute (fails off Google Cloud)
    curl -fsS --max-time 10 -H 'Metadata-Flavor: Google' \
        "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}

set_launch_vars() {  # ENDPOINTS WORKER_ID: export LWM_* when ENDPOINTS names > 1 worker
    case $2 in
        '' | *[!0-9]*) die "agent-worker-number: expected a number, got '$2'" ;;
    esac
    n=0
    first=
    set -f
    old_ifs=$IFS
    IFS=,
    for entry in $1; do
        if [ -n "$entry" ]; then
            n=$((n + 1))
            [ -n "$first" ] || first=$entry
        fi
    done
    IFS=$old_ifs
    set +f
    [ "$n" -gt 1 ] || return 0
    case $first in
        *:*:*) host=${first##*:} ;; # the older format, name:id:ip
        *) host=$first ;;
    esac
    LWM_COORDINATOR_ADDRESS=$host:$COORDINATOR_PORT
    LWM_NUM_PROCESSES=$n
    LWM_PROCESS_ID=$2
    export LWM_COORDINATOR_ADDRESS LWM_NUM_PROCESSES LWM_PROCESS_ID
}

setup() {
    [ $# -ge 3 ] || die "usage: setup ARCHIVE PYTHON REQUIREMENT..."
    archive=$1
    python=$2
    shift 2
    for dir in lwm_jobs/*; do
        if [ -d "$dir" ] && running "$dir"; then
            die "job $dir is running on $(hostname); stop it before setup"
        fi
    done
    stamp="$archive $python $*"
    if [ -f lwm_venv/.lwm_setup ] && [ "$(cat lwm_venv/.lwm_setup)" = "$stamp" ]; then
        echo "lwm-setup $(hostname) already installed: $archive"
        return 0
    fi
    rm -rf lwm_jax.new
    mkdir lwm_jax.new
    tar -xzf "$archive" -C lwm_jax.new
    rm -rf lwm_jax
    mv lwm_jax.new lwm_jax
    uv=$(command -v uv || echo "$HOME/.local/bin/uv")
    if [ ! -x "$uv" ]; then
        python3 -m pip install --user --quiet uv ||
            python3 -m pip install --user --quiet --break-system-packages uv
    fi
    [ -x lwm_venv/bin/python ] || "$uv" venv --python "$python" lwm_venv
    "$uv" pip install --python lwm_venv/bin/python "$@" -e lwm_jax
    echo "$stamp" >lwm_venv/.lwm_setup
    lwm_venv/bin/python -c 'import importlib.metadata as m, socket
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "missing"
print("lwm-setup", socket.gethostname(), "jax", version("jax"), "libtpu", version("libtpu"))'
}

start() {
    [ $# -ge 2 ] || die "usage: start JOB_DIR COMMAND..."
    job=$1
    shift
    mkdir -p "$job"
    if running "$job"; then
        die "job $job is already running on $(hostname) (pid $(cat "$job/train.pid"))"
    fi
    if [ -z "${LWM_COORDINATOR_ADDRESS:-}" ] && endpoints=$(metadata worker-network-endpoints 2>/dev/null) &&
        id=$(metadata agent-worker-number 2>/dev/null); then
        set_launch_vars "$endpoints" "$id"
    fi
    rm -f "$job/exit_status"
    nohup setsid sh "$SELF" _run "$job" "$@" >>"$job/train.log" 2>&1 </dev/null &
    echo $! >"$job/train.pid"
    echo "lwm-job $(hostname) started pid $!"
}

run_job() {  # JOB_DIR COMMAND...: the detached wrapper; forwards SIGTERM, records the status
    job=$1
    shift
    echo "=== lwm-job start $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname): $*"
    "$@" &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM
    status=0
    wait "$child" || status=$?
    while kill -0 "$child" 2>/dev/null; do # a signal interrupted the wait: wait again
        status=0
        wait "$child" || status=$?
    done
    echo "$status" >"$job/exit_status"
    echo "=== lwm-job exit $status $(date -u +%Y-%m-%dT%H:%M:%SZ)"
}

status() {
    [ $# -eq 1 ] || die "usage: status JOB_DIR"
    host=$(hostname)
    if running "$1"; then
        now=$(date +%s)
        written=$(stat -c %Y "$1/train.log" 2>/dev/null || echo "$now")
        echo "lwm-job $host running $((now - written))"
    elif [ -f "$1/exit_status" ]; then
        echo "lwm-job $host exited $(cat "$1/exit_status")"
    else
        echo "lwm-job $host none"
    fi
}

stop() {
    [ $# -eq 2 ] || die "usage: stop JOB_DIR GRACE_SECONDS"
    case $2 in
        '' | *[!0-9]*) die "stop: GRACE_SECONDS must be a number, got '$2'" ;;
    esac
    if ! running "$1"; then
        echo "lwm-job $(hostname) not running"
        return 0
    fi
    pid=$(cat "$1/train.pid")
    kill -TERM "$pid"
    waited=0
    while running "$1" && [ "$waited" -lt "$2" ]; do
        sleep 1
        waited=$((waited + 1))
    done
    if running "$1"; then
        kill -KILL -- "-$pid" 2>/dev/null || true
        echo "lwm-job $(hostname) killed after ${2}s"
    else
        echo "lwm-job $(hostname) stopped"
    fi
}

tail_job() {
    [ $# -eq 3 ] || die "usage: tail JOB_DIR log|metrics LINES"
    case $3 in
        '' | *[!0-9]*) die "tail: LINES must be a number, got '$3'" ;;
    esac
    case $2 in
        log) file=$1/train.log ;;
        metrics) file=$(cat "$1/run_dir" 2>/dev/null || echo "$1/no-run-dir")/metrics.jsonl ;;
        *) die "tail: expected log or metrics, got '$2'" ;;
    esac
    host=$(hostname)
    if [ ! -f "$file" ]; then
        echo "[$host] (no $file here)"
        return 0
    fi
    # a progress bar rewrites its line with carriage returns: show each line's latest state
    tail -n "$3" "$file" | awk -F '\r' -v h="$host" '{
        s = ""
        for (i = NF; i >= 1; i--) if ($i != "") { s = $i; break }
        print "[" h "] " s
    }'
}

command=${1:-}
[ $# -gt 0 ] && shift
case $command in
    setup) setup "$@" ;;
    start) start "$@" ;;
    _run) run_job "$@" ;;
    status) status "$@" ;;
    stop) stop "$@" ;;
    tail) tail_job "$@" ;;
    follow)
        [ $# -eq 1 ] || die "usage: follow JOB_DIR"
        tail -n 20 -f "$1/train.log"
        ;;
    endpoints)
        [ $# -eq 2 ] || die "usage: endpoints ENDPOINTS WORKER_ID"
        set_launch_vars "$1" "$2"
        echo "LWM_COORDINATOR_ADDRESS=${LWM_COORDINATOR_ADDRESS:-} LWM_NUM_PROCESSES=${LWM_NUM_PROCESSES:-} LWM_PROCESS_ID=${LWM_PROCESS_ID:-}"
        ;;
    *) die "unknown command '$command'; one of setup, start, status, stop, tail, follow, endpoints" ;;
esac
