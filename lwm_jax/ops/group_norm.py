"""Per-group GroupNorm with float32 statistics (RWKV-7's `ln_x`): the op `group_norm` and its
forms.

`group_norm(x, weight, bias, *, n_groups, eps, out_dtype, impl, platform, mesh)` runs:

    "xla"                  `group_norm_xla`: plain JAX, autodiff for the backward
    "pallas" / "interpret" `group_norm_fused`: the same forward (bit for bit; XLA fuses it with
                           its neighbours) and the Pallas-Triton backward below
                           (`jax.custom_vjp`; "interpret": in the Pallas interpreter)
    "auto"                 the kernel on one GPU when the shape fits it (`kernel_applies`);
                           on a mesh "pallas" runs it per device (`kernel_choice`)

(`impl` is `Runtime.ln_x_impl` in RWKV-7's TimeMix; the rule is `kernel_choice.kernel_chosen`.)
Statistics are float32 whatever the input dtype, as in `lwm_jax.ops.layer_norm`.

The backward, for input `x` `[M, H, N]` (M = tokens, H groups of N channels), cotangent `dy`
of the same shape and per-channel `weight` `[H, N]`:

    xhat = (x - mean(x)) * rstd,   rstd = 1 / sqrt(var(x) + eps)       (per row and group)
    g    = dy * weight
    dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy

One program per (block of R rows, group) reads `x` and `dy` once and writes `dx` plus its
block's partial `dweight` / `dbias` sums (float32, `[M / R, H, N]`; XLA adds them up, in a fixed
order: no atomics, so gradients are bitwise reproducible). Autodiff of the forward gave XLA
two passes for the same work on an H100 (a block-level Triton fusion for `dx` that recomputes
the statistics, and a float32 `dy * xhat` product written out for the weight's reduction);
`benchmarks/RESULTS.md` ("`ln_x`'s GroupNorm backward as one Pallas kernel") has the numbers.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lwm_jax.ops.kernel_choice import (auto_pays_on, kernel_chosen, on_each_device,
                                        per_device_tokens)

_F32 = jnp.float32
MAX_VALUES = 4096      # values per program and input: 64 rows x 64 channels (32 a lane, 4 warps)


def group_norm(x, weight, bias, *, n_groups: int, eps: float, out_dtype: Any = None,
               impl: str = "xla", platform: str | None = None, mesh=None):
    """GroupNorm over contiguous channel groups of the last axis, float32 statistics.

    RWKV-7's `ln_x`: `n_groups = H` heads, each of `N = C / H` channels, `eps = N * 1e-5`.

    Args:
      x: `[..., C]` any float dtype (C divisible by `n_groups`).
      weight, bias: `[C]` per-channel affine, applied in float32.
      out_dtype: dtype of the result (default: `x.dtype`).
      impl: "xla" (default), "pallas", "interpret" or "auto" (see the module docstring).
      platform: "cpu" | "gpu" | "tpu", the platform the program is compiled for (None: JAX's
        default devices'; read by "auto" only).
      mesh: the device mesh x (`[B, T, C]` there) is split over as the activations are (None:
        one device). "auto" and "pallas" run the kernel per device when the mesh splits
        tokens only ("auto" not under FSDP, `kernel_choice.auto_pays_on`; on a mesh that splits
        more "auto" keeps XLA's backward and "pallas" is an error).
    Returns:
      `[..., C]` in `out_dtype`. Gradients come back in each input's dtype.
    """
    M = per_device_tokens(mesh, x.shape)
    if kernel_chosen("ln_x_impl", impl, per_device=M is not None, platform=platform,
                     fits=M is not None and kernel_applies((M, x.shape[-1]), n_groups),
                     pays=auto_pays_on(mesh),
                     kernel="the Pallas GroupNorm backward",
                     needs=f"tokens a multiple of 8 and a head size a power of two >= 16 "
                           f"(got {x.shape} in {n_groups} groups)"):
        out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
        interpret = impl == "interpret"
        return on_each_device(
            lambda x, w, b: group_norm_fused(x, w, b, n_groups, eps, out_dtype, interpret), mesh,
            x, weight, bias)
    return group_norm_xla(x, weight, bias, n_groups=n_groups, eps=eps, out_dtype=out_dtype)


def group_norm_xla(x, weight, bias, *, n_groups: int, eps: float, out_dtype: Any = None):
    """The XLA form of `group_norm`: x `[..., C]`, weight / bias `[C]`; `[..., C]` in
    `out_dtype` (default x's). Float32 statistics; autodiff gives the backward."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    C = x.shape[-1]
    if C % n_groups:
        raise ValueError(f"group_norm: channels {C} not divisible by n_groups={n_groups}")
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], n_groups, C // n_groups)
    mean = jnp.mean(xg, axis=-1, keepdims=True)
    centred = xg - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    y = (centred * jax.lax.rsqrt(var + eps)).reshape(x.shape)
    y = y * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def group_norm_fused(x, weight, bias, n_groups: int, eps: float, out_dtype, interpret: bool):
    """`group_norm_xla(x, weight, bias, n_groups=, eps=, out_dtype=)` (same forward, bit for
    bit) whose backward is `group_norm_bwd_pallas` (`interpret`: in the Pallas interpreter, for
    tests). x `[..., C]` with `kernel_applies(x.shape, n_groups)`; weight, bias `[C]`.
    Gradients come back in each input's dtype."""
    return group_norm_xla(x, weight, bias, n_groups=n_groups, eps=eps, out_dtype=out_dtype)


def _fused_forward(x, weight, bias, n_groups, eps, out_dtype, interpret):
    y = group_norm_xla(x, weight, bias, n_groups=n_groups, eps=eps, out_dtype=out_dtype)
    return y, (x, weight, np.zeros((0,), bias.dtype))


def _fused_backward(n_groups, eps, out_dtype, interpret, res, dy):
    x, weight, bias_proto = res
    C = x.shape[-1]
    N = C // n_groups
    groups = lambda a: a.reshape(-1, n_groups, N)      # noqa: E731
    dx, dw, db = group_norm_bwd_pallas(groups(x), groups(dy), weight.reshape(n_groups, N),
                                       eps=eps, interpret=interpret)
    return (dx.reshape(x.shape), dw.reshape(C).astype(weight.dtype),
            db.reshape(C).astype(bias_proto.dtype))


group_norm_fused.defvjp(_fused_forward, _fused_backward)


def rows_per_program(M: int, N: int) -> int | None:
    """The largest power of two R <= max(8, MAX_VALUES / N) dividing M (at least 8), or None:
    the kernel then does not apply (`kernel_applies`). N must be a power of two (a Triton block
    dimension)."""
    if N < 16 or N & (N - 1):
        return None
    r = max(8, MAX_VALUES // N)
    while r >= 8:
        if M % r == 0:
            return r
        r //= 2
    return None


def kernel_applies(x_shape: tuple[int, ...], n_groups: int) -> bool:
    """Whether `group_norm_fused` can run this backward on `x` of this shape."""
    C = x_shape[-1]
    M = int(np.prod(x_shape[:-1]))
    return C % n_groups == 0 and rows_per_program(M, C // n_groups) is not None


def _bwd_kernel(x_ref, dy_ref, w_ref, dx_ref, dw_ref, db_ref, *, eps: float):
    """One block of rows of one group: x_ref, dy_ref `[R, N]`, w_ref `[N]`; writes dx_ref
    `[R, N]` and the block's partial sums dw_ref, db_ref `[N]` (float32)."""
    x = x_ref[...].astype(_F32)
    dy = dy_ref[...].astype(_F32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    rstd = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    xhat = centred * rstd
    g = dy * w_ref[...].astype(_F32)[None, :]
    mean_g = jnp.mean(g, axis=-1, keepdims=True)
    mean_gx = jnp.mean(g * xhat, axis=-1, keepdims=True)
    dx_ref[...] = (rstd * (g - mean_g - xhat * mean_gx)).astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(dy * xhat, axis=0)
    db_ref[...] = jnp.sum(dy, axis=0)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps", "rows"))
def group_norm_bwd_pallas(x_MHN, dy_MHN, weight_HN, *, eps: float, interpret: bool = False,
                          num_warps: int = 4, rows: int | None = None):
    """The GroupNorm backward above as one Pallas-Triton launch.

    Args:
      x_MHN: `[M, H, N]` the forward's input (any float dtype; dx is returned in it).
      dy_MHN: `[M, H, N]` cotangent of the output (any float dtype).
      weight_HN: `[H, N]` per-channel scale.
      eps: the forward's epsilon. `num_warps`, `rows` (R, default `rows_per_program`): tuning.
    Returns:
      `(dx_MHN, dweight_HN, dbias_HN)`: dx in x's dtype, the two sums float32.
    """
    M, H, N = x_MHN.shape
    rows = rows or rows_per_program(M, N)
    if rows is None or M % rows:
        raise ValueError(f"group_norm_bwd_pallas: {M} rows of groups of {N} channels do not "
                         "fit the kernel's blocks (kernel_applies); use the XLA GroupNorm")
    G = M // rows
    tile = pl.BlockSpec((rows, pl.squeezed, N), lambda i, h: (i, h, 0))
    per_group = pl.BlockSpec((pl.squeezed, N), lambda i, h: (h, 0))
    partial = pl.BlockSpec((pl.squeezed, pl.squeezed, N), lambda i, h: (i, h, 0))
    dx, dw, db = pl.pallas_call(
        functools.partial(_bwd_kernel, eps=float(eps)), grid=(G, H),
        in_specs=[tile, tile, per_group], out_specs=[tile, partial, partial],
        out_shape=[jax.ShapeDtypeStruct((M, H, N), x_MHN.dtype),
                   jax.ShapeDtypeStruct((G, H, N), _F32), jax.ShapeDtypeStruct((G, H, N), _F32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="group_norm_bwd",
    )(x_MHN, dy_MHN, weight_HN)
    return dx, jnp.sum(dw, axis=0), jnp.sum(db, axis=0)
