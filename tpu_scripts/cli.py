"""`python -m tpu_scripts COMMAND TPU [options]`: argparse definitions and dispatch.

Every command takes the TPU's name, `--project` (default: $CLOUDSDK_CORE_PROJECT), `--zone`
(default: $CLOUDSDK_COMPUTE_ZONE), `--queued` (the TPU is the node of a queued resource of the
same name) and `--dry-run` (print the commands, shell-quoted, and run nothing). Bad input is
one line on stderr and exit status 2; a failed gcloud call exit status 1. `launch` and
`babysit` share their options (`_add_launch`), `--compiled PATH` included: a train step saved
by `lwm-jax compile --save`, checked (checks.py) before anything runs, even in a dry run.
A local path starting with '-' is refused (mkdir or gcloud would read it as an option), and so
is a config or compiled step whose file name is not plain `[A-Za-z0-9._-]`: it becomes a file
name in scp's remote path on the workers (`commands.check_remote_name`).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Mapping, Sequence

from tpu_scripts import babysit, commands
from tpu_scripts.checks import check_launch
from tpu_scripts.flags import DEFAULT_FLAGS_FILE, libtpu_init_args, read_flags
from tpu_scripts.gcloud import Target
from tpu_scripts.quoting import clip
from tpu_scripts.runner import CommandFailed, Runner
from tpu_scripts.slices import check_project, check_tpu_name, check_zone, parse_accelerator_type

PROG = "python -m tpu_scripts"
_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_ENV = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_WORKER = re.compile(r"^(all|[0-9]+([-,][0-9]+)*)$")


def _one_line(text: object, limit: int = 600) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class Parser(argparse.ArgumentParser):
    """Usage errors on one line, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {clip(text, 20)}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser(environ: Mapping[str, str] = os.environ) -> Parser:
    p = Parser(prog=PROG, description="Create, set up, launch, watch, babysit and delete "
               "Cloud TPU runs of lwm-jax train (see docs/tpu.md).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("name", metavar="TPU", help="TPU name (the queued resource's too)")
    common.add_argument("--project", default=environ.get("CLOUDSDK_CORE_PROJECT"),
                        help="Google Cloud project (default: $CLOUDSDK_CORE_PROJECT)")
    common.add_argument("--zone", default=environ.get("CLOUDSDK_COMPUTE_ZONE"),
                        help="zone, e.g. us-central2-b (default: $CLOUDSDK_COMPUTE_ZONE)")
    common.add_argument("--queued", action="store_true",
                        help="the TPU is the node of a queued resource of the same name")
    common.add_argument("--dry-run", action="store_true",
                        help="print the commands (shell-quoted) and run nothing")

    def command(name: str, help: str) -> Parser:
        return sub.add_parser(name, parents=[common], help=help, description=help)

    _add_create(command("create", "create the TPU slice (a queued resource with --queued)"),
                with_slice=True)
    _add_setup(command("setup", "install jax[tpu] (pins from pyproject.toml) and this "
                                "package on every worker"))
    launch = command("launch", "start lwm-jax train on every worker, detached")
    _add_launch(launch)
    launch.add_argument("--accelerator-type", metavar="TYPE",
                        help="the slice's type (e.g. v4-32): checks the config's mesh, "
                             "checkpoint.dir and --compiled step against it before launching")
    status = command("status", "describe the TPU; with --job, the job's state per worker")
    status.add_argument("--job", help="job name (default: none, TPU only)")
    logs = command("logs", "print the end of the job's log (or metrics) per worker")
    logs.add_argument("--job", required=True, help="job name (the config file's stem)")
    logs.add_argument("--worker", default="0", help="0, 3, 1,4, 0-3 or all (default 0)")
    logs.add_argument("--lines", type=_positive, default=50, help="lines per worker (50)")
    logs.add_argument("--metrics", action="store_true",
                      help="metrics.jsonl of the run dir (worker 0) instead of the log")
    logs.add_argument("--follow", action="store_true", help="tail -f one worker's log")
    logs.add_argument("--output-dir", help="write each worker's lines to DIR/<worker>.log")
    stop = command("stop", "SIGTERM the job on every worker (it checkpoints, then exits)")
    stop.add_argument("--job", required=True, help="job name (the config file's stem)")
    stop.add_argument("--grace", type=_positive, default=600,
                      help="seconds before SIGKILL if it has not exited (600)")
    command("delete", "delete the TPU (and its queued resource with --queued)")
    sit = command("babysit", "keep the job running: recreate, set up and relaunch after "
                             "preemptions and crashes")
    _add_create(sit, with_slice=True)
    _add_setup(sit)
    _add_launch(sit)
    sit.add_argument("--interval", type=_positive, default=120, help="seconds between polls")
    sit.add_argument("--max-launches", type=_positive, default=20,
                     help="launches before giving up (20)")
    sit.add_argument("--stall-minutes", type=_positive, default=60,
                     help="restart a job whose log is silent this long (60; 0 = never)")
    sit.add_argument("--grace", type=_positive, default=600,
                     help="seconds a restart waits for SIGTERM before SIGKILL (600)")
    return p


def _add_create(p: Parser, *, with_slice: bool) -> None:
    p.add_argument("--accelerator-type", required=with_slice, metavar="TYPE",
                   help="v4-32, v5p-128, v5litepod-16, v6e-8, ...")
    p.add_argument("--runtime-version", help="TPU software version (default: the one for the "
                                             "generation, e.g. tpu-ubuntu2204-base for v4)")
    p.add_argument("--spot", action="store_true", help="spot capacity (can be preempted)")
    p.add_argument("--preemptible", action="store_true", help="preemptible (direct create only)")
    p.add_argument("--reserved", action="store_true", help="use the project's reservation")


def _add_setup(p: Parser) -> None:
    p.add_argument("--python", default=commands.DEFAULT_PYTHON,
                   help=f"Python version of the workers' venv ({commands.DEFAULT_PYTHON})")
    p.add_argument("--ref", default="HEAD", help="git commit to ship (HEAD)")
    p.add_argument("--data", action="append", default=[], metavar="GS_PREFIX",
                   help="copy GS_PREFIX.* (a binidx pair) into ~/data/ on every worker")


def _add_launch(p: Parser) -> None:
    p.add_argument("--config", required=True, help="run config YAML (copied to the workers)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for lwm-jax train, e.g. checkpoint.dir=gs://b/run")
    p.add_argument("--job", help="job name (default: the config file's stem)")
    p.add_argument("--flags-file", default=DEFAULT_FLAGS_FILE,
                   help="libtpu flags for LIBTPU_INIT_ARGS (tpu_scripts/libtpu_flags.txt)")
    p.add_argument("--no-libtpu-flags", action="store_true", help="set no LIBTPU_INIT_ARGS")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for lwm-jax train on every worker")
    p.add_argument("--compiled", metavar="PATH",
                   help="a train step saved by `lwm-jax compile --topology TYPE --save PATH`: "
                        "checked against the config (and --accelerator-type) first, copied "
                        "beside the config and loaded by lwm-jax train instead of compiling")


# ---------------------------------------------------------------------------- from arguments
def _target(args: argparse.Namespace) -> Target:
    return Target(check_tpu_name(args.name), check_project(args.project), check_zone(args.zone),
                  args.queued)


def _create_plan(args: argparse.Namespace) -> commands.CreatePlan:
    s = parse_accelerator_type(args.accelerator_type)
    return commands.CreatePlan(s, args.runtime_version or s.runtime_version, args.spot,
                               args.preemptible, args.reserved)


def _setup_plan(args: argparse.Namespace) -> commands.SetupPlan:
    data = tuple(commands.check_gcs_prefix(d, "--data") for d in args.data)
    return commands.SetupPlan(commands.check_python(args.python), args.ref, data)


def _job(args: argparse.Namespace) -> str:
    job = args.job or os.path.splitext(os.path.basename(args.config or ""))[0]
    if not _JOB.match(job):
        raise ValueError(f"--job: {clip(job, 60)} is not a job name; use letters, digits, '.', "
                         "'_' and '-'")
    return job


def _launch_plan(args: argparse.Namespace) -> commands.LaunchPlan:
    commands.check_launch_files(args.config, args.compiled)   # before --job reads the name
    env: dict[str, str] = {}
    if not args.no_libtpu_flags:
        env["LIBTPU_INIT_ARGS"] = libtpu_init_args(read_flags(args.flags_file))
    for item in args.env:
        m = _ENV.match(item)
        if not m:
            raise ValueError(f"--env: {clip(item, 60)} is not NAME=VALUE")
        if m.group(1) == "LIBTPU_INIT_ARGS":
            raise ValueError("--env LIBTPU_INIT_ARGS: put libtpu flags in a flags file "
                             "(--flags-file) instead")
        env[m.group(1)] = m.group(2)
    for item in args.overrides:
        if "=" not in item:
            raise ValueError(f"--set: {clip(item, 60)} is not KEY=VALUE (e.g. train.lr=3e-4)")
    if args.compiled is not None and (os.path.basename(args.compiled)
                                      == os.path.basename(args.config)):
        raise ValueError(f"--compiled: {clip(args.compiled, 100)} has the config's file name and "
                         "both go to the job directory; rename one of them")
    return commands.LaunchPlan(args.config, _job(args), tuple(args.overrides),
                               tuple(env.items()), args.compiled)


def dispatch(args: argparse.Namespace, r: Runner) -> int:
    t = _target(args)
    c = args.command
    if c == "create":
        commands.create(r, t, _create_plan(args))
    elif c == "setup":
        commands.setup(r, t, _setup_plan(args))
    elif c == "launch":
        plan = _launch_plan(args)
        s = parse_accelerator_type(args.accelerator_type) if args.accelerator_type else None
        info = check_launch(plan.config, plan.overrides, s, compiled=plan.compiled)
        commands.launch(r, t, plan, info.run_dir)
    elif c == "status":
        commands.status(r, t, _job(args) if args.job else None)
    elif c == "logs":
        if not _WORKER.match(args.worker):
            raise ValueError(f"--worker: {clip(args.worker, 20)} is not all, N, N,M or N-M")
        commands.logs(r, t, _job(args), worker=args.worker, lines=args.lines,
                      metrics=args.metrics, follow=args.follow, output_dir=args.output_dir)
    elif c == "stop":
        commands.stop(r, t, _job(args), args.grace)
    elif c == "delete":
        commands.delete(r, t)
    elif c == "babysit":
        create, setup, launch = _create_plan(args), _setup_plan(args), _launch_plan(args)
        commands.check_create(t, create)
        info = check_launch(launch.config, launch.overrides, create.slice,
                            survive_preemption=True, compiled=launch.compiled)
        plan = babysit.BabysitPlan(create, setup, launch, info.run_dir, args.interval,
                                   args.max_launches, args.stall_minutes * 60, args.grace)
        return babysit.babysit(r, t, plan)
    return 0


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] = os.environ,
         runner: Runner | None = None) -> int:
    """Parse, run, and turn errors into one line and an exit status (2 bad input, 1 failed)."""
    args = build_parser(environ).parse_args(argv)
    r = runner or Runner(dry_run=args.dry_run)
    try:
        return dispatch(args, r)
    except (ValueError, CommandFailed) as err:
        print(f"{PROG} {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2 if isinstance(err, ValueError) else 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
