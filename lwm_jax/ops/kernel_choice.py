"""The rule the Pallas-kernel ops share for their `impl=` argument, and how a kernel runs on a
device mesh.

`layer_norm`, `group_norm` and `squared_relu_mlp` each take `impl` in `IMPLS`, the values of
the `Runtime` knobs that the models pass them (`norm_impl`, `ln_x_impl`, `ffn_impl`), and
call `kernel_chosen` with their own fit test; its errors name the knob to change.

On a device mesh the kernels (which have no sharding rule of their own) run per device:
`on_each_device` wraps them in `shard_map` over the activations' layout (`lwm_jax.mesh_axes`:
B over `data` and `fsdp`, T over `sequence`), the parameters whole on every device. Each device
then holds whole tokens, and these ops are per token, so the result is the one-device result;
the parameters' gradients are summed over the devices by `shard_map`'s transpose. A mesh that
splits anything else (`tensor`) or splits B or T unevenly cannot (`per_device_tokens` is None).
"auto" runs them per device on such a mesh as on one GPU when its parameters are whole on
every device (`auto_pays_on`: no `fsdp` split): in a data-parallel step on two GPUs the
per-device kernels measured faster than XLA's forms at both model sizes
(`tools/device_scaleout.sh kernels` is that A/B; figures in benchmarks/RESULTS.md). Under FSDP
the kernels would take gathered weights and return whole-size weight gradients, which has not
been measured, so "auto" keeps XLA's forms there ("pallas" still runs them). Imports only the
package's leaves.
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from lwm_jax.hardware import platform_of
from lwm_jax.mesh_axes import activation_spec, tokens_per_device

IMPLS = ("auto", "xla", "pallas", "interpret")     # = lwm_jax.runtime.KERNEL_IMPLS


def per_device_tokens(mesh, shape: tuple[int, ...]) -> int | None:
    """Tokens each device holds of an activation `[B, T, ...]` (or `[M, ...]` off a mesh) when
    the kernels can run per device on `mesh` (None: one device); None when they cannot."""
    if mesh is None or mesh.size == 1:
        n = 1
        for d in shape[:-1]:
            n *= d
        return n
    if len(shape) < 3:
        return None
    local = tokens_per_device(mesh, shape[0], shape[1])
    if local is None:
        return None
    n = local[0] * local[1]
    for d in shape[2:-1]:
        n *= d
    return n


def auto_pays_on(mesh) -> bool:
    """Whether "auto" may run a fused kernel per device on `mesh` (None: one device): one
    device, or a mesh whose parameters are whole on every device (no `fsdp` split). Timed on
    one GPU and on a data-parallel mesh (faster there); a `sequence` split gives each device
    the same per-token work with whole parameters, so it follows the data split (untimed);
    FSDP is unmeasured (module docstring)."""
    return mesh is None or dict(mesh.shape).get("fsdp", 1) == 1


def kernel_chosen(field: str, impl: str, *, per_device: bool, platform: str | None, fits: bool,
                  kernel: str, needs: str, pays: bool = True) -> bool:
    """Whether the kernel runs for `impl` (one of `IMPLS`). "xla": never; "auto": on GPUs,
    on one device or per device (`per_device`), when it `fits` and `pays` (where it measured
    faster than XLA's form); "pallas" /
    "interpret": always, and a one-line ValueError naming `runtime.<field>` when the devices do
    not each hold whole tokens (`per_device` False: a mesh with a `tensor` axis or an uneven
    split) or when it does not fit (`needs`: what it takes).

    `per_device`: one device, or a mesh that splits tokens only (`per_device_tokens` not None);
    `fits` is then judged on each device's share. `platform`: "cpu" | "gpu" | "tpu", the
    platform the program is compiled for (None: JAX's default devices', read only for
    "auto"). `kernel` names the kernel in the errors; an `impl` outside `IMPLS` is a one-line
    ValueError."""
    if impl not in IMPLS:
        raise ValueError(f"{kernel}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return False
    if impl == "auto":
        return fits and pays and per_device and (platform or platform_of()) == "gpu"
    if not per_device:
        raise ValueError(f"runtime.{field}={impl!r}: {kernel} runs per device only on a mesh "
                         "that splits the batch and sequence evenly (data, fsdp, sequence); "
                         "with a tensor axis or an uneven split use auto or xla")
    if not fits:
        raise ValueError(f"runtime.{field}={impl!r}: {kernel} needs {needs}; "
                         f"set runtime.{field}=xla")
    return True


def on_each_device(fn, mesh, x, *params):
    """`fn(x, *params)` with `x` `[B, T, ...]` split over `mesh` as the activations are and
    `params` whole on every device; the result `[B, T, ...]` split like `x`. `mesh` None or one
    device: `fn(x, *params)`. Call it only where `per_device_tokens` is not None."""
    if mesh is None or mesh.size == 1:
        return fn(x, *params)
    spec = activation_spec(x.ndim)
    # The kernels' outputs carry no varying-axes type, hence check_vma=False: the out spec
    # names every axis of size > 1 (per_device_tokens), so no output is claimed replicated.
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) + (P(),) * len(params),
                         out_specs=spec, check_vma=False)(x, *params)
