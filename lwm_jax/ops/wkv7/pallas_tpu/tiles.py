"""One chunk of WKV7 in the WY (chunk-parallel) form, forward and hand-written backward.

These functions work on plain 2-D float32 values of ONE head and ONE chunk, so the same code runs
inside the TPU Pallas kernels (`fwd.py`, `bwd.py`) and, for unit tests, as ordinary JAX.
They only use what Mosaic lowers well: 2-D matmuls (`NN`, `NT`, `TN` dot_generals with f32
accumulation), `exp`, `where`, iota masks and row/column broadcasts. No cumsum, no transpose, no
triangular solve primitive.

Layout (per head, chunk length C, key dim K, value dim V):
  r, w, k, a, b: `[C, K]`; v: `[C, V]`; the state is kept TRANSPOSED, `ST = S^T` `[V, K]`, so that
  per-key decays scale lanes (`ST * decay_row[1, K]`) and no in-kernel transpose is needed.

Math (S indexed [key, value], g_t = sum_{s<=t} w_s inside the chunk, G_t = diag(exp(g_t))):
  u_t = a_t^T S_{t-1}   (the rank-1 "pseudo value", row [V])
  S_t = G_t S_0 + sum_{s<=t} (exp(g_t - g_s) * b_s) u_s + (exp(g_t - g_s) * k_s) v_s^T
so, with strictly-lower A_ab[t,s] = sum_k a_tk b_sk exp(g_{t-1} - g_s)_k (A_ak likewise with k),
lower-inclusive A_rb[t,s] = sum_k r_tk b_sk exp(g_t - g_s)_k (A_rk likewise):
  U = (I - A_ab)^{-1} ((a * exp(g_{t-1})) S_0 + A_ak V)
  O = (r * exp(g)) S_0 + A_rb U + A_rk V
  S_C = G_C S_0 + (b * exp(g_C - g))^T U + (k * exp(g_C - g))^T V
The pairwise decays are factorised around rho = g_C / 2, so every factor is exp(x) with
|x| <= |g_C| / 2 (for chunk 64 and w >= -exp(-0.5): |x| <= 19.4, far from f32 overflow).

Segments: `seg_col [C, 1]` / `seg_row [1, C]` int32 hold the number of resets from the chunk start
up to each position (0 = same document as the carried state). Pairs in different documents are
masked out of the A matrices, S_0 only reaches rows with counter 0, and the end state keeps only
rows of the last position's document.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lwm_jax.ops.wkv7 import tril_inverse
from lwm_jax.ops.wkv7.tile_dots import mm, mm_nt, mm_tn

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST  # the in-chunk cumulative sums of w are always full fp32


def _iota_CC(C):
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    return row, col


def tri_inverse(A_CC, precision):
    """`(I - A)^{-1}` for strictly lower-triangular `A [C, C]`: the blocked form of
    `lwm_jax.ops.wkv7.tril_inverse` (diagonal 8-blocks by doubling, then merged pairwise up to C;
    a plain doubling product lost all accuracy at C >= 32), every matmul on the MXU."""
    return tril_inverse.unit_lower_inverse(A_CC, lambda x, y: mm(x, y, precision))


class ChunkMasks(NamedTuple):
    """Boolean/float masks of one chunk (see module docstring, "Segments")."""
    incl_CC: jax.Array    # bool [C, C]: s <= t and same document
    strict_CC: jax.Array  # bool [C, C]: s < t and same document
    from0_C1: jax.Array   # f32 [C, 1]: 1 where the carried state S_0 reaches row t
    to_end_C1: jax.Array  # f32 [C, 1]: 1 where row s is in the last position's document
    keep0_11: jax.Array   # f32 [1, 1]: 1 where S_0 survives to the chunk end


def chunk_masks(C, seg_col=None, seg_row=None):
    """Masks for a chunk of length C; `seg_col [C,1]` / `seg_row [1,C]` int32 counters or None."""
    row, col = _iota_CC(C)
    incl = col <= row
    strict = col < row
    if seg_col is None:
        one_C1 = jnp.ones((C, 1), _F32)
        return ChunkMasks(incl, strict, one_C1, one_C1, jnp.ones((1, 1), _F32))
    same = seg_col == seg_row
    last_11 = seg_col[C - 1:C, :]
    return ChunkMasks(
        incl_CC=incl & same,
        strict_CC=strict & same,
        from0_C1=jnp.where(seg_col == 0, 1.0, 0.0).astype(_F32),
        to_end_C1=jnp.where(seg_col == last_11, 1.0, 0.0).astype(_F32),
        keep0_11=jnp.where(last_11 == 0, 1.0, 0.0).astype(_F32),
    )


class ChunkTerms(NamedTuple):
    """Decay-weighted inputs and intra-chunk matrices of one chunk (all f32)."""
    e_ex: jax.Array    # [C, K] exp(g_{t-1} - rho)
    e_in: jax.Array    # [C, K] exp(g_t - rho)
    e_out: jax.Array   # [C, K] exp(rho - g_t)
    c_a0: jax.Array    # [C, K] exp(g_{t-1}) masked by from0
    c_r0: jax.Array    # [C, K] exp(g_t) masked by from0
    c_end: jax.Array   # [C, K] exp(g_C - g_t) masked by to_end
    dec_end: jax.Array  # [1, K] exp(g_C) (times keep0)
    a_in: jax.Array
    r_in: jax.Array
    b_out: jax.Array
    k_out: jax.Array
    a0: jax.Array
    r0: jax.Array
    b_end: jax.Array
    k_end: jax.Array
    A_ab: jax.Array    # [C, C]
    A_ak: jax.Array
    A_rb: jax.Array
    A_rk: jax.Array
    X: jax.Array       # [C, C] (I - A_ab)^{-1}


def chunk_terms(r, w, k, a, b, masks: ChunkMasks, precision) -> ChunkTerms:
    """Everything of one chunk that does not depend on the carried state."""
    C = w.shape[0]
    incl_f = jnp.where(_iota_CC(C)[1] <= _iota_CC(C)[0], 1.0, 0.0).astype(_F32)
    g = mm(incl_f, w, _HIGHEST)             # [C, K] inclusive cumulative log-decay (always fp32)
    g_ex = g - w                            # exclusive
    g_end = g[C - 1:C, :]                   # [1, K]
    rho = 0.5 * g_end
    e_ex = jnp.exp(g_ex - rho)
    e_in = jnp.exp(g - rho)
    e_out = jnp.exp(rho - g)
    c_a0 = jnp.exp(g_ex) * masks.from0_C1
    c_r0 = jnp.exp(g) * masks.from0_C1
    c_end = jnp.exp(g_end - g) * masks.to_end_C1
    dec_end = jnp.exp(g_end) * masks.keep0_11
    a_in, r_in, b_out, k_out = a * e_ex, r * e_in, b * e_out, k * e_out
    zero = jnp.zeros((C, C), _F32)
    A_ab = jnp.where(masks.strict_CC, mm_nt(a_in, b_out, precision), zero)
    A_ak = jnp.where(masks.strict_CC, mm_nt(a_in, k_out, precision), zero)
    A_rb = jnp.where(masks.incl_CC, mm_nt(r_in, b_out, precision), zero)
    A_rk = jnp.where(masks.incl_CC, mm_nt(r_in, k_out, precision), zero)
    return ChunkTerms(e_ex, e_in, e_out, c_a0, c_r0, c_end, dec_end,
                      a_in, r_in, b_out, k_out, a * c_a0, r * c_r0, b * c_end, k * c_end,
                      A_ab, A_ak, A_rb, A_rk, tri_inverse(A_ab, precision))


def chunk_pseudo_values(t: ChunkTerms, v, ST0, precision):
    """`U [C, V]`, the rows u_t = a_t^T S_{t-1}, and `R = (I - A_ab) U`."""
    R = mm_nt(t.a0, ST0, precision) + mm(t.A_ak, v, precision)
    return mm(t.X, R, precision), R


def chunk_forward(r, w, k, v, a, b, ST0, masks: ChunkMasks, precision):
    """Forward of one chunk.

    Args:
      r, w, k, a, b: `[C, K]` f32; v: `[C, V]` f32; ST0: `[V, K]` f32 carried state (transposed).
    Returns:
      `(o [C, V], ST_end [V, K])`, f32.
    """
    t = chunk_terms(r, w, k, a, b, masks, precision)
    U, _ = chunk_pseudo_values(t, v, ST0, precision)
    o = (mm_nt(t.r0, ST0, precision) + mm(t.A_rb, U, precision) + mm(t.A_rk, v, precision))
    ST_end = ST0 * t.dec_end + mm_tn(U, t.b_end, precision) + mm_tn(v, t.k_end, precision)
    return o, ST_end


def chunk_backward(r, w, k, v, a, b, ST0, dO, dST, masks: ChunkMasks, precision):
    """Backward of one chunk, recomputing its forward terms from the carried state.

    Args:
      r, w, k, a, b: `[C, K]`; v, dO: `[C, V]`; ST0, dST: `[V, K]` (state at the chunk start and
      the gradient w.r.t. the state at the chunk end, both transposed); all f32.
    Returns:
      `(dr, dw, dk, dv, da, db, dST0)` with the shapes of the inputs, f32.
    """
    C = w.shape[0]
    t = chunk_terms(r, w, k, a, b, masks, precision)
    U, R = chunk_pseudo_values(t, v, ST0, precision)
    zero = jnp.zeros((C, C), _F32)
    # o = r0 S0 + A_rb U + A_rk v ;  S_end = dec S0 + b_end^T U + k_end^T v
    dU = mm_tn(t.A_rb, dO, precision) + mm_nt(t.b_end, dST, precision)
    dA_rb = jnp.where(masks.incl_CC, mm_nt(dO, U, precision), zero)
    dA_rk = jnp.where(masks.incl_CC, mm_nt(dO, v, precision), zero)
    # U = X R with X = (I - A_ab)^{-1}:  dR = X^T dU,  dA_ab = dR U^T
    dR = mm_tn(t.X, dU, precision)
    dA_ab = jnp.where(masks.strict_CC, mm_nt(dR, U, precision), zero)
    dA_ak = jnp.where(masks.strict_CC, mm_nt(dR, v, precision), zero)
    dv = (mm_tn(t.A_rk, dO, precision) + mm_tn(t.A_ak, dR, precision)
          + mm_nt(t.k_end, dST, precision))
    d_r0 = mm(dO, ST0, precision)
    d_a0 = mm(dR, ST0, precision)
    dST0 = mm_tn(dO, t.r0, precision) + mm_tn(dR, t.a0, precision) + dST * t.dec_end
    d_b_end = mm(U, dST, precision)
    d_k_end = mm(v, dST, precision)
    d_dec_end = jnp.sum(ST0 * dST, axis=0, keepdims=True)
    # A_xy = mask * (x_in @ y_out^T)
    d_a_in = mm(dA_ab, t.b_out, precision) + mm(dA_ak, t.k_out, precision)
    d_r_in = mm(dA_rb, t.b_out, precision) + mm(dA_rk, t.k_out, precision)
    d_b_out = mm_tn(dA_ab, t.a_in, precision) + mm_tn(dA_rb, t.r_in, precision)
    d_k_out = mm_tn(dA_ak, t.a_in, precision) + mm_tn(dA_rk, t.r_in, precision)
    dr = d_r_in * t.e_in + d_r0 * t.c_r0
    da = d_a_in * t.e_ex + d_a0 * t.c_a0
    db = d_b_out * t.e_out + d_b_end * t.c_end
    dk = d_k_out * t.e_out + d_k_end * t.c_end
    # log-decay: x = y * exp(+-(g - rho)) gives dg = +-dx * x (rho cancels, treated constant)
    dg = (d_r_in * t.r_in + d_r0 * t.r0 - d_b_out * t.b_out - d_k_out * t.k_out
          - d_b_end * t.b_end - d_k_end * t.k_end)
    dg_ex = d_a_in * t.a_in + d_a0 * t.a0
    dg_end = (jnp.sum(d_b_end * t.b_end + d_k_end * t.k_end, axis=0, keepdims=True)
              + d_dec_end * t.dec_end)
    # g = cumsum(w), g_ex = g - w, g_end = sum(w):
    #   dw_s = sum_{t>=s} (dg + dg_ex)_t - dg_ex_s + dg_end
    row, col = _iota_CC(C)
    upper_f = jnp.where(col >= row, 1.0, 0.0).astype(_F32)
    dw = mm(upper_f, dg + dg_ex, _HIGHEST) - dg_ex + dg_end
    return dr, dw, dk, dv, da, db, dST0
