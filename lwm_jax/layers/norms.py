"""LayerNorm and per-head GroupNorm whose statistics are always computed in float32.

Whatever the compute dtype, the input is upcast to float32, the mean and the (two-pass) variance
are taken in float32, the normalised value gets its affine weight/bias applied in float32, and only
the result is cast to the requested output dtype. bf16 statistics break on inputs with a large
mean and a small spread (e.g. 300 + 0.01·noise: bf16 cannot even represent the deviations).

Both share one float32 implementation with a hand-written backward that keeps only the input and
two float32 numbers per row (per group) from the forward pass.

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
    return _group_norm(x, weight, bias, 1, float(eps), _dtype(x, out_dtype))


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
    C = x.shape[-1]
    if C % n_groups:
        raise ValueError(f"group_norm: channels {C} not divisible by n_groups={n_groups}")
    return _group_norm(x, weight, bias, int(n_groups), float(eps), _dtype(x, out_dtype))


def _dtype(x, out_dtype) -> np.dtype:
    return np.dtype(x.dtype if out_dtype is None else out_dtype)


def _statistics(x, n_groups: int, eps: float):
    """(float32 x as `[..., G, C/G]`, mean and 1/std `[..., G, 1]`): two-pass variance."""
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], n_groups, x.shape[-1] // n_groups)
    mean = jnp.mean(xg, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xg - mean), axis=-1, keepdims=True)
    return xg, mean, jax.lax.rsqrt(var + eps)


# The backward is written by hand so that the forward keeps only x (in its own, often 16-bit,
# dtype) and two float32 numbers per group: autodiff of the forward would keep the float32
# centred and normalised values (two or three float32 copies of x) for every norm of the model.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _group_norm(x, weight, bias, n_groups, eps, out_dtype):
    return _group_norm_fwd(x, weight, bias, n_groups, eps, out_dtype)[0]


def _group_norm_fwd(x, weight, bias, n_groups, eps, out_dtype):
    xg, mean, rstd = _statistics(x, n_groups, eps)
    y = ((xg - mean) * rstd).reshape(x.shape)
    out = (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(out_dtype)
    return out, (x, weight, bias, mean, rstd)


def _group_norm_bwd(n_groups, eps, out_dtype, res, dy):
    x, weight, bias, mean, rstd = res
    xhat = (x.astype(jnp.float32).reshape(*mean.shape[:-1], -1) - mean) * rstd    # [..., G, N]
    dy32 = dy.astype(jnp.float32)
    lead = tuple(range(dy.ndim - 1))
    d_weight = jnp.sum(dy32 * xhat.reshape(x.shape), axis=lead)
    d_bias = jnp.sum(dy32, axis=lead)
    g = (dy32 * weight.astype(jnp.float32)).reshape(xhat.shape)     # d loss / d xhat
    # d xhat/dx applied to g: (g - mean(g) - xhat * mean(g * xhat)) / std, per group
    dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True)
                 - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return (dx.reshape(x.shape).astype(x.dtype), d_weight.astype(weight.dtype),
            d_bias.astype(bias.dtype))


_group_norm.defvjp(_group_norm_fwd, _group_norm_bwd)


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
