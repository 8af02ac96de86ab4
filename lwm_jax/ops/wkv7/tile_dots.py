"""2-D tile products with float32 accumulation, and the bf16 hi / lo split of their operands,
shared by the GPU and TPU kernels' tile math.

`precision` is anything `jax.lax.dot_general` takes (a `jax.lax.Precision` or a
`DotAlgorithmPreset`), or an object with a `tile_dot(x, y, contract)` method that forms the
product itself (`pallas_gpu.tf32_round.RoundedTF32`). A leaf: imports nothing of `lwm_jax`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def split_bf16(x):
    """float32 -> `(hi, lo)` bfloat16 with x ~= hi + lo (16 significant bits): the operand form
    of the "bf16x3" products (hi*hi + hi*lo + lo*hi accumulated in float32)."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(_F32)).astype(jnp.bfloat16)


def _dot(x, y, contract, precision):
    tile_dot = getattr(precision, "tile_dot", None)   # a product form of its own (e.g. the GPU
    if tile_dot is not None:                          # kernels' `pallas_gpu.tf32_round`)
        return tile_dot(x, y, contract)
    return jax.lax.dot_general(x, y, (contract, ((), ())), precision=precision,
                               preferred_element_type=_F32)


def mm(x, y, precision):
    """`x [m, k] @ y [k, n] -> [m, n]` float32."""
    return _dot(x, y, ((1,), (0,)), precision)


def mm_tn(x, y, precision):
    """`x^T @ y` for x `[k, m]`, y `[k, n]` -> `[m, n]` float32."""
    return _dot(x, y, ((0,), (0,)), precision)


def mm_nt(x, y, precision):
    """`x @ y^T` for x `[m, k]`, y `[n, k]` -> `[m, n]` float32."""
    return _dot(x, y, ((1,), (1,)), precision)
