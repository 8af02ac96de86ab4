"""Per-chunk WKV7 tile algebra used inside the GPU (Pallas-Triton) kernels.

Everything here works on one chunk of one head, as float32 register tiles, and uses only
operations the Pallas-Triton lowering supports (2-D dots, forward `cumsum`, `exp`, `where`,
`iota`, row/column reductions). The same functions run unchanged in interpret mode on CPU.

Notation for a chunk of C tokens (positions i = 0..C-1), S0 = state before the chunk [K, V]:

    g_i  = w_0 + ... + w_i (inclusive cumsum, per key channel), gx_i = g_i - w_i (exclusive),
    gC   = g_{C-1} (whole-chunk log decay)
    at = a e^{gx},  rt = r e^{g},  kh = k e^{-g},  bh = b e^{-g},  kt = k e^{gC-g},  bt = b e^{gC-g}
    A_ab = strict(at bh^T), A_ak = strict(at kh^T), A_rb = incl(rt bh^T), A_rk = incl(rt kh^T)

The rows u_i = a_i^T S_{i-1} solve (I - A_ab) U = at S0 + A_ak V; with inv = (I - A_ab)^{-1},

    Wm = inv at,  U0 = inv A_ak V,  U = Wm S0 + U0
    O   = Q S0 + O0,  Q = rt + A_rb Wm,  O0 = A_rk V + A_rb U0
    S_C = M S0 + D,   M = diag(e^{gC}) + bt^T Wm,  D = kt^T V + bt^T U0

so chunks only talk through the affine map S <- M S + D (the sequential kernels).

Exponent range: at, rt, kt, bt carry factors <= 1, but kh and bh carry e^{-g_i} >= 1. The kernel
therefore needs -(sum of w over one chunk) < ~80 (fp32 exp overflows near e^88): with RWKV-7's
w in (-exp(-0.5), 0) that is at most 38.8 for C = 64. Products at kh^T are e^{gx_i - g_j} <= 1
on the kept (causal) entries; masked entries stay finite and are zeroed with `where`.

Packed documents: `n` is an int32 [C] counter of resets inside the chunk (0 = same document as
S0). Pairs with different counters are masked, rows with n > 0 do not see S0, and only tokens of
the chunk's last document (n == max n) reach S_C; S0 reaches S_C only if the chunk has no reset.

Matmul precision `prec` is a `jax.lax.Precision`: DEFAULT -> TF32 tensor cores on GPU,
HIGHEST -> IEEE fp32 (exact mode). Accumulation is always fp32.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from lwm_jax.ops.wkv7 import tril_inverse
from lwm_jax.ops.wkv7.tile_dots import mm, mm_nt, mm_tn

_F32 = jnp.float32


def _masks(C, n):
    """Causal masks [C, C] (strict, inclusive) and, with documents, row masks [C, 1] + flag."""
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    strict, incl = col < row, col <= row
    if n is None:
        return strict, incl, None, None, None
    same = n[:, None] == n[None, :]
    n_last = jnp.max(n)
    m0 = (n == 0).astype(_F32)[:, None]          # row sees S0
    m_end = (n == n_last).astype(_F32)[:, None]  # row reaches S_C
    keep0 = (n_last == 0).astype(_F32)           # S0 reaches S_C
    return strict & same, incl & same, m0, m_end, keep0


def unit_lower_inverse(A, prec):
    """(I - A)^{-1} for strictly lower triangular A [C, C]: the blocked form of
    `lwm_jax.ops.wkv7.tril_inverse` (a plain doubling product lost all accuracy at C >= 32)."""
    return tril_inverse.unit_lower_inverse(A, lambda x, y: mm(x, y, prec))


def _decay(ld):
    """g = inclusive cumsum of w [C, K] and gC = its last row [1, K]."""
    w = ld("w")
    return jnp.cumsum(w, axis=0), jnp.sum(w, axis=0, keepdims=True)


def _rows(x, m):
    return x if m is None else x * m


def intra_forward(ld, st, n, prec):
    """Chunk terms of the affine map S_C = M S0 + D, O = Q S0 + O0 (see module docstring).

    Args:
      ld: ld(name) -> float32 tile, name in "r", "w", "k", "a", "b" ([C, K]) and "v" ([C, V]).
        Called again wherever a tile is needed late (a reload is cheaper than a live tile).
      st: st(name, value) stores an output as soon as it is ready: "inv" [C, C], "Q" [C, K],
        "O0" [C, V], "M" [K, K], "D" [K, V].
      n: int32 [C] reset counter, or None.
      prec: matmul precision.
    """
    C, K = ld("r").shape
    g, gC = _decay(ld)
    strict, incl, m0, m_end, keep0 = _masks(C, n)
    e_neg = jnp.exp(-g)
    at = ld("a") * jnp.exp(g - ld("w"))
    bh = ld("b") * e_neg
    kh = ld("k") * e_neg
    inv = unit_lower_inverse(jnp.where(strict, mm_nt(at, bh, prec), 0.0), prec)
    st("inv", inv)
    A_ak = jnp.where(strict, mm_nt(at, kh, prec), 0.0)
    v = ld("v")
    Wm = mm(inv, _rows(at, m0), prec)
    U0 = mm(inv, mm(A_ak, v, prec), prec)
    rt = ld("r") * jnp.exp(g)
    A_rb = jnp.where(incl, mm_nt(rt, bh, prec), 0.0)
    A_rk = jnp.where(incl, mm_nt(rt, kh, prec), 0.0)
    st("Q", _rows(rt, m0) + mm(A_rb, Wm, prec))
    st("O0", mm(A_rk, v, prec) + mm(A_rb, U0, prec))
    e_end = jnp.exp(gC - g)
    btL = _rows(ld("b") * e_end, m_end)
    ktL = _rows(ld("k") * e_end, m_end)
    eye = (jax.lax.broadcasted_iota(jnp.int32, (K, K), 0)
           == jax.lax.broadcasted_iota(jnp.int32, (K, K), 1))
    decay = jnp.exp(gC) if keep0 is None else jnp.exp(gC) * keep0
    st("M", jnp.where(eye, decay, 0.0) + mm_tn(btL, Wm, prec))
    st("D", mm_tn(ktL, v, prec) + mm_tn(btL, U0, prec))


def bwd_values(ld, st, n, prec):
    """Backward stage 1 of one chunk: U (the rows a_i^T S_{i-1}), dX = (I - A_ab)^{-T} dU, dv.

    ld: as in `intra_forward`, plus "inv" [C, C] (from the forward), "S0" (state before the
    chunk [K, V]), "dSC" (cotangent of the state after it [K, V]) and "dO" ([C, V]).
    st: receives "U" [C, V], "dX" [C, V] and "dv" [C, V] (float32).
    """
    C, K = ld("r").shape
    g, gC = _decay(ld)
    strict, incl, m0, m_end, _ = _masks(C, n)
    e_neg = jnp.exp(-g)
    at = ld("a") * jnp.exp(g - ld("w"))
    kh = ld("k") * e_neg
    A_ak = jnp.where(strict, mm_nt(at, kh, prec), 0.0)
    v = ld("v")
    U = mm(ld("inv"), mm(_rows(at, m0), ld("S0"), prec) + mm(A_ak, v, prec), prec)
    st("U", U)
    rt = ld("r") * jnp.exp(g)
    A_rb = jnp.where(incl, mm_nt(rt, ld("b") * e_neg, prec), 0.0)
    dO, dSC = ld("dO"), ld("dSC")
    e_end = jnp.exp(gC - g)
    dU = mm_tn(A_rb, dO, prec) + mm(_rows(ld("b") * e_end, m_end), dSC, prec)
    dX = mm_tn(ld("inv"), dU, prec)
    st("dX", dX)
    A_rk = jnp.where(incl, mm_nt(rt, kh, prec), 0.0)
    ktL = _rows(ld("k") * e_end, m_end)
    st("dv", mm_tn(A_rk, dO, prec) + mm_tn(A_ak, dX, prec) + mm(ktL, dSC, prec))


def bwd_inputs(ld, st, n, prec):
    """Backward stage 2 of one chunk: dr, dw, dk, da, db from U and dX of stage 1.

    ld: as in `bwd_values` plus "U" and "dX". st: receives "dr", "dw", "dk", "da", "db".
    The log-decay gradient uses dL/dg = dr*r - dk*k - db*b (w.r.t. the inclusive cumsum),
    da*a (exclusive cumsum) and the chunk-total terms.
    """
    C, K = ld("r").shape
    g, gC = _decay(ld)
    strict, incl, m0, m_end, keep0 = _masks(C, n)
    v, U, dX, dO, S0, dSC = ld("v"), ld("U"), ld("dX"), ld("dO"), ld("S0"), ld("dSC")
    # Everything that touches the [K, V] tiles first, so that they die early.
    e_end = jnp.exp(gC - g)
    dk_end = _rows(mm_nt(v, dSC, prec), m_end) * e_end   # through kt = k e^{gC-g}
    db_end = _rows(mm_nt(U, dSC, prec), m_end) * e_end   # through bt = b e^{gC-g}
    dgC = jnp.sum(dk_end * ld("k") + db_end * ld("b"), axis=0, keepdims=True)
    state_term = jnp.sum(S0 * dSC, axis=1)[None, :] * jnp.exp(gC)
    dgC = dgC + (state_term if keep0 is None else state_term * keep0)
    d_at = _rows(mm_nt(dX, S0, prec), m0)
    d_rt = _rows(mm_nt(dO, S0, prec), m0)
    dA_ak = jnp.where(strict, mm_nt(dX, v, prec), 0.0)
    dA_rk = jnp.where(incl, mm_nt(dO, v, prec), 0.0)
    dA_ab = jnp.where(strict, mm_nt(dX, U, prec), 0.0)
    dA_rb = jnp.where(incl, mm_nt(dO, U, prec), 0.0)
    e_neg = jnp.exp(-g)
    kh = ld("k") * e_neg
    bh = ld("b") * e_neg
    d_at = d_at + mm(dA_ak, kh, prec) + mm(dA_ab, bh, prec)
    d_rt = d_rt + mm(dA_rk, kh, prec) + mm(dA_rb, bh, prec)
    da = d_at * jnp.exp(g - ld("w"))
    st("da", da)
    dr = d_rt * jnp.exp(g)
    st("dr", dr)
    at = ld("a") * jnp.exp(g - ld("w"))
    rt = ld("r") * jnp.exp(g)
    dk = (mm_tn(dA_ak, at, prec) + mm_tn(dA_rk, rt, prec)) * e_neg + dk_end
    st("dk", dk)
    db = (mm_tn(dA_ab, at, prec) + mm_tn(dA_rb, rt, prec)) * e_neg + db_end
    st("db", db)
    dg = dr * ld("r") - dk * ld("k") - db * ld("b")
    y = dg + da * ld("a")
    st("dw", jnp.sum(y, axis=0, keepdims=True) - jnp.cumsum(y, axis=0) + dg + dgC)


def intra_backward(ld, st, n, prec):
    """Both backward stages in one program (U and dX stay in registers).

    dS0 = M^T dSC + Q^T dO is left to the sequential kernel.
    """
    local = {}

    def st1(name, value):
        if name in ("U", "dX"):
            local[name] = value
        else:
            st(name, value)
    bwd_values(ld, st1, n, prec)
    bwd_inputs(lambda name: local[name] if name in local else ld(name), st, n, prec)
