"""`babysit`: keep one training job alive on a (spot / preemptible / queued) TPU slice.

Every `interval_s` it asks gcloud for the slice's state and, when the slice is up, every
worker for the job's state (`worker.sh status`), and `decide`s:

| slice                                   | job (all workers)                 | action     |
|-----------------------------------------|-----------------------------------|------------|
| missing                                 | -                                 | recreate   |
| PREEMPTED, TERMINATED, STOPPED (node);  | -                                 | recreate   |
| SUSPENDED, SUSPENDING, FAILED (queued)  |                                   |            |
| being created, provisioned, repaired... | -                                 | wait       |
| READY (node) / ACTIVE (queued)          | running on every worker           | wait       |
|                                         | running but no log write for `stall_s` | restart |
|                                         | running on some workers only      | restart    |
|                                         | never started here                | setup + launch |
|                                         | exited 0 everywhere               | done       |
|                                         | exited 2 (bad input), 3 (diverged) or 130 (SIGINT) anywhere | give up |
|                                         | exited otherwise (crash, SIGTERM, OOM kill) | restart |
| a poll failed (network, ssh)            | -                                 | wait       |

recreate = delete (when it still exists) + create; the next polls see it come up and then set
it up and launch. restart = stop everywhere (SIGTERM, then SIGKILL after the grace period) +
launch. Every launch counts against `max_launches`. `lwm-jax train` resumes from the newest complete checkpoint in `checkpoint.dir`, which
must be a gs:// URL (checked before the first poll). With `--compiled`, every launch copies the
compiled step too (a recreated TPU starts with empty disks); it is checked before the first poll.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from tpu_scripts import commands, gcloud, remote
from tpu_scripts.gcloud import Target
from tpu_scripts.remote import WorkerJob
from tpu_scripts.runner import CommandFailed, Runner

WAIT, RECREATE, SETUP_LAUNCH, RESTART, DONE, GIVE_UP = (
    "wait", "recreate", "setup+launch", "restart", "done", "give up")
UP = {"READY", "ACTIVE"}
GONE = {"PREEMPTED", "TERMINATED", "STOPPED", "SUSPENDED", "SUSPENDING", "FAILED"}
FINAL_EXITS = {2: "bad input", 3: "diverged (non-finite)", 130: "stopped by SIGINT"}
MISSING = "MISSING"          # the describe call said NOT_FOUND
UNKNOWN = "UNKNOWN"          # the describe call failed otherwise


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str
    reason: str


def decide(tpu_state: str, jobs: list[WorkerJob] | None, hosts: int, stall_s: int) -> Decision:
    """The action for one poll. `tpu_state`: the describe answer, `MISSING` or `UNKNOWN`;
    `jobs`: the workers' status lines (None when not asked or the ssh failed); `hosts`: the
    workers the slice has; `stall_s`: seconds without a log write that count as a hang
    (0 = never)."""
    if tpu_state == MISSING:
        return Decision(RECREATE, "the TPU does not exist")
    if tpu_state in GONE:
        return Decision(RECREATE, f"the TPU is {tpu_state}")
    if tpu_state not in UP:
        return Decision(WAIT, f"the TPU is {tpu_state}")
    if jobs is None or len(jobs) < hosts:
        got = "no" if jobs is None else f"{len(jobs)} of {hosts}"
        return Decision(WAIT, f"TPU {tpu_state}; {got} workers answered the job probe")
    running = [j for j in jobs if j.state == "running"]
    if running and len(running) < len(jobs):
        return Decision(RESTART, f"the job runs on {len(running)} of {len(jobs)} workers")
    if running:
        quiet = max(j.value or 0 for j in running)
        if stall_s and quiet > stall_s:
            return Decision(RESTART, f"no log output for {quiet} s (> {stall_s} s)")
        return Decision(WAIT, "running")
    if all(j.state == "none" for j in jobs):
        return Decision(SETUP_LAUNCH, f"TPU {tpu_state}, job not started")
    exits = {j.value for j in jobs if j.state == "exited"}
    for status, why in FINAL_EXITS.items():
        if status in exits:
            return Decision(GIVE_UP, f"the job exited {status} ({why}); see `logs`")
    if exits == {0} and all(j.state == "exited" for j in jobs):
        return Decision(DONE, "the job finished (exit 0 on every worker)")
    return Decision(RESTART, f"the job exited with {sorted(x for x in exits if x is not None)}")


def tpu_state(r: Runner, t: Target) -> str | None:
    """The slice's state word, `MISSING`, `UNKNOWN`, or None in a dry run."""
    probe = r.probe(gcloud.describe_state(t), timeout=120)
    if probe is None:
        return None
    if probe.returncode != 0:
        text = probe.stderr + probe.stdout
        return MISSING if ("NOT_FOUND" in text or "not found" in text) else UNKNOWN
    return probe.stdout.strip().upper() or UNKNOWN


def job_states(r: Runner, t: Target, job: str) -> list[WorkerJob] | None:
    probe = r.probe(gcloud.ssh(t, remote.status_command(job)), timeout=300)
    if probe is None or probe.returncode != 0:
        return None
    return remote.parse_status(probe.stdout)


@dataclasses.dataclass(frozen=True)
class BabysitPlan:
    create: commands.CreatePlan
    setup: commands.SetupPlan
    launch: commands.LaunchPlan
    run_dir: str
    interval_s: int = 120
    max_launches: int = 20
    stall_s: int = 3600
    grace_s: int = 600
    max_failures: int = 10          # consecutive failed recovery commands before giving up


def print_plan(r: Runner, t: Target, plan: BabysitPlan) -> None:
    """Dry run: every command babysit may run, grouped by the situation that runs it."""
    r.note(f"every {plan.interval_s} s: the slice's state, then (when it is up) the job's")
    tpu_state(r, t)
    job_states(r, t, plan.launch.job)
    r.note("slice missing, preempted, suspended or failed: recreate it")
    r.run(gcloud.delete(t))
    commands.create(r, t, plan.create)
    r.note("slice up, job not started: set up every worker and launch")
    _setup_and_launch(r, t, plan)
    r.note(f"job crashed, stalled or partial: stop it everywhere (SIGKILL after "
           f"{plan.grace_s} s) and launch again ({plan.max_launches} launches at most)")
    commands.stop(r, t, plan.launch.job, plan.grace_s)
    commands.launch(r, t, plan.launch, plan.run_dir)


def _setup_and_launch(r: Runner, t: Target, plan: BabysitPlan) -> None:
    commands.setup(r, t, plan.setup)
    commands.launch(r, t, plan.launch, plan.run_dir)


def babysit(r: Runner, t: Target, plan: BabysitPlan, *, sleep: Callable[[float], None] = time.sleep,
            clock: Callable[[], float] = time.time, max_polls: int | None = None) -> int:
    """Poll and act until the job is done (returns 0) or cannot continue (returns 1)."""
    if r.dry_run:
        print_plan(r, t, plan)
        return 0
    launches = failures = polls = 0
    while max_polls is None or polls < max_polls:
        polls += 1
        state = tpu_state(r, t) or UNKNOWN
        jobs = job_states(r, t, plan.launch.job) if state in UP else None
        d = decide(state, jobs, plan.create.slice.hosts, plan.stall_s)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(clock()))
        r.note(f"{stamp} babysit {t.name}: {d.reason} -> {d.action}")
        if d.action == DONE:
            return 0
        if d.action == GIVE_UP:
            return 1
        if d.action in (RESTART, SETUP_LAUNCH) and launches >= plan.max_launches:
            r.note(f"giving up: {launches} launches already (--max-launches)")
            return 1
        try:
            if d.action == RECREATE:
                if state != MISSING:
                    r.run(gcloud.delete(t))
                commands.create(r, t, plan.create)
            elif d.action == SETUP_LAUNCH:
                launches += 1
                _setup_and_launch(r, t, plan)
            elif d.action == RESTART:
                launches += 1
                commands.stop(r, t, plan.launch.job, plan.grace_s)
                commands.launch(r, t, plan.launch, plan.run_dir)
            failures = 0
        except CommandFailed as err:
            failures += 1
            r.note(f"{err} ({failures} failure(s) in a row)")
            if failures >= plan.max_failures:
                r.note(f"giving up after {failures} failed recoveries in a row")
                return 1
        sleep(plan.interval_s)
    return 1
