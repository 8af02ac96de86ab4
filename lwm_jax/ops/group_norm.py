"""The backward pass of RWKV-7's `ln_x` GroupNorm as one Pallas-Triton kernel.

`lwm_jax.layers.norms.group_norm_fused` wires it to the forward, which is `group_norm` itself
(XLA fuses it with its neighbours). The backward, for input `x` `[M, H, N]` (M = tokens, H
groups of N channels), cotangent `dy` of the same shape and per-channel `weight` `[H, N]`:

    xhat = (x - mean(x)) * rstd,   rstd = 1 / sqrt(var(x) + eps)       (per row and group)
    g    = dy * weight
    dx   = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy

One program per (block of R rows, group) reads `x` and `dy` once and writes `dx` plus its
block's partial `dweight` / `dbias` sums (float32, `[M / R, H, N]`; XLA adds them up, in a fixed
order: no atomics, so gradients are bitwise reproducible). Autodiff of the forward gave XLA
two passes for the same work on an H100 (a block-level Triton fusion for `dx` at ~1.0 TB/s
that recomputes the statistics, and a float32 `dy * xhat` product written out for the weight's
reduction); `benchmarks/RESULTS.md` (session 23) has the step numbers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_F32 = jnp.float32
MAX_VALUES = 4096      # values per program and input: 64 rows x 64 channels (32 a lane, 4 warps)


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
    """Whether `layers.norms.group_norm_fused` can run this backward on `x` of this shape."""
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
