"""Chunk-parallel WKV7 forward maps on Pallas Mosaic GPU (phase 1 of the two-phase forward).

    M, D, Q, O0 = chunk_maps(r, w_parts, k, v, a, b, no_auto_barriers=False)

Inputs (padded to Tp = NT * 32 tokens): r, k, v, a, b `[B, Tp, H, 64]` bfloat16 and `w_parts`,
one or two bfloat16 `[B, Tp, H, 64]` arrays whose sum is the log-decay w (`fwd._w_parts`).
Outputs, float32, chunk-major per head (BH = B * H, bh = b * H + h; the layout of the Triton
launches, `pallas_gpu/launches.py`):

    M [BH, NT, 64, 64], D [BH, NT, 64, 64]      S_end = M S_start + D
    Q [BH, NT, 32, 64], O0 [BH, NT, 32, 64]     o = Q S_start + O0   (the chunk's 32 rows)

One CTA (one warpgroup) per (chunk, head, batch): nothing is carried between chunks, so the
grid is B * H * NT CTAs, two per SM (112 KiB of SMEM each). The per-chunk algebra is
`fwd._chunk_terms`'s (bf16x3 products, float32 accumulators, exponents bounded as documented
in fwd.py), reordered by `_lean_terms` (default; `lean=False` runs `_chunk_terms` itself).
SMEM: two 32 KiB unions, inputs [a;r] [b;k] [0;v] [w;0] aliased with the float32 staging of
Q and O0 (written once the inputs are dead), and the p / q bf16 hi-lo operand tiles aliased
with the staging of M and D (written after the last product); plus Ye, X e^{[gx; g]} and PA as
bf16 hi/lo pairs. Outputs leave through TMA.

Measured (H200, 2026-11-27): about 1.35 ms at (B, T, H) = (8, 4096, 12), ~29 us per chunk per
CTA, no faster than the one-CTA-per-head kernel's chunk work. ptxas reports (C7511) "wgmma
instructions are serialized due to insufficient register resources" for both orderings (255
registers with spills for `_chunk_terms`, 232 without spills for `_lean_terms`), so every
product waits for the previous one; removing that serialization is the open problem.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lwm_jax.ops.wkv7.mosaic_gpu.fwd import (CHUNK, DIM, _BF16, _F32, _SHAPE, _WG, _chunk_terms,
                                            _iota, _load, _mm, _mms, _ones_where, _put, _split,
                                            _swizzled, _x3, _x3_pair, pl, plgpu)


def _signed(plus, minus=None):
    """The 0/+-1 bf16 matrix plus - minus (exact): its product with [w; 0] is a difference of
    two cumulative sums of w, formed in one float32 accumulation."""
    x = jnp.where(plus, 1.0, 0.0)
    if minus is not None:
        x = x - jnp.where(minus, 1.0, 0.0)
    return x.astype(_BF16)


def _lean_terms(xs, ys, vs, ws, p_hi, p_lo, q_hi, q_lo, ye_hi, ye_lo, e_hi, e_lo, pa_hi, pa_lo,
                st_q, st_o):
    """`fwd._chunk_terms` reordered for a chunk-parallel CTA whose input tiles stay in SMEM,
    with at most three float32 accumulators and few tiles live at once (ptxas serializes the
    wgmma pipeline when a round needs more than the 255 registers):

    * every exponent is ONE product of a signed 0/+-1 matrix with [w; 0] (differences of
      cumulative sums: piv - g, gC - g, [gx; g] - piv, [gx; g], gC), consumed in its round;
    * PA = [[A_ab, A_ak], [A_rb, A_rk]] and X e^{[gx; g]} = [a e^{gx}; r e^{g}] wait in SMEM as
      bf16 hi/lo pairs (`pa_hi, pa_lo`, `e_hi, e_lo`) instead of registers;
    * r1 = PA [0; V] rides with the last inverse round, gC with the Q / O0 round.

    Stores Q, O0 (rows 32..63 valid) into the float32 tiles `st_q, st_o` (aliasing the input
    tiles, dead by then) and returns the float32 register tiles (M, D).
    """
    row, col = _iota(0), _iota(1)
    rr, cc = row & (CHUNK - 1), col & (CHUNK - 1)
    is_top, first = row < CHUNK, col < CHUNK
    tok = col & (CHUNK - 1)
    incl, piv_m = tok <= rr, tok <= CHUNK // 2 - 1
    left = jnp.where(is_top, tok < rr, incl)    # [gx; g]
    e_p, e_ye = _mms(([(_signed(piv_m, incl), ws)], None), ([(_signed(tok > rr), ws)], None))
    y_f = _load(ys).astype(_F32)                # [b; k]
    _put(y_f * jnp.exp(e_p), p_hi, p_lo)
    _put(y_f * jnp.exp(e_ye), ye_hi, ye_lo)     # [b e^{gC-g}; k e^{gC-g}]
    e_x, e_e = _mms(([(_signed(left, piv_m), ws)], None), ([(_signed(left), ws)], None))
    x_f = _load(xs).astype(_F32)                # [a; r]
    _put(x_f * jnp.exp(e_e), e_hi, e_lo)        # [a e^{gx}; r e^{g}]
    plgpu.commit_smem()
    pa = _mm(_x3(x_f * jnp.exp(e_x), p_hi.T, p_lo.T))
    pa = jnp.where(jnp.where(is_top, rr > cc, rr >= cc), pa, 0.0)
    _put(pa, pa_hi, pa_lo)

    def a_ab():
        return jnp.where(is_top & first, _load(pa_hi).astype(_F32) + _load(pa_lo).astype(_F32),
                         0.0)

    # T = (I - [[A_ab, 0], [0, 0]])^{-1}: 8 x 8 diagonal blocks first
    eye = jnp.where(row == col, 1.0, 0.0)
    d8 = jnp.where(((row >> 3) == (col >> 3)) & is_top & first, pa, 0.0)
    _put(d8, p_hi, p_lo)
    plgpu.commit_smem()
    d2 = _mm(_x3(d8, p_hi, p_lo))                             # D^2
    _put(d2, p_hi, p_lo)
    _put(eye + d8, q_hi, q_lo)
    plgpu.commit_smem()
    d2_hi, d2_lo = _split(d2)
    d4, t2 = _mms((_x3_pair(d2_hi, d2_lo, p_hi, p_lo), None),    # D^4
                  (_x3_pair(d2_hi, d2_lo, q_hi, q_lo), eye + d8))  # (I + D^2)(I + D)
    _put(t2, q_hi, q_lo)
    plgpu.commit_smem()
    inv = _mm(_x3(d4, q_hi, q_lo), init=t2)                      # (I + D^4)(I + D^2)(I + D)
    r1 = None
    for shift in (4, 5):                                         # T <- T + T A_off T
        off = ((row >> shift) == (col >> shift)) & ((row >> (shift - 1)) != (col >> (shift - 1)))
        _put(jnp.where(off, a_ab(), 0.0), p_hi, p_lo)
        _put(inv, q_hi, q_lo)
        plgpu.commit_smem()
        t_off = _mm(_x3(inv, p_hi, p_lo))
        if shift == 4:
            inv = _mm(_x3(t_off, q_hi, q_lo), init=inv)
        else:  # [A_ak V; A_rk V] = PA [0; V] rides with the last round
            inv, r1 = _mms((_x3(t_off, q_hi, q_lo), inv), ([(pa_hi, vs), (pa_lo, vs)], None))

    v_f = _load(vs).astype(_F32)                # [0; v]
    _put(jnp.where(is_top, r1, v_f), q_hi, q_lo)
    plgpu.commit_smem()
    inv_hi, inv_lo = _split(inv)
    wl_hi, wl_lo = _split(jnp.where(is_top & first, inv, 0.0))
    wl, wr = _mms((_x3_pair(wl_hi, wl_lo, e_hi, e_lo), None),    # [Wm; 0]
                  (_x3_pair(inv_hi, inv_lo, q_hi, q_lo), None))  # [U0; V]
    _put(wl, p_hi, p_lo)
    _put(wr, q_hi, q_lo)
    plgpu.commit_smem()
    xe = _load(e_hi).astype(_F32) + _load(e_lo).astype(_F32)
    q_full, o0, g_end = _mms((_x3_pair(pa_hi, pa_lo, p_hi, p_lo), xe),  # rows 32..: Q
                             (_x3_pair(pa_hi, pa_lo, q_hi, q_lo), None),  # rows 32..: O0
                             ([(_signed(tok >= 0), ws)], None))           # gC
    st_q[...] = q_full
    st_o[...] = o0
    diag_m = jnp.where(row == col, jnp.exp(g_end), 0.0)
    return _mms((_x3_pair(ye_hi.T, ye_lo.T, p_hi, p_lo), diag_m),
                (_x3_pair(ye_hi.T, ye_lo.T, q_hi, q_lo), None))


def _make_kernel(B, Tp, H, n_wparts, no_auto_barriers, lean=True):
    NT = Tp // CHUNK
    BH = B * H
    top, bottom = pl.ds(0, CHUNK), pl.ds(CHUNK, CHUNK)

    def body(r_ref, k_ref, v_ref, a_ref, b_ref, *rest):
        w_refs = rest[:n_wparts]
        m_ref, d_ref, q_ref, o0_ref = rest[n_wparts:n_wparts + 4]
        u_in, u_pq, ye_hi, ye_lo, e_hi, e_lo, pa_hi, pa_lo, load_bar = rest[n_wparts + 4:]
        (xs, ys, vs, ws), (st_q, st_o) = u_in
        (p_hi, p_lo, q_hi, q_lo), (st_m, st_d) = u_pq
        c, hi, bi = lax.axis_index("c"), lax.axis_index("h"), lax.axis_index("b")
        bh = bi * H + hi
        tok = pl.ds(c * CHUNK, CHUNK)
        # the halves no TMA copy writes stay zero: [0; v] and, for one part, [w; 0]
        zeros = plgpu.layout_cast(jnp.zeros(_SHAPE, _BF16), _WG)
        vs[...] = zeros
        if n_wparts == 1:
            ws[...] = zeros
        plgpu.commit_smem()
        for src, dst in ((a_ref, xs.at[top]), (r_ref, xs.at[bottom]), (b_ref, ys.at[top]),
                         (k_ref, ys.at[bottom]), (v_ref, vs.at[bottom])):
            plgpu.copy_gmem_to_smem(src.at[bi, tok, hi], dst, load_bar)
        for p in range(n_wparts):
            plgpu.copy_gmem_to_smem(w_refs[p].at[bi, tok, hi], ws.at[(top, bottom)[p]], load_bar)
        plgpu.barrier_wait(load_bar)

        if lean:
            m, d = _lean_terms(xs, ys, vs, ws, p_hi, p_lo, q_hi, q_lo, ye_hi, ye_lo, e_hi, e_lo,
                               pa_hi, pa_lo, st_q, st_o)
        else:
            q_full, o0, m, d = _chunk_terms(xs, ys, vs, ws, p_hi, p_lo, q_hi, q_lo, ye_hi,
                                            ye_lo, lambda: None)
            # every input tile and p / q are dead now (the last products have been awaited)
            st_q[...] = q_full
            st_o[...] = o0
        st_m[...] = m
        st_d[...] = d
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_q.at[bottom], q_ref.at[bh, c])
        plgpu.copy_smem_to_gmem(st_o.at[bottom], o0_ref.at[bh, c])
        plgpu.copy_smem_to_gmem(st_m, m_ref.at[bh, c])
        plgpu.copy_smem_to_gmem(st_d, d_ref.at[bh, c])
        plgpu.wait_smem_to_gmem(0)

    tile = lambda: _swizzled(_SHAPE)  # noqa: E731
    f32 = lambda: plgpu.SMEM(_SHAPE, _F32)  # noqa: E731
    scratch = (
        plgpu.RefUnion((tile(), tile(), tile(), tile()), (f32(), f32())),
        plgpu.RefUnion((tile(), tile(), tile(), tile()), (f32(), f32())),
        tile(), tile(),                                        # Ye (hi, lo)
        tile(), tile(),                                        # X e^{[gx; g]} (hi, lo), lean
        tile(), tile(),                                        # PA (hi, lo), lean
        plgpu.Barrier(num_arrivals=5 + n_wparts),
    )
    out_type = (jax.ShapeDtypeStruct((BH, NT, DIM, DIM), _F32),
                jax.ShapeDtypeStruct((BH, NT, DIM, DIM), _F32),
                jax.ShapeDtypeStruct((BH, NT, CHUNK, DIM), _F32),
                jax.ShapeDtypeStruct((BH, NT, CHUNK, DIM), _F32))
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  approx_math=True, unsafe_no_auto_barriers=no_auto_barriers)
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(NT, H, B),
                        grid_names=("c", "h", "b"), compiler_params=params,
                        kernel_name="wkv7_mosaic_chunk_maps")


def chunk_maps(r, w_parts, k, v, a, b, *, no_auto_barriers=False, lean=True):
    """(M, D, Q, O0) float32 of every chunk (module docstring); T must be a multiple of 32."""
    B, Tp, H, _ = r.shape
    if Tp % CHUNK:
        raise ValueError(f"chunk_maps: T must be a multiple of {CHUNK}, got {Tp}")
    kernel = _make_kernel(B, Tp, H, len(w_parts), bool(no_auto_barriers), bool(lean))
    return kernel(r, k, v, a, b, *w_parts)
