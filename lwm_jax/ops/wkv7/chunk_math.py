"""Intra-chunk algebra of the chunk-parallel WKV7 (everything one chunk needs, batched, float32).

Notation for one chunk of C tokens and one head (S_0 = state before the chunk, positions 1..C):

    S_t = D_t S_{t-1} + b_t u_t + k_t v_t^T,  u_t = a_t^T S_{t-1} (row in R^V),  D_t = diag(e^{w_t})
    g_t = w_1 + ... + w_t  (per key channel),  decay from s to t:  e^{g_t - g_s}  (<= 1 for s <= t)

Unrolling, with strictly lower / lower triangular C x C matrices

    A_ab[t,s] = sum_k a_t e^{g_{t-1} - g_s} b_s  (s < t),   A_ak[t,s]: same with k_s
    A_rb[t,s] = sum_k r_t e^{g_t - g_s} b_s      (s <= t),  A_rk[t,s]: same with k_s

the rows u_t solve the unit lower triangular system (the WY / forward-substitution step)

    (I - A_ab) U = A_ak V + (a * e^{g_{t-1}}) S_0            ->  U = W S_0 + U_v
    O = (r * e^{g_t}) S_0 + A_rb U + A_rk V                  ->  O = Q S_0 + O_intra
    S_C = diag(e^{g_C}) S_0 + sum_s e^{g_C - g_s} (b_s u_s + k_s v_s^T)   ->  S_C = M S_0 + S_intra

so the sequential part across chunks is only `S <- M S + S_intra` (done by the caller).

Overflow and precision: every exponent used is a sum of log-decays over a forward interval, so it
is <= 0 (for w <= 0) and never overflows, for any w and chunk size. The chunk is cut into
sub-blocks of at most 16 tokens; exponents are built from sums local to a sub-block plus whole
sub-block totals, never as a difference of two long chunk-wide cumsums, so their absolute rounding
error scales with the interval they cover. Pairs inside one sub-block use the exact pairwise
decay tensor [c, c, K]; a pair (t, s) with s in an earlier sub-block factors its decay at the
start of t's sub-block, e^{x} e^{y} with x, y <= 0, which turns it into a plain matmul.
Packed documents: pairs from different documents and the S_0 path past a reset are removed with
exact 0/1 masks (`same_ts`, `m0`, `m_end`); nothing relies on large negative numbers.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lwm_jax.ops.wkv7 import tril_inverse

_HIGHEST = jax.lax.Precision.HIGHEST
MAX_SUB_BLOCK = 16


def unit_lower_inverse(A_CC, precision=_HIGHEST):
    """`(I - A)^{-1}` for strictly lower triangular `A` `[..., C, C]` (float32), by matmuls only:
    the blocked form of `lwm_jax.ops.wkv7.tril_inverse` (see there for why not a plain doubling
    product), in IEEE fp32. Matmuls instead of a LAPACK triangular solve: the same algebra as
    the Pallas kernels, and no LAPACK custom call on CPU (whose batched form can deadlock
    XLA:CPU's intra-op pool on small machines).
    """
    return tril_inverse.unit_lower_inverse(
        A_CC, lambda x, y: product("...ij,...jk->...ik", x, y, precision=precision))


def sub_block_size(chunk_size: int) -> int:
    """Largest divisor of `chunk_size` that is at most `MAX_SUB_BLOCK`."""
    return max(d for d in range(1, min(chunk_size, MAX_SUB_BLOCK) + 1) if chunk_size % d == 0)


@dataclasses.dataclass(frozen=True)
class RoundedOperands:
    """A product precision for modelling, not speed: both operands rounded to `mantissa_bits`
    explicit bits (`lax.reduce_precision`), then an IEEE float32 product. With 10 bits it is what
    a TF32 tensor core computes, on any backend (the precision report's floor for the GPU
    kernel's `high` products)."""

    mantissa_bits: int


def product(spec, *xs, precision=_HIGHEST):
    """`einsum` with float32 accumulation at `precision` (a `lax.Precision` or a
    `RoundedOperands`)."""
    if isinstance(precision, RoundedOperands):
        xs = tuple(jax.lax.reduce_precision(x, exponent_bits=8,
                                            mantissa_bits=precision.mantissa_bits) for x in xs)
        precision = _HIGHEST
    return jnp.einsum(spec, *xs, precision=precision, preferred_element_type=jnp.float32)



def _interval_sums(x, rel):
    """Sums of `x [..., n, K]` along axis -2 over intervals, as a matmul with a 0/1 matrix.

    `rel(t, s)` says whether entry s enters output t: `t >= s` gives the inclusive prefix sum,
    `t > s` the exclusive one, `s > t` the exclusive suffix sum. Used instead of cumsum, pads and
    concatenates: the lengths here are at most 16 sub-block tokens or the number of sub-blocks,
    and XLA GPU (jax 0.11) failed to emit some fused concatenate / pad forms of these shifts.
    """
    idx = jnp.arange(x.shape[-2])
    return product("ts,...sk->...tk", rel(idx[:, None], idx[None, :]).astype(jnp.float32), x)


_INC = lambda t, s: t >= s
_EXC = lambda t, s: t > s
_AFTER = lambda t, s: s > t


def _log_decay_sums(w_NCK):
    """Interval sums of log-decays for sub-blocks `w [..., nb, c, K]`.

    Returns a dict of arrays (all <= 0 for w <= 0):
      inc [..., nb, c, K]: sum of w from the sub-block start to t inclusive.
      exc: same, exclusive of t.
      after [..., nb, c, K]: sum of w over (s, end of sub-block].
      before_blk [..., nb, K]: sum of w over all earlier sub-blocks of the chunk.
      after_blk [..., nb, K]: sum of w over all later sub-blocks.
      total [..., K]: sum over the whole chunk.
      between [..., nb, nb, K] or None: [i, j] = sum over sub-blocks strictly between j and i.
    """
    nb = w_NCK.shape[-3]
    tot_blk = jnp.sum(w_NCK, axis=-2)
    sums = {
        "inc": _interval_sums(w_NCK, _INC),
        "exc": _interval_sums(w_NCK, _EXC),
        "after": _interval_sums(w_NCK, _AFTER),
        "before_blk": _interval_sums(tot_blk, _EXC),
        "after_blk": _interval_sums(tot_blk, _AFTER),
        "total": jnp.sum(tot_blk, axis=-2),
        "between": None,
    }
    if nb > 1:
        idx = jnp.arange(nb)
        strictly_between = ((idx[None, :, None] < idx[None, None, :])
                            & (idx[None, None, :] < idx[:, None, None]))  # [i, j, m]
        sums["between"] = product("ijm,...mk->...ijk", strictly_between.astype(jnp.float32), tot_blk)
    return sums


def _earlier_block_decays(sums):
    """`[..., nb_i, C, K]`: e^{(sum of w over (s, start of sub-block i))} for s in sub-blocks j < i.

    Entry [i, s] is the decay from token s to the end of sub-block i - 1 (all factors <= 1);
    entries with j >= i are 1 and must be masked by the caller. None when there is one sub-block.
    """
    if sums["between"] is None:
        return None
    *batch, nb, c, K = sums["after"].shape
    blk = jnp.arange(nb)
    earlier_IJ = blk[:, None] > blk[None, :]
    expo_IJSK = sums["after"][..., None, :, :, :] + sums["between"][..., :, :, None, :]
    expo_IJSK = jnp.where(earlier_IJ[:, :, None, None], expo_IJSK, 0.0)  # masked: safe grads
    return jnp.exp(expo_IJSK).reshape(*batch, nb, nb * c, K)


def _pair_products(x_NCK, ys, x_log, sums, earlier_decay, strict, precision):
    """`P[..., t, s] = sum_k x_t e^{G(t, s)} y_s` over pairs s < t (strict) or s <= t, else 0.

    G(t, s) is the sum of w over (s, t - 1] (strict) or (s, t] (not strict).

    Args:
      x_NCK: left vectors as sub-blocks `[..., nb, c, K]`; ys: tuple of right vectors, same shape.
      x_log: `sums["exc"]` (strict: the interval ends at t-1) or `sums["inc"]` (ends at t).
      sums: output of `_log_decay_sums`; earlier_decay: output of `_earlier_block_decays`.
    Returns:
      tuple (one per y) of `[..., C, C]` float32 matrices.
    """
    *batch, nb, c, K = x_NCK.shape
    C = nb * c
    t_idx = jnp.arange(c)
    tri = (t_idx[:, None] > t_idx[None, :]) if strict else (t_idx[:, None] >= t_idx[None, :])
    # Same sub-block: exact pairwise decays, exponent masked to 0 outside the triangle (safe grads).
    diff_NTSK = x_log[..., :, :, None, :] - sums["inc"][..., :, None, :, :]
    xdec_NTSK = x_NCK[..., :, :, None, :] * jnp.exp(jnp.where(tri[:, :, None], diff_NTSK, 0.0))
    diag = [jnp.where(tri, product("...tsk,...sk->...ts", xdec_NTSK, y, precision=precision), 0.0)
            for y in ys]
    if nb == 1:
        return tuple(d.reshape(*batch, C, C) for d in diag)
    # Earlier sub-block j < i: decay = e^{x_log_t} (within block i) * earlier_decay[i, s].
    x_left = x_NCK * jnp.exp(x_log)
    blk = jnp.arange(nb)
    earlier = (blk[:, None] > blk[None, :])[:, None, :, None]                    # [i, 1, j, 1]
    same_blk = (blk[:, None] == blk[None, :])[:, None, :, None]
    out = []
    for y, d in zip(ys, diag):
        y_right = y.reshape(*batch, 1, C, K) * earlier_decay                      # [.., i, s, K]
        off_ITJS = product("...itk,...isk->...its", x_left, y_right,
                       precision=precision).reshape(*batch, nb, c, nb, c)
        full_ITJS = jnp.where(same_blk, d[..., :, :, None, :],
                              jnp.where(earlier, off_ITJS, 0.0))
        out.append(full_ITJS.reshape(*batch, C, C))
    return tuple(out)


def chunk_terms(r, w, k, v, a, b, masks, sub_block, precision=_HIGHEST):
    """Per-chunk quantities of the chunk-parallel WKV7, batched over leading dims.

    Args:
      r, w, k, a, b: float32 `[..., C, K]` (one chunk per leading index); v: float32 `[..., C, V]`.
      masks: None (no resets) or a tuple of bool arrays broadcastable to the leading dims:
        same_ts `[..., C, C]` (t and s in one document), m0 `[..., C]` (t still sees S_0),
        m_end `[..., C]` (s is in the chunk's last document).
      sub_block: sub-block length c (divides C).
      precision: `jax.lax.Precision` of the products of the inputs (the WKV matmul precision);
        the interval sums of the log-decays are always HIGHEST (exact fp32 on every backend).

    Returns:
      Q `[..., C, K]`, O_intra `[..., C, V]`, M `[..., K, K]`, S_intra `[..., K, V]` with
      `o = Q S_0 + O_intra` and `S_end = M S_0 + S_intra` for the chunk's start state S_0 [K, V].
    """
    *batch, C, K = r.shape
    nb = C // sub_block
    to_blk = lambda x: x.reshape(*batch, nb, sub_block, x.shape[-1])
    to_seq = lambda x: x.reshape(*batch, C, x.shape[-1])
    r_b, k_b, a_b, b_b = (to_blk(x) for x in (r, k, a, b))
    sums = _log_decay_sums(to_blk(w))

    earlier = _earlier_block_decays(sums)
    A_ab, A_ak = _pair_products(a_b, (b_b, k_b), sums["exc"], sums, earlier, True, precision)
    A_rb, A_rk = _pair_products(r_b, (b_b, k_b), sums["inc"], sums, earlier, False, precision)
    a_dec = to_seq(a_b * jnp.exp(sums["before_blk"][..., :, None, :] + sums["exc"]))
    r_dec = to_seq(r_b * jnp.exp(sums["before_blk"][..., :, None, :] + sums["inc"]))
    to_end = to_seq(jnp.exp(sums["after"] + sums["after_blk"][..., :, None, :]))
    decay_all_K = jnp.exp(sums["total"])
    if masks is not None:
        same_ts, m0, m_end = masks
        A_ab, A_ak, A_rb, A_rk = (jnp.where(same_ts, x, 0.0) for x in (A_ab, A_ak, A_rb, A_rk))
        a_dec = jnp.where(m0[..., None], a_dec, 0.0)
        r_dec = jnp.where(m0[..., None], r_dec, 0.0)
        to_end = jnp.where(m_end[..., None], to_end, 0.0)
        decay_all_K = jnp.where(m0[..., -1:], decay_all_K, 0.0)

    # U = W S_0 + U_v from the unit lower triangular system (I - A_ab) U = rhs.
    mm = lambda spec, x, y: product(spec, x, y, precision=precision)  # noqa: E731
    inv_CC = unit_lower_inverse(A_ab, precision)
    W_CK = mm("...ts,...sk->...tk", inv_CC, a_dec)
    Uv_CV = mm("...ts,...sv->...tv", inv_CC, mm("...ts,...sv->...tv", A_ak, v))

    Q_CK = r_dec + mm("...ts,...sk->...tk", A_rb, W_CK)
    O_CV = mm("...ts,...sv->...tv", A_rb, Uv_CV) + mm("...ts,...sv->...tv", A_rk, v)
    b_end, k_end = b * to_end, k * to_end
    M_KK = decay_all_K[..., :, None] * jnp.eye(K, dtype=jnp.float32) + mm(
        "...sk,...sj->...kj", b_end, W_CK)
    S_KV = mm("...sk,...sv->...kv", b_end, Uv_CV) + mm("...sk,...sv->...kv", k_end, v)
    return Q_CK, O_CV, M_KK, S_KV
