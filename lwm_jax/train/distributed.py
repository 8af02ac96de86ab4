"""Multi-process start-up: `jax.distributed.initialize` when the launch asks for it.

A multi-host run starts one `lwm-jax train` per host (per GPU process, per TPU worker), all with
the same config and the same run directory on a shared filesystem. Which launch is which:

- explicit, any cluster: every process gets `LWM_COORDINATOR_ADDRESS=host:port` (process 0's
  host, a free port), `LWM_NUM_PROCESSES=N` and its own `LWM_PROCESS_ID=i` (0 <= i < N);
- detected by JAX itself (`jax.distributed.initialize()` with no arguments): Cloud TPU pod
  slices (`TPU_WORKER_HOSTNAMES` names more than one worker, as on GKE; or a TPU VM made with
  `gcloud compute tpus`, whose workers JAX reads from the VM's metadata server), SLURM job
  steps started by `srun` with more than one task (`SLURM_NTASKS`), Open MPI's `mpirun`
  (`OMPI_COMM_WORLD_SIZE`);
- anything else: one process, nothing initialised.

What the trainer then does per process (`lwm_jax.train.trainer`): every process builds the same
program, reads only its rows of each global batch, computes, and writes its own shards of each
checkpoint (orbax coordinates the commit); process 0 alone takes the run-dir lock and writes
`config.yaml`, `metrics.jsonl`, TensorBoard events, the progress bar and the loss plot.

On CPU devices, cross-process collectives need gloo (`jax_cpu_collectives_implementation`),
which `initialize_from_env` selects before initialising.
"""
from __future__ import annotations

import os
from typing import Mapping

ENV_ADDRESS = "LWM_COORDINATOR_ADDRESS"
ENV_COUNT = "LWM_NUM_PROCESSES"
ENV_ID = "LWM_PROCESS_ID"


def launch_from_env(environ: Mapping[str, str] = os.environ) -> dict | None:
    """The `jax.distributed.initialize` keyword arguments this launch asks for: `{}` for JAX's
    own cluster detection, a dict of `coordinator_address` / `num_processes` / `process_id` for
    the explicit variables, None for a single process. ValueError (one line, naming the
    variable) for a partial or malformed explicit setting."""
    given = {k: environ.get(k) for k in (ENV_ADDRESS, ENV_COUNT, ENV_ID)}
    if any(v not in (None, "") for v in given.values()):
        missing = [k for k, v in given.items() if v in (None, "")]
        if missing:
            present = ", ".join(k for k in given if k not in missing)
            raise ValueError(f"{missing[0]}: not set while {present} is; a multi-process "
                             f"launch sets {ENV_ADDRESS}, {ENV_COUNT} and {ENV_ID} on every "
                             "process")
        address = given[ENV_ADDRESS]
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{ENV_ADDRESS}: expected host:port, got {address[:80]!r}")
        count, pid = _int(ENV_COUNT, given[ENV_COUNT]), _int(ENV_ID, given[ENV_ID])
        if count < 1:
            raise ValueError(f"{ENV_COUNT}: must be >= 1, got {count}")
        if not 0 <= pid < count:
            raise ValueError(f"{ENV_ID}: must be in [0, {ENV_COUNT}={count}), got {pid}")
        return {"coordinator_address": address, "num_processes": count, "process_id": pid}
    hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return {}
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        value = environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return {}
    return None


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value[:40]!r}") from None


def initialize_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Initialise JAX's distributed runtime when the launch asks for it (see the module
    docstring); returns whether it did. Call before anything touches a JAX device."""
    kwargs = launch_from_env(environ)
    if kwargs is None and not _on_cloud_tpu_vm_slice():
        return False
    import jax

    kwargs = kwargs or {}

    platforms = (environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").lower()
    if platforms.split(",")[0].strip() == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True


def _on_cloud_tpu_vm_slice() -> bool:
    """True on a Cloud TPU VM (GCE) worker: JAX's own cluster detection (its TPU start-up
    code, then the metadata server's worker number) finds one. Such VMs set no environment
    variable naming their workers, so `launch_from_env` cannot see them; a single-host VM
    initialises a one-process runtime, which is harmless."""
    try:                         # importing jax runs its Cloud TPU start-up detection
        from jax._src import cloud_tpu_init
        from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster
    except ImportError:          # a JAX without these modules: no detection, one process
        return False
    return bool(cloud_tpu_init.running_in_cloud_tpu_vm) and GceTpuCluster.is_env_present()


def is_primary() -> bool:
    """True on the process that writes run-level files (process 0; the only one when single)."""
    import jax

    return jax.process_index() == 0
