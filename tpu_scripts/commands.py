"""The steps of each command, run (or printed, in a dry run) through a `Runner`.

`create`, `setup`, `launch`, `status`, `logs`, `stop` and `delete` are one short sequence of
gcloud calls each; `babysit` (babysit.py) strings them together. Inputs arrive checked and
typed from `cli.py`.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile

from tpu_scripts import gcloud, remote, source
from tpu_scripts.gcloud import Target
from tpu_scripts.quoting import clip
from tpu_scripts.runner import Runner
from tpu_scripts.slices import Slice

DEFAULT_PYTHON = "3.12"     # uv fetches it when the VM image's own python3 is older (3.10)
# A file name that may become part of a remote path (`gcloud ... scp LOCAL TPU:REMOTE`): scp
# hands the remote path to a shell or an sftp server on the worker, so only plain characters.
_REMOTE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


@dataclasses.dataclass(frozen=True)
class CreatePlan:
    """How to create the slice: accelerator, runtime version, pricing."""

    slice: Slice
    runtime_version: str
    spot: bool = False
    preemptible: bool = False
    reserved: bool = False


@dataclasses.dataclass(frozen=True)
class SetupPlan:
    """What to install: Python version, the commit to ship, GCS data prefixes to copy."""

    python: str = DEFAULT_PYTHON
    ref: str = "HEAD"
    data: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What to run: config file, overrides, job name, environment (LIBTPU_INIT_ARGS included)
    and, optionally, a compiled train step (`lwm-jax compile --save`) to load instead of
    compiling on the slice."""

    config: str
    job: str
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    compiled: str | None = None


def check_create(t: Target, plan: CreatePlan) -> None:
    if plan.spot and plan.preemptible:
        raise ValueError("--spot and --preemptible: choose one (spot has no 24 h limit)")
    if t.queued and plan.preemptible:
        raise ValueError("--preemptible: queued resources take --spot instead")


def check_python(version: str) -> str:
    if not re.fullmatch(r"3\.1[1-9]", version):
        raise ValueError(f"--python: {clip(version, 30)} is not a supported Python (3.11 or newer, "
                         "written like 3.12)")
    return version


def check_gcs_prefix(prefix: str, where: str) -> str:
    if not re.fullmatch(r"gs://[a-z0-9][-_.a-z0-9]{1,221}[a-z0-9](/[^\s*?\[\]]+)+", prefix):
        raise ValueError(f"{where}: {clip(prefix, 100)} is not a gs://BUCKET/PATH prefix")
    return prefix


def check_local_path(path: str, where: str) -> str:
    """`path`, handed to a local command (mkdir, gcloud scp): not empty, and not starting
    with '-', which the command would read as an option (gcloud scp has no `--` to stop
    option parsing); `./-name` names the same file safely."""
    if not path:
        raise ValueError(f"{where}: the path is empty; give a file or directory name")
    if path.startswith("-"):
        raise ValueError(f"{where}: {clip(path, 100)} starts with '-', which would be read as an "
                         f"option; write it as {clip('./' + path, 100)}")
    return path


def check_remote_name(path: str, where: str) -> str:
    """`path`, a local file copied to the workers as `<job dir>/<its base name>`: that base
    name goes into a remote path, so it must be plain letters, digits, '.', '_' and '-' (no
    space, quote, `;` or `$(...)` a remote shell could act on), and not `.` or `..`."""
    check_local_path(path, where)
    name = os.path.basename(path)
    if not _REMOTE_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"{where}: {clip(path, 100)}: its file name {clip(name, 60)} becomes a file "
                         "name on the workers; copy or rename it to letters, digits, '.', '_' "
                         "and '-' only")
    return path


def check_launch_files(config: str, compiled: str | None) -> None:
    """The files `launch` copies to the workers (`check_remote_name`); called before anything
    runs, since `babysit` creates and sets up a TPU before its first launch."""
    check_remote_name(config, "--config")
    if compiled is not None:
        check_remote_name(compiled, "--compiled")


def create(r: Runner, t: Target, plan: CreatePlan) -> None:
    check_create(t, plan)
    r.run(gcloud.create(t, plan.slice, runtime_version=plan.runtime_version, spot=plan.spot,
                        preemptible=plan.preemptible, reserved=plan.reserved))


def setup(r: Runner, t: Target, plan: SetupPlan) -> None:
    """Ship the commit `plan.ref` to every worker and install it with the `[tpu]` extra."""
    commit = source.resolve_commit(plan.ref)
    requirements = source.tpu_requirements()
    if plan.ref == "HEAD" and source.uncommitted_changes():
        r.note(f"tracked files have uncommitted edits; only commit {commit[:12]} is shipped")
    archive = source.archive_name(commit)
    local = os.path.join(tempfile.gettempdir(), archive)
    r.run(source.archive_command(commit, local))
    r.run(gcloud.scp_to(t, local, archive))
    r.run(gcloud.ssh(t, remote.setup_command(archive, plan.python, requirements)))
    for prefix in plan.data:
        r.run(gcloud.ssh(t, remote.data_command(prefix)))


def launch(r: Runner, t: Target, plan: LaunchPlan, run_dir: str) -> None:
    """Copy the config (and the compiled step, if any) into the job directory of every worker
    and start `lwm-jax train` there, detached."""
    check_launch_files(plan.config, plan.compiled)
    remote_config = _beside_config(plan, plan.config)
    r.run(gcloud.ssh(t, remote.prepare_job_command(plan.job, run_dir)))
    r.run(gcloud.scp_to(t, plan.config, remote_config))
    remote_compiled = None
    if plan.compiled is not None:
        remote_compiled = _beside_config(plan, plan.compiled)
        r.run(gcloud.scp_to(t, plan.compiled, remote_compiled))
    argv = remote.train_argv(remote_config, plan.overrides, dict(plan.env), remote_compiled)
    r.run(gcloud.ssh(t, remote.start_command(plan.job, argv)))


def _beside_config(plan: LaunchPlan, local: str) -> str:
    """Where the local file `local` goes on the workers: `<job dir>/<its base name>`."""
    return f"{remote.job_dir(plan.job)}/{os.path.basename(local)}"


def status(r: Runner, t: Target, job: str | None) -> None:
    r.run(gcloud.describe(t), check=False)
    if job is not None:
        r.run(gcloud.ssh(t, remote.status_command(job)), check=False)


def logs(r: Runner, t: Target, job: str, *, worker: str, lines: int, metrics: bool,
         follow: bool, output_dir: str | None) -> None:
    if output_dir is not None:
        check_local_path(output_dir, "--output-dir")
    if follow:
        if not worker.isdigit():
            raise ValueError(f"--follow: follows one worker; give --worker N, not {clip(worker, 20)}")
        r.run(gcloud.ssh(t, remote.follow_command(job), worker=worker), check=False)
        return
    if output_dir is not None:
        r.run(["mkdir", "-p", "--", output_dir])
    command = remote.tail_command(job, "metrics" if metrics else "log", lines)
    r.run(gcloud.ssh(t, command, worker=worker, output_directory=output_dir))


def stop(r: Runner, t: Target, job: str, grace_s: int) -> None:
    r.run(gcloud.ssh(t, remote.stop_command(job, grace_s)))


def delete(r: Runner, t: Target) -> None:
    r.run(gcloud.delete(t))
