"""Transposed ("column") form of the per-chunk WKV7 backward for the GPU kernel.

Same math as `gpu_chunk.bwd_values` + `gpu_chunk.bwd_inputs` (see `gpu_chunk`'s docstring for the
notation), but every [C, K] / [C, V] quantity is kept as its transpose X^T [K or V, C]. Why: a
Triton dot lowers to Hopper's warpgroup MMA (wgmma: operands read from shared memory,
accumulator spread over a warpgroup) only when its row count M is a multiple of 64. In the row
form at C = 32 almost every dot has M = C = 32 and falls back to mma.sync, whose layout gives
every warp a full copy of the left operand: 255 registers per thread, one 8-warp program per
SM (ptxas report, benchmarks/NOTES-wkv7.md). In the column form the 20 dots that produce
[K, C] / [V, C] tiles have M = 64 (wgmma); only the 7 [C, C] products keep M = C.

Shapes (one chunk of one head, float32 register tiles): xT [K, C] for x in r, w, k, a, b;
vT, dOT, UT, dXT [V, C]; S0, dSC [K, V]; inv, A_*, dA_* [C, C]; per-key columns [K, 1].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lwm_jax.kernels.wkv7.gpu_chunk import _masks, mm, mm_nt, mm_tn

_F32 = jnp.float32


def _cols(xT, mT):
    return xT if mT is None else xT * mT


def intra_backward_t(ld, st, n, prec):
    """Input gradients of one chunk (dr, dw, dk, dv, da, db), computed in transposed form.

    Args:
      ld: ld(name) -> float32 tile: "r", "w", "k", "a", "b" [C, K], "v", "dO" [C, V] (row form,
        transposed here), "inv" [C, C], "S0", "dSC" [K, V]. Called again where a tile is needed
        late: a reload (an L2 hit) is cheaper than a tile kept live in registers and shared
        memory across the whole program.
      st: st(name, value) stores a gradient given in row form [C, K] / [C, V].
      n: int32 [C] reset counter, or None.
      prec: matmul precision.

    Phases (each drops its [K, V] / [V, C] tiles before the next): U^T; dX^T; the dSC terms;
    the S0 terms; the four [C, C] cotangents; the key-side gradients.
    """
    C = ld("r").shape[0]
    ldT = lambda name: ld(name).T
    wT = ldT("w")
    gT = jnp.cumsum(wT, axis=1)
    gCT = jnp.sum(wT, axis=1, keepdims=True)
    strict, incl, m0, m_end, keep0 = _masks(C, n)
    m0T = None if m0 is None else m0.T            # [1, C]
    m_endT = None if m_end is None else m_end.T
    e_gxT = lambda: jnp.exp(gT - ldT("w"))
    e_negT = lambda: jnp.exp(-gT)
    e_endT = lambda: jnp.exp(gCT - gT)
    atT = lambda: ldT("a") * e_gxT()
    rtT = lambda: ldT("r") * jnp.exp(gT)
    khT = lambda: ldT("k") * e_negT()
    bhT = lambda: ldT("b") * e_negT()
    # U^T = (inv (at S0 + A_ak V))^T
    A_ak = jnp.where(strict, mm_tn(atT(), khT(), prec), 0.0)
    UT = mm_nt(mm_tn(ld("S0"), _cols(atT(), m0T), prec) + mm_nt(ldT("v"), A_ak, prec),
               ld("inv"), prec)
    # dU^T = (A_rb^T dO + bt dSC)^T ; dX^T = (inv^T dU)^T = dU^T inv
    A_rb = jnp.where(incl, mm_tn(rtT(), bhT(), prec), 0.0)
    dXT = mm(mm(ldT("dO"), A_rb, prec)
             + mm_tn(ld("dSC"), _cols(ldT("b") * e_endT(), m_endT), prec), ld("inv"), prec)
    # Every term with dSC: dv, and the gradients of kt = k e^{gC-g}, bt = b e^{gC-g}.
    A_rk = jnp.where(incl, mm_tn(rtT(), khT(), prec), 0.0)
    dSC = ld("dSC")
    dvT = (mm(ldT("dO"), A_rk, prec) + mm(dXT, A_ak, prec)
           + mm_tn(dSC, _cols(ldT("k") * e_endT(), m_endT), prec))
    st("dv", dvT.T)
    dk_endT = _cols(mm(dSC, ldT("v"), prec), m_endT) * e_endT()
    db_endT = _cols(mm(dSC, UT, prec), m_endT) * e_endT()
    dgC = jnp.sum(dk_endT * ldT("k") + db_endT * ldT("b"), axis=1, keepdims=True)   # [K, 1]
    S0 = ld("S0")
    state_term = jnp.sum(S0 * dSC, axis=1, keepdims=True) * jnp.exp(gCT)
    dgC = dgC + (state_term if keep0 is None else state_term * keep0)
    # The S0 terms, then the [C, C] cotangents.
    d_atT = _cols(mm(S0, dXT, prec), m0T)
    d_rtT = _cols(mm(S0, ldT("dO"), prec), m0T)
    dA_ak = jnp.where(strict, mm_tn(dXT, ldT("v"), prec), 0.0)
    dA_ab = jnp.where(strict, mm_tn(dXT, UT, prec), 0.0)
    dA_rk = jnp.where(incl, mm_tn(ldT("dO"), ldT("v"), prec), 0.0)
    dA_rb = jnp.where(incl, mm_tn(ldT("dO"), UT, prec), 0.0)
    kh, bh = khT(), bhT()
    daT = (d_atT + mm_nt(kh, dA_ak, prec) + mm_nt(bh, dA_ab, prec)) * e_gxT()
    st("da", daT.T)
    drT = (d_rtT + mm_nt(kh, dA_rk, prec) + mm_nt(bh, dA_rb, prec)) * jnp.exp(gT)
    st("dr", drT.T)
    at, rt = atT(), rtT()
    dkT = (mm(at, dA_ak, prec) + mm(rt, dA_rk, prec)) * e_negT() + dk_endT
    st("dk", dkT.T)
    dbT = (mm(at, dA_ab, prec) + mm(rt, dA_rb, prec)) * e_negT() + db_endT
    st("db", dbT.T)
    dgT = drT * ldT("r") - dkT * ldT("k") - dbT * ldT("b")
    yT = dgT + daT * ldT("a")
    dwT = jnp.sum(yT, axis=1, keepdims=True) - jnp.cumsum(yT, axis=1) + dgT + dgC
    st("dw", dwT.T)


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
    causal (index mod C), same document; and the column masks [1, 2C] (see gpu_chunk._masks)."""
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


def intra_backward_s(ld, st, n, prec):
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
      [d_at^T | d_rt^T] = S0 Z + Kb dAmat^T;  [d_kh^T | d_bh^T] = P dAmat;  [d_kt^T | d_bt^T] = dSC Y

    Args as `intra_backward_t`.
    """
    C = ld("r").shape[0]
    ldT = lambda name: ld(name).T
    causal, m0, m_end, keep0 = _masks2(C, n)
    wT = ldT("w")
    gT = jnp.cumsum(wT, axis=1)
    gCT = jnp.sum(wT, axis=1, keepdims=True)                    # [K, 1]
    g2 = hcat(gT, gT)
    ew2 = lambda: hcat(jnp.exp(-ldT("w")), jnp.ones_like(wT))   # at = a e^{-w} e^{g}
    # P, Kb, S0 are rebuilt / reloaded for their late uses: a tile kept from the first use to
    # the last holds registers and a shared-memory operand copy all the way.
    P_ = lambda: hcat(ldT("a"), ldT("r")) * ew2() * jnp.exp(g2)
    Kb_ = lambda: hcat(ldT("k"), ldT("b")) * jnp.exp(-g2)
    half = jax.lax.broadcasted_iota(jnp.int32, (1, 2 * C), 1) < C   # [1, 2C]: left half
    rows2 = jax.lax.broadcasted_iota(jnp.int32, (2 * C, 2 * C), 0)
    cols2 = jax.lax.broadcasted_iota(jnp.int32, (2 * C, 2 * C), 1)

    def inv2_():  # [[0, 0], [inv, 0]]
        x = hcat(ld("inv"), ld("inv"))
        x = jnp.transpose(hcat(jnp.transpose(x), jnp.transpose(x)))   # [[inv, inv], [inv, inv]]
        return jnp.where((rows2 >= C) & (cols2 < C), x, 0.0)
    Amat = jnp.where(causal, mm_tn(P_(), Kb_(), prec), 0.0)
    V0 = jnp.where(half, hcat(ldT("v"), ldT("v")), 0.0)         # [v^T | 0]
    R = mm_tn(ld("S0"), _cols(P_(), m0), prec) + mm_nt(V0, Amat, prec)
    Y = V0 + mm_nt(R, inv2_(), prec)                               # [v^T | U^T]
    O0 = jnp.where(half, 0.0, hcat(ldT("dO"), ldT("dO")))       # [0 | dO^T]
    E = _cols(Kb_() * jnp.exp(gCT), m_end)
    W = mm_tn(ld("dSC"), E, prec)
    Z = O0 + mm(W + mm(O0, Amat, prec), inv2_(), prec)             # [dX^T | dO^T]
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
    dkT, dbT = hsplit(mm(P_(), dAmat, prec) * jnp.exp(-g2) + dEnd * jnp.exp(gCT - g2))
    st("dk", dkT.T)
    st("db", dbT.T)
    dgT = drT * ldT("r") - dkT * ldT("k") - dbT * ldT("b")
    yT = dgT + daT * ldT("a")
    dwT = jnp.sum(yT, axis=1, keepdims=True) - jnp.cumsum(yT, axis=1) + dgT + dgC
    st("dw", dwT.T)
