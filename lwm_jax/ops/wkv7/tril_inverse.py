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
binomial growth is at most C(7, 3) = 35); then the inverted blocks are merged pairwise, block
length 8 -> 16 -> 32 ..., by the 2 x 2 block rule

    (I - [[A11, 0], [A21, A22]])^{-1} = X + X B X,   X = diag((I - A11)^{-1}, (I - A22)^{-1}),
                                                     B = [[0, 0], [A21, 0]],

applied to every pair of one level at once: two products a level, ceil(log2(C / BLOCK)) levels
(block forward substitution, row by row, takes two per block row: C / BLOCK - 1 rows). At C = 32
that is 8 products in all instead of 10, at C = 64 10 instead of 18. No cancelling powers
either: error ~1e-7 (fp32) / ~2e-3 (TF32) in the worst case above, against 1e11 for the
doubling product.

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
    inv = eye + D
    power, span = D, 2
    while span < min(block, C):
        power = mm(power, power)
        inv = inv + mm(inv, power)
        span *= 2
    while block < C:
        # `inv` is block diagonal at length `block`; B keeps A's entries whose row lies in the
        # second and column in the first half of one 2*block block (A is strictly lower, so
        # "same 2*block block, different block" selects exactly those)
        pair_row, pair_col = _block_index(row, C, 2 * block), _block_index(col, C, 2 * block)
        B = jnp.where((pair_row == pair_col) & (blk_row != blk_col), A, 0.0)
        inv = inv + mm(inv, mm(B, inv))
        block, blk_row, blk_col = 2 * block, pair_row, pair_col
    return inv
