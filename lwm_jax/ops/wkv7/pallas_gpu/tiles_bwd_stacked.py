"""Stacked, transposed form of the per-chunk WKV7 backward (the GPU kernel's default at C <= 32).

Same math as `tiles.bwd_values` + `tiles.bwd_inputs` (notation in `tiles`'
docstring), arranged so that every dot is a 64 x 64 x 64 product at C = 32, K = V = 64:

* transposed: each [C, K] / [C, V] quantity is kept as its transpose x^T [K or V, C];
* stacked: the two halves of the chunk algebra that always travel together are concatenated
  along the C axis, e.g. P = [at^T | rt^T] [K, 2C], so the four [C, C] factors are one
  [2C, 2C] product Amat = [[A_ak, A_ab], [A_rk, A_rb]] and the four [C, C] cotangents another.

Why: a Triton dot lowers to Hopper's warpgroup MMA (wgmma: operands from shared memory,
accumulator spread over a warpgroup) only when its row count M is a multiple of 64. In the row
form at C = 32 every dot has M = 32 and falls back to mma.sync with a warp layout that gives
each warp a full copy of the left operand (ptxas: 255 registers per thread at 8 warps, one
program per SM). The stacked form issues 13 wgmma products at 4 warps, two programs per SM on
an H100 (register-bound; `benchmarks/wkv7.py ptxas` and Nsight Compute show it); the register
counts and the measured gains are in benchmarks/NOTES-wkv7.md.

Block tricks that keep everything in 2C-wide tiles (| = column concatenation):
  [v^T | 0] Amat^T = [(A_ak V)^T | (A_rk V)^T]; with Inv2 = [[0, 0], [inv, 0]],
  R Inv2^T = [0 | R_left inv^T] and H Inv2 = [H_right inv | 0]; multiplying by exact zeros keeps
  the v / dO halves exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lwm_jax.ops.wkv7.tile_dots import mm, mm_nt, mm_tn

_F32 = jnp.float32


def _cols(xT, mT):
    return xT if mT is None else xT * mT


def hcat(x, y):
    """[R, C] and [R, C] -> [R, 2C] (x in columns 0..C-1, y in C..2C-1).

    The Pallas-Triton lowering has no general concatenate; stack (a Triton join) + transpose +
    reshape builds the same tile."""
    R, C = x.shape
    return jnp.transpose(jnp.stack([x, y], axis=-1), (0, 2, 1)).reshape(R, 2 * C)


def hsplit(x):
    """[R, 2C] -> ([R, C], [R, C]): columns 0..C-1 and C..2C-1."""
    left, right = jnp.split(x, 2, axis=1)
    return left, right


def _masks2(C, n):
    """Masks for the stacked [2C, 2C] products: rows 0..C-1 strict, rows C..2C-1 inclusive
    causal (index mod C), same document; and the column masks [1, 2C] (see tiles._masks)."""
    row = jax.lax.broadcasted_iota(jnp.int32, (2 * C, 2 * C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (2 * C, 2 * C), 1)
    i, j = row & (C - 1), col & (C - 1)
    causal = jnp.where(row < C, j < i, j <= i)
    if n is None:
        return causal, None, None, None
    n2 = hcat(n[None, :], n[None, :])                       # [1, 2C]
    n_last = jnp.max(n)
    causal = causal & (jnp.transpose(n2) == n2)
    m0 = (n2 == 0).astype(_F32)
    m_end = (n2 == n_last).astype(_F32)
    return causal, m0, m_end, (n_last == 0).astype(_F32)


def intra_backward_stacked(ld, st, n, prec):
    """Input gradients of one chunk in transposed *and* stacked form (every dot 64 x 64 x 64 at
    C = 32, K = V = 64, all on wgmma).

    Stacked tiles (x^T denotes the transposed [K or V, C] tile, | a column concatenation):
      P = [at^T | rt^T], Kb = [kh^T | bh^T], E = [kt^T | bt^T] = Kb e^{gC}   [K, 2C]
      Amat = P^T Kb = [[A_ak, A_ab], [A_rk, A_rb]] (masked)                 [2C, 2C]
      Inv2 = [[0, 0], [inv, 0]]                                            [2C, 2C]
      R = S0^T P + [v^T | 0] Amat^T   (left half: (at S0 + A_ak V)^T)       [V, 2C]
      Y = [v^T | 0] + R Inv2^T = [v^T | U^T]
      W = dSC^T E,  H = W + [0 | dO^T] Amat   (right half: dU^T)
      Z = [0 | dO^T] + H Inv2 = [dX^T | dO^T]
      dV^T = left half of (Z Amat + W);  dAmat = Z^T Y (masked)
      [d_at^T | d_rt^T] = S0 Z + Kb dAmat^T;  [d_kh^T | d_bh^T] = P dAmat
      [d_kt^T | d_bt^T] = dSC Y

    Args:
      ld: ld(name) -> float32 tile: "r", "w", "k", "a", "b" [C, K], "v", "dO" [C, V] (row form,
        transposed here), "inv" [C, C], "S0", "dSC" [K, V]. Called again where a tile is needed
        late: a reload (an L2 hit) is cheaper than a tile kept live in registers and shared
        memory (Triton keeps a shared-memory operand copy from a value's definition to its
        last dot).
      st: st(name, value) stores a gradient in row form [C, K] / [C, V].
      n: int32 [C] reset counter, or None.
      prec: matmul precision (TF32 in practice: see `launches.intra_bwd`).
    """
    C = ld("r").shape[0]
    ldT = lambda name: ld(name).T
    causal, m0, m_end, keep0 = _masks2(C, n)
    wT = ldT("w")
    gT = jnp.cumsum(wT, axis=1)
    gCT = jnp.sum(wT, axis=1, keepdims=True)                    # [K, 1]
    g2 = hcat(gT, gT)
    ew2 = lambda: hcat(jnp.exp(-ldT("w")), jnp.ones_like(wT))   # at = a e^{-w} e^{g}
    # P and Inv2 are built once and kept for all their products: XLA's Triton pipeline rounds
    # every float32 dot operand to TF32 (three instructions per element), once per distinct
    # value, so a tile rebuilt for a late use paid its construction and its rounding again
    # (keeping them measured faster per launch at both training shapes; `benchmarks/wkv7.py
    # sweep`, figures in benchmarks/RESULTS-log.md). Kb is rebuilt and S0 reloaded for their late
    # uses (keeping Kb as well measured no faster: registers, spills).
    Kb_ = lambda: hcat(ldT("k"), ldT("b")) * jnp.exp(-g2)
    half = jax.lax.broadcasted_iota(jnp.int32, (1, 2 * C), 1) < C   # [1, 2C]: left half
    rows2 = jax.lax.broadcasted_iota(jnp.int32, (2 * C, 2 * C), 0)
    cols2 = jax.lax.broadcasted_iota(jnp.int32, (2 * C, 2 * C), 1)

    P = hcat(ldT("a"), ldT("r")) * ew2() * jnp.exp(g2)
    inv4 = hcat(ld("inv"), ld("inv"))
    inv4 = jnp.transpose(hcat(jnp.transpose(inv4), jnp.transpose(inv4)))  # all four blocks inv
    Inv2 = jnp.where((rows2 >= C) & (cols2 < C), inv4, 0.0)              # [[0, 0], [inv, 0]]

    Amat = jnp.where(causal, mm_tn(P, Kb_(), prec), 0.0)
    V0 = jnp.where(half, hcat(ldT("v"), ldT("v")), 0.0)         # [v^T | 0]
    R = mm_tn(ld("S0"), _cols(P, m0), prec) + mm_nt(V0, Amat, prec)
    Y = V0 + mm_nt(R, Inv2, prec)                              # [v^T | U^T]
    O0 = jnp.where(half, 0.0, hcat(ldT("dO"), ldT("dO")))       # [0 | dO^T]
    E = _cols(Kb_() * jnp.exp(gCT), m_end)
    W = mm_tn(ld("dSC"), E, prec)
    Z = O0 + mm(W + mm(O0, Amat, prec), Inv2, prec)            # [dX^T | dO^T]
    dvT, _ = hsplit(mm(Z, Amat, prec) + W)
    st("dv", dvT.T)
    dEnd = _cols(mm(ld("dSC"), Y, prec), m_end)                 # [d_kt^T | d_bt^T]
    state_term = jnp.sum(ld("S0") * ld("dSC"), axis=1, keepdims=True) * jnp.exp(gCT)
    dgC = (jnp.sum(dEnd * E, axis=1, keepdims=True)
           + (state_term if keep0 is None else state_term * keep0))          # [K, 1]
    dAmat = jnp.where(causal, mm_tn(Z, Y, prec), 0.0)
    dP = _cols(mm(ld("S0"), Z, prec), m0) + mm_nt(Kb_(), dAmat, prec)   # [d_at^T | d_rt^T]
    daT, drT = hsplit(dP * ew2() * jnp.exp(g2))
    st("da", daT.T)
    st("dr", drT.T)
    dkT, dbT = hsplit(mm(P, dAmat, prec) * jnp.exp(-g2) + dEnd * jnp.exp(gCT - g2))
    st("dk", dkT.T)
    st("db", dbT.T)
    dgT = drT * ldT("r") - dkT * ldT("k") - dbT * ldT("b")
    yT = dgT + daT * ldT("a")
    dwT = jnp.sum(yT, axis=1, keepdims=True) - jnp.cumsum(yT, axis=1) + dgT + dgC
    st("dw", dwT.T)
