"""The rule the Pallas-kernel ops share for their `impl=` argument.

`layer_norm`, `group_norm` and `squared_relu_mlp` each take `impl` in `IMPLS`, the values of
the `Runtime` knobs that the models pass them (`norm_impl`, `ln_x_impl`, `ffn_impl`), and
call `kernel_chosen` with their own fit test; its errors name the knob to change. Imports
only `lwm_jax.hardware` (the platform a program is compiled for).
"""
from __future__ import annotations

from lwm_jax.hardware import platform_of

IMPLS = ("auto", "xla", "pallas", "interpret")     # = lwm_jax.runtime.KERNEL_IMPLS


def kernel_chosen(field: str, impl: str, *, one_device: bool, platform: str | None, fits: bool,
                  kernel: str, needs: str, pays: bool = True) -> bool:
    """Whether the kernel runs for `impl` (one of `IMPLS`). "xla": never; "auto": on one GPU
    when it `fits` and `pays` (where it measured faster than XLA's form); "pallas" /
    "interpret": always, and a one-line ValueError naming `runtime.<field>` on a device mesh
    (the kernels have no sharding rule) or when it does not fit (`needs`: what it takes).

    `platform`: "cpu" | "gpu" | "tpu", the platform the program is compiled for (None: JAX's
    default devices', read only for "auto"). `kernel` names the kernel in the errors; an
    `impl` outside `IMPLS` is a one-line ValueError."""
    if impl not in IMPLS:
        raise ValueError(f"{kernel}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return False
    if impl == "auto":
        return fits and pays and one_device and (platform or platform_of()) == "gpu"
    if not one_device:
        raise ValueError(f"runtime.{field}={impl!r}: {kernel} runs on one device (it has no "
                         "sharding rule); on a device mesh use auto or xla")
    if not fits:
        raise ValueError(f"runtime.{field}={impl!r}: {kernel} needs {needs}; "
                         f"set runtime.{field}=xla")
    return True
