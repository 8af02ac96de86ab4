"""LayerNorm and per-head GroupNorm parameter holders (NNX modules).

The math, with float32 statistics, and its kernels are the ops `lwm_jax.ops.layer_norm` and
`lwm_jax.ops.group_norm`: the RWKV-7 blocks call those functions on one layer's slice of
stacked parameters; the modules hold the parameters (optionally stacked with a leading
`layers` axis) and call the same functions (their XLA form) when unstacked.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.ops.group_norm import group_norm
from lwm_jax.ops.layer_norm import LN_EPS, layer_norm


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
