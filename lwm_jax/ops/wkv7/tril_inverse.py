"""`(I - A)^{-1}` for a strictly lower triangular `A`: the WY step of every chunked WKV7 path.

Why blocked: `A` is nilpotent, so `(I - A)^{-1} = (I + A)(I + A^2)(I + A^4)...` is exact in
exact arithmetic, and that product was used at first. In floating point it is not stable: its
factors hold the powers `A^n`, whose entries grow like binomial coefficients C(C-1, n) when
`A[t, s] ~ -alpha` over a whole chunk (the keys of consecutive tokens nearly aligned and the
in-context rate alpha near 1, a state RWKV-7 reaches in training), and they must cancel back to
an inverse whose entries are at most 1. Measured on a 0.1B-style run's real WKV inputs: the fp32
doubling inverse was wrong by 2e-6 / 3e-4 / 14 (relative) at C = 16 / 32 / 64, and with TF32
matmuls at C = 32 the error reached the outputs as NaN (docs/precision-nan.md).

Here: the diagonal `BLOCK x BLOCK` blocks are inverted by doubling (powers below 8 only: their
binomial growth is at most C(7, 3) = 35), then the block rows are solved in order by block forward
substitution, `X_i = (I - D_ii)^{-1} (e_i + sum_{j < i} A_ij X_j)`: no cancelling powers, error
~1e-7 (fp32) / ~2e-3 (TF32) in the worst case above, against 1e11 for the doubling product.

Works on a batch of matrices (`[..., C, C]`) in plain JAX and on one 2-D register tile inside the
Pallas kernels: it uses only iota, comparisons, `where`, additions and the caller's matmul `mm`
(masks are built without integer division, which every Pallas backend lowers).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

BLOCK = 8


def _block_index(idx, C: int, block: int):
    """Block number of each index (`idx // block`) as a sum of comparisons. Each term is a
    `where` on integers, not a cast boolean: with a single term (C = 16) Mosaic folds
    `cast(a) == cast(b)` into an i1 comparison that it then cannot lower."""
    out = jnp.zeros_like(idx)
    for start in range(block, C, block):
        out = out + jnp.where(idx >= start, 1, 0).astype(idx.dtype)
    return out


def unit_lower_inverse(A, mm: Callable, block: int = BLOCK):
    """`(I - A)^{-1}` for strictly lower triangular `A` `[..., C, C]` (float32).

    Args:
      A: strictly lower triangular (entries on and above the diagonal must be exactly 0).
      mm: `mm(x, y) -> x @ y` over the last two axes, float32 result, at the caller's precision.
      block: diagonal block length (the last block may be shorter when C is not a multiple).
    Returns:
      float32 `[..., C, C]`, unit lower triangular.
    """
    C = A.shape[-1]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    blk_row, blk_col = _block_index(row, C, block), _block_index(col, C, block)
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    D = jnp.where(blk_row == blk_col, A, 0.0)
    # (I - D)^{-1} = (I + D)(I + D^2)(I + D^4)... while the power stays below the block length
    inv_diag = eye + D
    power, span = D, 2
    while span < min(block, C):
        power = mm(power, power)
        inv_diag = inv_diag + mm(inv_diag, power)
        span *= 2
    inv = inv_diag
    for i in range(1, -(-C // block)):
        # rows of block i, columns of earlier blocks; rows elsewhere stay exactly 0, and the
        # block-diagonal inv_diag keeps them 0, so only block row i of `inv` changes
        below = jnp.where((blk_row == i) & (blk_col < i), A, 0.0)
        inv = inv + mm(inv_diag, mm(below, inv))
    return inv
