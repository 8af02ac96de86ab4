"""The gcloud command lines, built as argument lists (never shell strings) from checked values.

Every builder is a pure function: same arguments, same list. `Target` names one TPU (a plain
TPU VM, or the node of a queued resource of the same name) and where it lives.

ssh / scp always pass `--strict-host-key-checking=no`: a TPU recreated under the same name (by
`babysit` after a preemption) has new host keys, and an unattended recovery must not stop at
the "host key changed" prompt. gcloud keeps these keys in its own known-hosts file.
"""
from __future__ import annotations

import dataclasses

from tpu_scripts.slices import Slice

GCLOUD = "gcloud"


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU: `name` (also the queued resource's name when `queued`), project and zone."""

    name: str
    project: str
    zone: str
    queued: bool = False

    def where(self) -> list[str]:
        return [f"--project={self.project}", f"--zone={self.zone}"]


def create(t: Target, s: Slice, *, runtime_version: str, spot: bool = False,
           preemptible: bool = False, reserved: bool = False) -> list[str]:
    """Create the slice: a queued resource (waits for capacity, then provisions the node
    `t.name`) or a TPU VM directly (fails at once when the zone has no capacity)."""
    if t.queued:
        argv = [GCLOUD, "compute", "tpus", "queued-resources", "create", t.name, *t.where(),
                f"--node-id={t.name}", f"--accelerator-type={s.accelerator_type}",
                f"--runtime-version={runtime_version}"]
    else:
        argv = [GCLOUD, "compute", "tpus", "tpu-vm", "create", t.name, *t.where(),
                f"--accelerator-type={s.accelerator_type}", f"--version={runtime_version}"]
    if spot:
        argv.append("--spot")
    if preemptible:
        argv.append("--preemptible")
    if reserved:
        argv.append("--reserved")
    return argv


def describe_state(t: Target) -> list[str]:
    """Print one word: the node's state (READY, PREEMPTED, ...) or, for a queued resource,
    the queued resource's state (ACTIVE, SUSPENDED, ...)."""
    if t.queued:
        return [GCLOUD, "compute", "tpus", "queued-resources", "describe", t.name, *t.where(),
                "--format=value(state.state)"]
    return [GCLOUD, "compute", "tpus", "tpu-vm", "describe", t.name, *t.where(),
            "--format=value(state)"]


def describe(t: Target) -> list[str]:
    """The whole description (YAML), for `status`."""
    kind = "queued-resources" if t.queued else "tpu-vm"
    return [GCLOUD, "compute", "tpus", kind, "describe", t.name, *t.where()]


def delete(t: Target) -> list[str]:
    """Delete without a prompt; a queued resource with `--force` (its node goes too)."""
    if t.queued:
        return [GCLOUD, "compute", "tpus", "queued-resources", "delete", t.name, *t.where(),
                "--force", "--quiet"]
    return [GCLOUD, "compute", "tpus", "tpu-vm", "delete", t.name, *t.where(), "--quiet"]


def ssh(t: Target, command: str, *, worker: str = "all",
        output_directory: str | None = None) -> list[str]:
    """Run the shell `command` on `worker` ("all", "0", "1,3", "0-3"), concurrently on each;
    with `output_directory`, each worker's output goes to `<dir>/<worker id>.log`."""
    argv = [GCLOUD, "compute", "tpus", "tpu-vm", "ssh", t.name, *t.where(), f"--worker={worker}",
            "--strict-host-key-checking=no", f"--command={command}"]
    if output_directory is not None:
        argv.append(f"--output-directory={output_directory}")
    return argv


def scp_to(t: Target, local: str, remote: str, *, worker: str = "all") -> list[str]:
    """Copy the local file `local` to `remote` (relative to the home directory) on `worker`."""
    return [GCLOUD, "compute", "tpus", "tpu-vm", "scp", local, f"{t.name}:{remote}", *t.where(),
            f"--worker={worker}", "--strict-host-key-checking=no"]
