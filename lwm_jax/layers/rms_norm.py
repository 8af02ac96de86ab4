"""RMSNorm with float32 statistics: `x / sqrt(mean(x^2) + eps) * weight`.

Whatever the compute dtype, `x` is upcast to float32, the mean square and the reciprocal root
are taken in float32, the weight is applied in float32, and the result is cast once to the
requested dtype. (Hugging Face LLaMA casts back to the input dtype before the weight; with
float32 inputs the two agree exactly.)

`rms_norm` is the pure function the blocks call on one layer's weight slice; `RMSNorm` holds
the weight (optionally stacked with a leading `layers` axis).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

RMS_EPS = 1e-5


def rms_norm(x, weight, *, eps: float = RMS_EPS, out_dtype: Any = None):
    """RMSNorm over the last axis.

    Args:
      x: `[..., C]` any float dtype.
      weight: `[C]` any float dtype (applied in float32).
      eps: added to the mean square.
      out_dtype: dtype of the result (default: `x.dtype`).
    Returns:
      `[..., C]` in `out_dtype`.
    """
    return _rms_norm(x, weight, float(eps), np.dtype(x.dtype if out_dtype is None else out_dtype))


# Hand-written backward: the forward keeps x in its own dtype and one float32 number per row,
# not the float32 copies of x that autodiff of the forward would keep.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, out_dtype):
    return _rms_norm_fwd(x, weight, eps, out_dtype)[0]


def _rms_norm_fwd(x, weight, eps, out_dtype):
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * rstd * weight.astype(jnp.float32)).astype(out_dtype), (x, weight, rstd)


def _rms_norm_bwd(eps, out_dtype, res, dy):
    x, weight, rstd = res
    xhat = x.astype(jnp.float32) * rstd
    dy32 = dy.astype(jnp.float32)
    d_weight = jnp.sum(dy32 * xhat, axis=tuple(range(dy.ndim - 1)))
    g = dy32 * weight.astype(jnp.float32)                     # d loss / d xhat
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_weight.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    """RMSNorm weight `[*stack, C]`, initialised to ones; logical axes
    `("layers",) * len(stack) + ("embed",)`."""

    def __init__(self, dim: int, *, param_dtype: Any = jnp.float32, stack: tuple[int, ...] = (),
                 eps: float = RMS_EPS):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((*stack, dim), param_dtype),
                                logical_axes=("layers",) * len(stack) + ("embed",))

    def __call__(self, x, out_dtype: Any = None):
        """Normalise `x [..., C]` (only for unstacked weights)."""
        if self.weight.ndim != 1:
            raise ValueError("RMSNorm: stacked weights; slice a layer and call rms_norm()")
        return rms_norm(x, self.weight[...], eps=self.eps, out_dtype=out_dtype)
