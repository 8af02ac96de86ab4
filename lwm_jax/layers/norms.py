"""LayerNorm and per-head GroupNorm whose statistics are always computed in float32.

Whatever the compute dtype, the input is upcast to float32, the mean and the (two-pass) variance
are taken in float32, the normalised value gets its affine weight/bias applied in float32, and only
the result is cast to the requested output dtype. bf16 statistics break on inputs with a large
mean and a small spread (e.g. 300 + 0.01·noise: bf16 cannot even represent the deviations).

The pure functions (`layer_norm`, `group_norm`) are what the RWKV-7 blocks call on one layer's
slice of stacked parameters; the modules hold the parameters (optionally stacked with a leading
`layers` axis) and call the same functions.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.ops.group_norm import group_norm_bwd_pallas
from lwm_jax.ops.layer_norm import layer_norm_bwd_pallas, layer_norm_fwd_pallas

LN_EPS = 1e-5


def layer_norm(x, weight, bias, *, eps: float = LN_EPS, out_dtype: Any = None):
    """LayerNorm over the last axis with fp32 statistics.

    Args:
      x: `[..., C]` any float dtype.
      weight, bias: `[C]` (any float dtype; applied in float32).
      eps: added to the variance (RWKV-7: 1e-5).
      out_dtype: dtype of the result (default: `x.dtype`).
    Returns:
      `[..., C]` in `out_dtype`.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    var = jnp.mean(jnp.square(centred), axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + eps)
    y = y * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def group_norm(x, weight, bias, *, n_groups: int, eps: float, out_dtype: Any = None):
    """GroupNorm over contiguous channel groups of the last axis, fp32 statistics.

    RWKV-7's `ln_x`: `n_groups = H` heads, each of `N = C / H` channels, `eps = N * 1e-5`.

    Args:
      x: `[..., C]` any float dtype (C divisible by `n_groups`).
      weight, bias: `[C]` per-channel affine, applied in float32.
      out_dtype: dtype of the result (default: `x.dtype`).
    Returns:
      `[..., C]` in `out_dtype`.
    """
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
    """`group_norm(x, weight, bias, n_groups=, eps=, out_dtype=)` (same forward, bit for bit)
    whose backward is `group_norm_bwd_pallas` (`interpret`: in the Pallas interpreter, for
    tests). x `[..., C]` with `kernel_applies(x.shape, n_groups)`; weight, bias `[C]`.
    Gradients come back in each input's dtype."""
    return group_norm(x, weight, bias, n_groups=n_groups, eps=eps, out_dtype=out_dtype)


def _fused_fwd(x, weight, bias, n_groups, eps, out_dtype, interpret):
    y = group_norm(x, weight, bias, n_groups=n_groups, eps=eps, out_dtype=out_dtype)
    return y, (x, weight, np.zeros((0,), bias.dtype))


def _fused_bwd(n_groups, eps, out_dtype, interpret, res, dy):
    x, weight, bias_proto = res
    C = x.shape[-1]
    N = C // n_groups
    groups = lambda a: a.reshape(-1, n_groups, N)      # noqa: E731
    dx, dw, db = group_norm_bwd_pallas(groups(x), groups(dy), weight.reshape(n_groups, N),
                                       eps=eps, interpret=interpret)
    return (dx.reshape(x.shape), dw.reshape(C).astype(weight.dtype),
            db.reshape(C).astype(bias_proto.dtype))


group_norm_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def layer_norm_fused(x, weight, bias, eps: float, out_dtype, interpret: bool):
    """`layer_norm(x, weight, bias, eps=, out_dtype=)` as the Pallas kernels of
    `lwm_jax.ops.layer_norm`, forward and backward (`interpret`: in the Pallas interpreter, for
    tests). x `[..., C]` with `kernel_applies(tokens, C)`; weight, bias `[C]`. The kernels see
    x transposed, `[C, tokens]`: the layout XLA keeps the residual stream in, so the transposes
    cost nothing. Gradients come back in each input's dtype."""
    return _ln_forward(x, weight, bias, eps, out_dtype, interpret)[0]


def _ln_forward(x, weight, bias, eps, out_dtype, interpret):
    C = x.shape[-1]
    yt, mean, rstd = layer_norm_fwd_pallas(x.reshape(-1, C).T, weight, bias, eps=eps,
                                           out_dtype=jnp.dtype(out_dtype), interpret=interpret)
    return yt.T.reshape(x.shape), (x, weight, mean, rstd, np.zeros((0,), bias.dtype))


def _ln_backward(eps, out_dtype, interpret, res, dy):
    x, weight, mean, rstd, bias_proto = res
    C = x.shape[-1]
    dxt, dw, db = layer_norm_bwd_pallas(x.reshape(-1, C).T, dy.reshape(-1, C).T, weight, mean,
                                        rstd, interpret=interpret)
    return dxt.T.reshape(x.shape), dw.astype(weight.dtype), db.astype(bias_proto.dtype)


layer_norm_fused.defvjp(_ln_forward, _ln_backward)


def _stack_axes(stack: tuple[int, ...]) -> tuple[str, ...]:
    return ("layers",) * len(stack)


class LayerNorm(nnx.Module):
    """LayerNorm parameters `weight`, `bias`: `[*stack, C]` (stack = `(L,)` inside the blocks).

    `weight` starts at 1 and `bias` at 0 (RWKV-7 init for every LayerNorm).
    Logical axes: `("layers",) * len(stack) + ("embed",)`.
    """

    def __init__(self, dim: int, *, param_dtype: Any = jnp.float32, stack: tuple[int, ...] = (),
                 eps: float = LN_EPS):
        axes = _stack_axes(stack) + ("embed",)
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((*stack, dim), param_dtype), logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((*stack, dim), param_dtype), logical_axes=axes)

    def __call__(self, x, out_dtype: Any = None):
        """Normalise `x [..., C]` (only for unstacked parameters)."""
        if self.weight.ndim != 1:
            raise ValueError("LayerNorm: stacked parameters; slice a layer and call layer_norm()")
        return layer_norm(x, self.weight[...], self.bias[...], eps=self.eps, out_dtype=out_dtype)


class GroupNorm(nnx.Module):
    """Per-head GroupNorm parameters `weight`, `bias`: `[*stack, C]`.

    Args:
      dim: C. n_groups: H. eps: N * 1e-5 for RWKV-7.
      weight_init: optional array `[*stack, C]` for the initial weight (RWKV-7 `ln_x`:
        `((l + 1) / L) ** 0.7`); default ones. Bias starts at 0.
    """

    def __init__(self, dim: int, n_groups: int, eps: float, *, param_dtype: Any = jnp.float32,
                 stack: tuple[int, ...] = (), weight_init=None):
        if dim % n_groups:
            raise ValueError(f"GroupNorm: dim {dim} not divisible by n_groups={n_groups}")
        axes = _stack_axes(stack) + ("embed",)
        self.n_groups, self.eps = n_groups, eps
        w = np.ones((*stack, dim)) if weight_init is None else weight_init
        if tuple(np.shape(w)) != (*stack, dim):
            raise ValueError(f"GroupNorm: weight_init shape {np.shape(w)} != {(*stack, dim)}")
        self.weight = nnx.Param(jnp.asarray(w, param_dtype), logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((*stack, dim), param_dtype), logical_axes=axes)

    def __call__(self, x, out_dtype: Any = None):
        """Normalise `x [..., C]` per group (only for unstacked parameters)."""
        if self.weight.ndim != 1:
            raise ValueError("GroupNorm: stacked parameters; slice a layer and call group_norm()")
        return group_norm(x, self.weight[...], self.bias[...], n_groups=self.n_groups,
                          eps=self.eps, out_dtype=out_dtype)
