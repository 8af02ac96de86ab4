"""What runs on the workers: the shell command strings handed to `gcloud ... ssh --command`,
and the parsing of what `worker.sh status` prints back.

Every string is built from `shlex.quote`d words, so a config path, an override value or a
flag with spaces reaches the worker as exactly one argument. Paths are relative to the remote
home directory (see `worker.sh`).
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Sequence

SOURCE_DIR = "lwm_jax"
VENV_DIR = "lwm_venv"
JOBS_DIR = "lwm_jobs"
DATA_DIR = "data"
SETUP_DIR = "lwm_setup"
WORKER_SH = f"{SOURCE_DIR}/tpu_scripts/worker.sh"
LWM_JAX = f"{VENV_DIR}/bin/lwm-jax"


def _words(*words: str) -> str:
    return " ".join(shlex.quote(w) for w in words)


def job_dir(job: str) -> str:
    return f"{JOBS_DIR}/{job}"


def setup_command(archive: str, python: str, requirements: Sequence[str]) -> str:
    """Unpack worker.sh from the uploaded `archive`, then let it install everything."""
    script = f"{SETUP_DIR}/tpu_scripts/worker.sh"
    return " && ".join([
        _words("mkdir", "-p", SETUP_DIR),
        _words("tar", "-xzf", archive, "-C", SETUP_DIR, "tpu_scripts/worker.sh"),
        _words("sh", script, "setup", archive, python, *requirements),
    ])


def data_command(gcs_prefix: str) -> str:
    """Copy a binidx pair (and its tokenizer record) `gcs_prefix.*` into ~/data/."""
    return " && ".join([_words("mkdir", "-p", DATA_DIR),
                        _words("gcloud", "storage", "cp", f"{gcs_prefix}.*", f"{DATA_DIR}/")])


def prepare_job_command(job: str, run_dir: str) -> str:
    """Create the job directory and record the run dir (for `logs --metrics`)."""
    d = job_dir(job)
    return " && ".join([_words("mkdir", "-p", d),
                        f"printf '%s\\n' {shlex.quote(run_dir)} > {shlex.quote(d + '/run_dir')}"])


def train_argv(config_remote: str, overrides: Sequence[str], env: dict[str, str],
               compiled_remote: str | None = None) -> list[str]:
    """`env K=V ... lwm_venv/bin/lwm-jax train --config CONFIG [--compiled STEP] OVERRIDE...`
    as a word list (`compiled_remote`: a step saved by `lwm-jax compile --save`)."""
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    compiled = ["--compiled", compiled_remote] if compiled_remote is not None else []
    return [*prefix, LWM_JAX, "train", "--config", config_remote, *compiled, *overrides]


def start_command(job: str, argv: Sequence[str]) -> str:
    return _words("sh", WORKER_SH, "start", job_dir(job), *argv)


def status_command(job: str) -> str:
    return _words("sh", WORKER_SH, "status", job_dir(job))


def stop_command(job: str, grace_s: int) -> str:
    return _words("sh", WORKER_SH, "stop", job_dir(job), str(grace_s))


def tail_command(job: str, what: str, lines: int) -> str:
    return _words("sh", WORKER_SH, "tail", job_dir(job), what, str(lines))


def follow_command(job: str) -> str:
    return _words("sh", WORKER_SH, "follow", job_dir(job))


# ------------------------------------------------------------------------------ job status
@dataclasses.dataclass(frozen=True)
class WorkerJob:
    """One worker's `worker.sh status` line. `state`: "running" (`value` = seconds since the
    log was written), "exited" (`value` = exit status) or "none"."""

    host: str
    state: str
    value: int | None = None


def parse_status(text: str) -> list[WorkerJob]:
    """The `lwm-job HOST STATE [N]` lines of `text` (other output, e.g. ssh notices, ignored)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[0] != "lwm-job":
            continue
        host, state = parts[1], parts[2]
        if state in ("running", "exited") and len(parts) == 4 and parts[3].lstrip("-").isdigit():
            out.append(WorkerJob(host, state, int(parts[3])))
        elif state == "none" and len(parts) == 3:
            out.append(WorkerJob(host, state))
    return out
