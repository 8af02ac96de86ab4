"""Compile the train step once, ahead of the first step, and refuse a step that cannot fit.

`check_memory` refuses before anything is built when the weights, gradients and Adam moments
alone are too large. Activations depend on the batch, the context, the loss
chunk, remat and what XLA fuses, so only the compiled step knows them: here XLA's own memory
analysis of the compiled step (arguments + outputs - donated aliases + temporaries, bytes per
device) is compared with the memory of one accelerator, or with the host's available memory
for CPU devices, before the step first runs. The trainer compiles from the state's shapes and
shardings, before initialising or restoring it (`compile_step` takes arrays or
`jax.ShapeDtypeStruct`s). A step that does not fit ends in one line naming
the keys that shrink it, not in RESOURCE_EXHAUSTED from the allocator after minutes of compile.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from lwm_jax.precision import parse_policy
from lwm_jax.train.config import RunConfig, mesh_shape

# Headroom for what the analysis does not count (allocator fragmentation, cuBLAS/cuDNN
# workspaces, the input pipeline's device buffers).
FIT_SLACK = 0.95


def step_bytes(compiled) -> dict[str, int] | None:
    """XLA's memory analysis of a compiled program, bytes per device; None if not reported.

    Keys: "arguments", "outputs", "aliased" (outputs written in donated arguments), "temp",
    "peak" (= arguments + outputs - aliased + temp).
    """
    try:
        mem = compiled.memory_analysis()
    except Exception:                 # not every backend implements it: no check, not a failure
        return None
    if mem is None:
        return None
    out = {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
           "aliased": int(getattr(mem, "alias_size_in_bytes", 0) or 0),
           "temp": int(mem.temp_size_in_bytes)}
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
    return out


def device_memory() -> tuple[int | None, str]:
    """`(bytes one step may use, what that is)`: one accelerator's `bytes_limit`, or, for CPU
    devices (which share the host), the host's available memory over the local device count.

    On a GPU, JAX's allocator takes 75% of the memory unless `XLA_PYTHON_CLIENT_MEM_FRACTION`
    says otherwise; when that default is in force the description says so and how to raise it
    (an 80 GB H100 is then a 59.4 GiB device)."""
    local = jax.local_devices()
    if local[0].platform != "cpu":
        try:
            limit = (local[0].memory_stats() or {}).get("bytes_limit")
        except Exception:
            limit = None
        what = f"memory of one {local[0].device_kind}"
        if local[0].platform == "gpu" and _default_gpu_fraction():
            what += (" (JAX's default 75% of it: set XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 "
                     "before starting to give it more)")
        return limit, what
    host = host_memory_available()
    if host is None:
        return None, "available host memory"
    return host // max(1, len(local)), "available host memory"


def _default_gpu_fraction() -> bool:
    """True when JAX's GPU allocator runs with its default memory fraction (0.75): no
    `XLA_PYTHON_CLIENT_MEM_FRACTION` and not the `platform` allocator (which has no cap).
    Turning preallocation off keeps the cap; it only stops taking it all at start."""
    env = os.environ
    return ("XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
            and env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() != "platform")


def check_step_fits(cfg: RunConfig, usage: dict[str, int] | None, have: int | None,
                    what: str, step: str = "train step",
                    sizes: dict[str, int] | None = None) -> None:
    """Raise ValueError (one line, naming the keys to change) when `usage["peak"]` exceeds
    `FIT_SLACK * have`. No-op when either side is unknown. `step` names the program ("train
    step", "eval step"); `sizes`: the resolved mesh, when known (a replicated state then
    suggests moving devices to `mesh.fsdp`)."""
    if usage is None or not have or usage["peak"] <= FIT_SLACK * have:
        return
    t = cfg.train
    fixes = [f"lower train.batch_size (raise train.grad_accum to keep {t.batch_size} sequences "
             "per step)", "lower train.ctx_len"]
    rt = cfg.runtime
    if not rt.remat:
        fixes.append("set runtime.remat=true")
    else:
        if not all(rt.rematerialized(l) for l in range(cfg.model.n_layer)):
            fixes.append(f"raise runtime.remat_layers={rt.remat_layers} (-1: every block)")
        if rt.remat_policy != "full":
            fixes.append("set runtime.remat_policy=full")
    if t.loss_chunk == 0 or t.loss_chunk > 1024:
        fixes.append("set train.loss_chunk=1024")
    if sizes is not None and sizes.get("data", 1) > 1:
        fixes.append("move devices from mesh.data to mesh.fsdp (the state split over more "
                     "of them)")
    raise ValueError(
        f"train.batch_size={t.batch_size}, train.ctx_len={t.ctx_len}: the compiled {step} "
        f"needs ~{_gib(usage['peak'])} per device (XLA's memory analysis: "
        f"{_gib(usage['arguments'])} state and batch, {_gib(usage['temp'])} activations and "
        f"other temporaries), more than the {_gib(have)} of {what}; " + ", or ".join(fixes))


def compile_step(cfg: RunConfig, train_step, state, tokens, *,
                 memory: tuple[int | None, str] | None = None) -> Any:
    """Compile `train_step` for these (sharded) arguments, check that it fits, and return the
    compiled executable (call it as `train_step`). `memory`: `(bytes, what)` to check against
    (default: `device_memory()`)."""
    compiled = train_step.lower(state, tokens).compile()
    have, what = memory if memory is not None else device_memory()
    check_step_fits(cfg, step_bytes(compiled), have, what)
    return compiled


def training_bytes(cfg: RunConfig) -> int:
    """A lower bound of the bytes the train state needs: per parameter, the weight and its
    gradient in the policy's parameter dtype plus two float32 Adam moments (activations and
    workspace are not counted). Pure arithmetic on the config; nothing is allocated."""
    itemsize = np.dtype(parse_policy(cfg.precision).param_dtype).itemsize
    return cfg.model.param_count() * (2 * itemsize + 8)


def host_memory_available() -> int | None:
    """Bytes of host memory a new allocation can use: `MemAvailable` from /proc/meminfo, capped
    by a cgroup (container) limit when one is set; None when the platform does not say."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
        if limit != "max":
            room = max(0, int(limit) - used)
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def _gib(n: float) -> str:
    return f"{n / 2**40:.2f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def check_memory(cfg: RunConfig, sizes: dict[str, int], *, device_bytes: int | None = None,
                 n_local_devices: int = 1, host_bytes: int | None = None) -> None:
    """Refuse, before anything is allocated, a run whose weights, gradients and Adam moments
    alone (`training_bytes`) cannot fit.

    `sizes`: the resolved mesh (`mesh_shape`); parameters are split over `fsdp * tensor`.
    `device_bytes`: memory of one accelerator (JAX's `bytes_limit`); None = CPU devices, which
    all share the host's `host_bytes` (default: `host_memory_available()`; None = no check).
    Raises ValueError (one line naming the model keys and both sizes).
    """
    need = training_bytes(cfg) / max(1, sizes.get("fsdp", 1) * sizes.get("tensor", 1))
    if device_bytes:
        have, what = device_bytes, "memory of one device"
    else:
        need *= max(1, n_local_devices)
        have = host_bytes if host_bytes is not None else host_memory_available()
        what = "available host memory"
    if have is None or need <= have:
        return
    m = cfg.model
    embed_share = 2 * m.vocab_size * m.n_embd / max(1, m.param_count())
    key = "model.vocab_size" if embed_share > 0.5 else "model.n_embd"
    raise ValueError(f"{key}: vocab_size={m.vocab_size}, n_embd={m.n_embd}, n_layer={m.n_layer} give "
                     f"{m.param_count():,} parameters whose weights, gradients and Adam moments "
                     f"alone need ~{_gib(need)}, more than the {_gib(have)} of {what}; lower "
                     f"{key} (or shard the model with mesh.fsdp over more devices)")


def check_memory_on_devices(cfg: RunConfig) -> None:
    """`check_memory` against the devices JAX sees (see `check_memory`)."""
    sizes = mesh_shape(cfg.mesh, jax.device_count())
    local = jax.local_devices()
    stats = None
    if local[0].platform != "cpu":
        try:
            stats = local[0].memory_stats()
        except Exception:               # not every backend reports memory: skip, not fail
            stats = None
    check_memory(cfg, sizes, device_bytes=(stats or {}).get("bytes_limit"),
                 n_local_devices=len(local))
