"""LayerNorm over the last axis with float32 statistics: the op `layer_norm` and its forms.

`layer_norm(x, weight, bias, *, eps, out_dtype, impl, platform, mesh)` runs one of:

    "xla"                  `layer_norm_xla`: plain JAX, autodiff for the backward
    "pallas" / "interpret" `layer_norm_fused`: the Pallas-Triton kernels below, forward and
                           backward (`jax.custom_vjp`; "interpret": in the Pallas interpreter)
    "auto"                 the kernels on one GPU under a bf16 output when tokens and channels
                           tile (`kernel_applies`) and C >= `AUTO_MIN_CHANNELS`, else XLA's

(`impl` is `Runtime.norm_impl` in RWKV-7's blocks; the rule is `kernel_choice.kernel_chosen`;
on a device mesh "pallas" runs them per device, `kernel_choice.on_each_device`.)

Statistics are always float32: the input is upcast, the mean and the (two-pass) variance are
taken in float32, the weight and bias are applied in float32, and only the result is cast to
the output dtype. bf16 statistics break on inputs with a large mean and a small spread (e.g.
300 + 0.01·noise: bf16 cannot even represent the deviations).

The kernels take the activations *transposed*. XLA keeps RWKV-7's residual stream tokens-minor
(`[C, B, T]` in memory: its GEMMs write column-major outputs), so a LayerNorm's per-token
statistics are reductions down columns, which XLA runs as two passes forward (mean, then
variance) and several backward, each re-reading the stream; a row-major kernel made XLA flip
the whole step's layout (benchmarks/RESULTS.md). These kernels take `xt [C, M]` (M tokens),
the layout XLA already has, and give each program `BM` token columns and all C rows:

    forward:   mean, rstd of each column (float32, one pass: per-tile statistics merged by
               Chan et al.'s update), then yt = (xt - mean) * rstd * w + b
    backward:  xhat = (xt - mean) * rstd,  g = dyt * w
               dxt = rstd * (g - mean_c(g) - xhat * mean_c(g * xhat))
               dw = sum over tokens of dyt * xhat,  db = sum over tokens of dyt

Each pass walks the column block in `BC`-row tiles; the second pass of each kernel re-reads the
block (C x BM: 256 KiB at C = 2048 in bf16) from L2. The forward returns the float32 mean and
rstd for the backward (8 bytes a token). The weight and bias sums come back as per-program
partials `[M / BM, C]` that XLA adds in a fixed order (no atomics: bitwise reproducible).

In a train step the kernels pay only at large C: at narrow widths XLA fuses its LayerNorm into
the neighbouring passes (timings: benchmarks/RESULTS.md, "the block LayerNorms as Pallas
kernels over the transposed activations"). Hence `AUTO_MIN_CHANNELS` for "auto".
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
LN_EPS = 1e-5     # RWKV-7's LayerNorm epsilon
BM = 64           # token columns per program (one 128-byte line of a bf16 block row)
BC = 128          # channel rows per tile of a pass
NUM_WARPS, NUM_STAGES = 8, 3   # chosen from twelve launch shapes (benchmarks/RESULTS.md)
AUTO_MIN_CHANNELS = 2048       # narrowest C where the kernels measured faster in a train step


def layer_norm(x, weight, bias, *, eps: float = LN_EPS, out_dtype: Any = None,
               impl: str = "xla", platform: str | None = None, mesh=None):
    """LayerNorm over the last axis with float32 statistics, as `impl` says.

    Args:
      x: `[..., C]` any float dtype (`[B, T, C]` on a device mesh).
      weight, bias: `[C]` (any float dtype; applied in float32).
      eps: added to the variance (RWKV-7: 1e-5).
      out_dtype: dtype of the result (default: `x.dtype`).
      impl: "xla" (default), "pallas", "interpret" or "auto" (see the module docstring).
      platform: "cpu" | "gpu" | "tpu", the platform the program is compiled for (None: JAX's
        default devices'; read by "auto" only).
      mesh: the device mesh x is split over as the activations are (None: one device). "auto"
        and "pallas" run the kernels per device when the mesh splits tokens only ("auto"
        not under FSDP, `kernel_choice.auto_pays_on`; on a mesh that splits more "auto"
        keeps XLA's form and "pallas" is an error).
    Returns:
      `[..., C]` in `out_dtype`. Gradients come back in each input's dtype.
    """
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    C = x.shape[-1]
    M = per_device_tokens(mesh, x.shape)
    if kernel_chosen(
            "norm_impl", impl, per_device=M is not None, platform=platform,
            fits=out_dtype == jnp.bfloat16 and M is not None and kernel_applies(M, C),
            pays=C >= AUTO_MIN_CHANNELS and auto_pays_on(mesh), kernel="the Pallas LayerNorm",
            needs=f"a bf16 compute dtype and tokens x channels {M} x {C} in multiples of the "
                  "kernel's blocks (ops.layer_norm.kernel_applies)"):
        interpret = impl == "interpret"
        return on_each_device(
            lambda x, w, b: layer_norm_fused(x, w, b, eps, out_dtype, interpret), mesh, x, weight,
            bias)
    return layer_norm_xla(x, weight, bias, eps=eps, out_dtype=out_dtype)


def layer_norm_xla(x, weight, bias, *, eps: float = LN_EPS, out_dtype: Any = None):
    """The XLA form of `layer_norm`: x `[..., C]`, weight / bias `[C]`; `[..., C]` in
    `out_dtype` (default x's). Float32 statistics; autodiff gives the backward."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + eps)
    y = y * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def layer_norm_fused(x, weight, bias, eps: float, out_dtype, interpret: bool):
    """`layer_norm_xla(x, weight, bias, eps=, out_dtype=)` as the Pallas kernels below, forward
    and backward (`interpret`: in the Pallas interpreter, for tests). x `[..., C]` with
    `kernel_applies(tokens, C)`; weight, bias `[C]`. The kernels see x transposed,
    `[C, tokens]`: the layout XLA keeps the residual stream in, so the transposes cost nothing.
    Gradients come back in each input's dtype."""
    return _fused_forward(x, weight, bias, eps, out_dtype, interpret)[0]


def _fused_forward(x, weight, bias, eps, out_dtype, interpret):
    C = x.shape[-1]
    yt, mean, rstd = layer_norm_fwd_pallas(x.reshape(-1, C).T, weight, bias, eps=eps,
                                           out_dtype=jnp.dtype(out_dtype), interpret=interpret)
    return yt.T.reshape(x.shape), (x, weight, mean, rstd, np.zeros((0,), bias.dtype))


def _fused_backward(eps, out_dtype, interpret, res, dy):
    x, weight, mean, rstd, bias_proto = res
    C = x.shape[-1]
    dxt, dw, db = layer_norm_bwd_pallas(x.reshape(-1, C).T, dy.reshape(-1, C).T, weight, mean,
                                        rstd, interpret=interpret)
    return dxt.T.reshape(x.shape), dw.astype(weight.dtype), db.astype(bias_proto.dtype)


layer_norm_fused.defvjp(_fused_forward, _fused_backward)


def kernel_applies(M: int, C: int, bm: int = BM, bc: int = BC) -> bool:
    """Whether M tokens x C channels tile exactly by (`bm` tokens, `bc` channels)."""
    return M > 0 and M % bm == 0 and C > 0 and C % bc == 0


def _check(name: str, M: int, C: int, bm: int, bc: int):
    if not kernel_applies(M, C, bm, bc):
        raise ValueError(f"{name}: {M} tokens x {C} channels do not tile by ({bm} tokens, {bc} "
                         "channels); use the XLA LayerNorm (kernel_applies)")


def _column_stats(xt_ref, bc: int):
    """float32 `(mean [bm], sum of squared deviations [bm])` of the block's columns in one
    pass: each `[bc, bm]` tile's own mean and squared deviations (exact two-pass within the
    tile, which sits in registers) merged into the running pair by Chan et al.'s update."""
    C, bm = xt_ref.shape

    def merge(i, carry):
        mean, m2 = carry
        x = xt_ref[pl.ds(i * bc, bc), :].astype(_F32)
        t_mean = jnp.mean(x, axis=0)
        t_m2 = jnp.sum(jnp.square(x - t_mean[None, :]), axis=0)
        delta = t_mean - mean
        f = 1.0 / (i + 1).astype(_F32)              # tile rows / rows so far (equal tiles)
        return mean + delta * f, m2 + t_m2 + jnp.square(delta) * (bc * i.astype(_F32) * f)

    zeros = jnp.zeros((bm,), _F32)
    return jax.lax.fori_loop(0, C // bc, merge, (zeros, zeros))


def _fwd_kernel(xt_ref, w_ref, b_ref, yt_ref, mean_ref, rstd_ref, *, eps: float, bc: int):
    """One block of bm token columns: xt_ref `[C, bm]`, w_ref / b_ref `[C]`; writes yt_ref
    `[C, bm]` and the columns' float32 mean / rstd `[bm]`."""
    C = xt_ref.shape[0]
    mean, m2 = _column_stats(xt_ref, bc)
    rstd = jax.lax.rsqrt(m2 / C + eps)

    def write(i, carry):
        rows = pl.ds(i * bc, bc)
        xhat = (xt_ref[rows, :].astype(_F32) - mean[None, :]) * rstd[None, :]
        y = xhat * w_ref[rows].astype(_F32)[:, None] + b_ref[rows].astype(_F32)[:, None]
        yt_ref[rows, :] = y.astype(yt_ref.dtype)
        return carry

    jax.lax.fori_loop(0, C // bc, write, 0)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _bwd_kernel(xt_ref, dyt_ref, w_ref, mean_ref, rstd_ref, dxt_ref, dw_ref, db_ref, *,
                bc: int):
    """One block of bm token columns: xt_ref, dyt_ref `[C, bm]`, w_ref `[C]`, mean_ref /
    rstd_ref `[bm]`; writes dxt_ref `[C, bm]` and this block's partial sums dw_ref / db_ref
    `[C]` (float32)."""
    C, bm = xt_ref.shape
    mean, rstd = mean_ref[...], rstd_ref[...]

    def factors(rows):
        xhat = (xt_ref[rows, :].astype(_F32) - mean[None, :]) * rstd[None, :]
        dy = dyt_ref[rows, :].astype(_F32)
        return xhat, dy, dy * w_ref[rows].astype(_F32)[:, None]

    def sums(i, carry):
        s_g, s_gx = carry
        rows = pl.ds(i * bc, bc)
        xhat, dy, g = factors(rows)
        dw_ref[rows] = jnp.sum(dy * xhat, axis=1)
        db_ref[rows] = jnp.sum(dy, axis=1)
        return s_g + jnp.sum(g, axis=0), s_gx + jnp.sum(g * xhat, axis=0)

    zeros = jnp.zeros((bm,), _F32)
    s_g, s_gx = jax.lax.fori_loop(0, C // bc, sums, (zeros, zeros))
    mean_g, mean_gx = s_g / C, s_gx / C

    def write(i, carry):
        rows = pl.ds(i * bc, bc)
        xhat, _, g = factors(rows)
        dx = rstd[None, :] * (g - mean_g[None, :] - xhat * mean_gx[None, :])
        dxt_ref[rows, :] = dx.astype(dxt_ref.dtype)
        return carry

    jax.lax.fori_loop(0, C // bc, write, 0)


def _launch(tune):
    """`(bm, bc, CompilerParams)` of `tune` = `(bm, bc, num_warps, num_stages)` or None (the
    module's defaults)."""
    bm, bc, warps, stages = tune or (BM, BC, NUM_WARPS, NUM_STAGES)
    return bm, bc, plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _specs(C: int, bm: int):
    """Block specs over the grid of token blocks: `[C, bm]` blocks, `[C]` per channel, `[bm]`
    per token."""
    return (pl.BlockSpec((C, bm), lambda j: (0, j)), pl.BlockSpec((C,), lambda j: (0,)),
            pl.BlockSpec((bm,), lambda j: (j,)))


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret", "tune"))
def layer_norm_fwd_pallas(xt_CM, weight_C, bias_C, *, eps: float, out_dtype=None,
                          interpret: bool = False, tune=None):
    """LayerNorm over the channels of transposed activations.

    Args:
      xt_CM: `[C, M]` (channels x tokens), any float dtype. weight_C, bias_C: `[C]`, applied
        in float32. eps: added to the variance. out_dtype: of yt (default xt's).
      tune: None (the defaults above) or `(bm, bc, num_warps, num_stages)`.
    Returns:
      `(yt_CM in out_dtype, mean_M float32, rstd_M float32)`.
    """
    C, M = xt_CM.shape
    bm, bc, params = _launch(tune)
    _check("layer_norm_fwd_pallas", M, C, bm, bc)
    out_dtype = xt_CM.dtype if out_dtype is None else out_dtype
    block, per_channel, per_token = _specs(C, bm)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, eps=float(eps), bc=bc), grid=(M // bm,),
        in_specs=[block, per_channel, per_channel], out_specs=[block, per_token, per_token],
        out_shape=[jax.ShapeDtypeStruct((C, M), out_dtype), jax.ShapeDtypeStruct((M,), _F32),
                   jax.ShapeDtypeStruct((M,), _F32)],
        compiler_params=params, interpret=interpret, name="layer_norm_fwd",
    )(xt_CM, weight_C, bias_C)


@functools.partial(jax.jit, static_argnames=("interpret", "tune"))
def layer_norm_bwd_pallas(xt_CM, dyt_CM, weight_C, mean_M, rstd_M, *, interpret: bool = False,
                          tune=None):
    """The LayerNorm backward for transposed activations (see the module docstring).

    Args:
      xt_CM: `[C, M]` the forward's input (dx comes back in its dtype). dyt_CM: `[C, M]`
        cotangent of the output. weight_C: `[C]`. mean_M, rstd_M: the forward's float32
        statistics (`layer_norm_fwd_pallas`). tune: as for the forward.
    Returns:
      `(dxt_CM, dweight_C float32, dbias_C float32)`.
    """
    C, M = xt_CM.shape
    bm, bc, params = _launch(tune)
    _check("layer_norm_bwd_pallas", M, C, bm, bc)
    G = M // bm
    block, per_channel, per_token = _specs(C, bm)
    partial = pl.BlockSpec((pl.squeezed, C), lambda j: (j, 0))
    dxt, dw, db = pl.pallas_call(
        functools.partial(_bwd_kernel, bc=bc), grid=(G,),
        in_specs=[block, block, per_channel, per_token, per_token],
        out_specs=[block, partial, partial],
        out_shape=[jax.ShapeDtypeStruct((C, M), xt_CM.dtype), jax.ShapeDtypeStruct((G, C), _F32),
                   jax.ShapeDtypeStruct((G, C), _F32)],
        compiler_params=params, interpret=interpret, name="layer_norm_bwd",
    )(xt_CM, dyt_CM, weight_C, mean_M, rstd_M)
    return dxt, jnp.sum(dw, axis=0), jnp.sum(db, axis=0)
