"""Compile the train step once, ahead of the first step, and refuse a step that cannot fit.

`check_memory` (train/config.py) refuses before anything is built when the weights, gradients
and Adam moments alone are too large. Activations depend on the batch, the context, the loss
chunk, remat and what XLA fuses, so only the compiled step knows them: here XLA's own memory
analysis of the compiled step (arguments + outputs - donated aliases + temporaries, bytes per
device) is compared with the memory of one accelerator, or with the host's available memory
for CPU devices, before the step first runs. A step that does not fit ends in one line naming
the keys that shrink it, not in RESOURCE_EXHAUSTED from the allocator after minutes of compile.
"""
from __future__ import annotations

from typing import Any

import jax

from lwm_jax.train.config import RunConfig, _gib, host_memory_available

# Headroom for what the analysis does not count (allocator fragmentation, cuBLAS/cuDNN
# workspaces, the input pipeline's device buffers).
_SLACK = 0.95


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
    devices (which share the host), the host's available memory over the local device count."""
    local = jax.local_devices()
    if local[0].platform != "cpu":
        try:
            limit = (local[0].memory_stats() or {}).get("bytes_limit")
        except Exception:
            limit = None
        return limit, f"memory of one {local[0].device_kind}"
    host = host_memory_available()
    if host is None:
        return None, "available host memory"
    return host // max(1, len(local)), "available host memory"


def check_step_fits(cfg: RunConfig, usage: dict[str, int] | None, have: int | None,
                    what: str) -> None:
    """Raise ValueError (one line, naming the keys to change) when `usage["peak"]` exceeds
    `_SLACK * have`. No-op when either side is unknown."""
    if usage is None or not have or usage["peak"] <= _SLACK * have:
        return
    t = cfg.train
    fixes = [f"lower train.batch_size (raise train.grad_accum to keep {t.batch_size} sequences "
             "per step)", "lower train.ctx_len"]
    if not cfg.runtime.remat:
        fixes.append("set runtime.remat=true")
    elif cfg.runtime.remat_policy != "full":
        fixes.append("set runtime.remat_policy=full")
    if t.loss_chunk == 0 or t.loss_chunk > 1024:
        fixes.append("set train.loss_chunk=1024")
    raise ValueError(
        f"train.batch_size={t.batch_size}, train.ctx_len={t.ctx_len}: the compiled train step "
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
