"""What the Mosaic GPU WKV7 kernels share: the Pallas Mosaic GPU modules, the 64 x 64 tile,
its register layout, and moving float32 tiles between registers and shared memory.

Every kernel of this package works on `TILE` = [64, 64] tiles (K = V = 64; 64 rows is the
wgmma M of one warpgroup). A float32 register tile lives in the `WG` (WGMMA) layout; a tile in
shared memory is bfloat16 (a wgmma operand) or float32 (staging for TMA), tiled (8, 128 bytes)
and 128-byte swizzled (`swizzled`), the layout both wgmma and TMA read. A float32 operand
reaches the tensor cores as a bf16 hi / lo pair (`split`, `put`): the "bf16x3" product
hi hi + hi lo + lo hi, accumulated in float32, keeps about 16 significant bits per operand.
"""
from __future__ import annotations

import jax.numpy as jnp

from lwm_jax.ops.wkv7.tile_dots import split_bf16

try:
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    WG = plgpu.Layout.WGMMA
except (ImportError, AttributeError) as _err:  # pragma: no cover - depends on the jax build
    raise ImportError(f"lwm_jax.ops.wkv7.mosaic_gpu needs jax's Pallas Mosaic GPU API: {_err}") \
        from _err

F32, BF16 = jnp.float32, jnp.bfloat16
TILE = (64, 64)

split = split_bf16    # float32 register tile -> (hi, lo) bfloat16, x ~= hi + lo


def swizzled(shape, dtype=BF16, swizzle=None):
    """A shared-memory buffer of `shape`, tiled (8, `swizzle` bytes) and `swizzle`-byte
    swizzled: the wgmma operand and TMA layout. `swizzle` None: the widest the rows allow (128
    bytes for 64 bf16 columns); a wgmma's two operands must share one (a [64, 64] operand
    beside a 32-column one takes 64)."""
    itemsize = jnp.dtype(dtype).itemsize
    if swizzle is None:
        swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def load(ref):
    """A shared-memory tile into registers, WGMMA layout."""
    return plgpu.load(ref, layout=WG, optimized=False)


def put(x, hi_ref, lo_ref):
    """Stores the float32 register tile `x` as its bf16 hi / lo pair."""
    hi, lo = split(x)
    hi_ref[...] = hi
    lo_ref[...] = lo


__all__ = ["BF16", "F32", "TILE", "WG", "load", "pl", "plgpu", "put", "split", "swizzled"]
