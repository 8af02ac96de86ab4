"""The WKV7 chunk maps on Pallas Mosaic GPU (Hopper), two chunks of 32 tokens per CTA.

    M_hi, M_lo, D, Q_hi, Q_lo, O0_t = pair_maps(r, k, v, a, b, g)

The chunk-parallel half of the GPU forward (the Pallas-Triton `launches.intra_fwd` with
`split_mq=True, o0_t=True`), in the form the Mosaic output chain (`state_pass.forward_outputs`)
reads. For chunk c of head bh (BH = B * H, NT = T / 32 chunks, K = V = 64):

    S_end = M S_start + D,   o^T = S_start^T Q^T + O0^T

Inputs: r, k, v, a, b `[B, T, H, 64]` bfloat16 and g `[B, T, H, 64]` float32, the log decay
summed inside each 32-token chunk (inclusive; `chunk_log_decay`). T a multiple of 64.
Outputs: M_hi, M_lo `[BH, NT, 64, 64]` bfloat16 (M ~= hi + lo), D `[BH, NT, 64, 64]` float32,
Q_hi, Q_lo `[BH, NT, 32, 64]` bfloat16, O0_t `[BH, NT, 64, 32]` float32 (O0 transposed).

Algebra (`pallas_gpu/tiles.py`'s notation; p = g at the chunk's token 15, the pivot that keeps
every exponent of a kept entry within 16 tokens of decay, gx = g one token earlier, gC = g at
the chunk's last token). The CTA's 64 tokens are the rows of every tile; the two chunks make
the 64 x 64 pair matrices block diagonal (masked to the chunk and causally):

    A_ab, A_ak = strict((a e^{gx-p}) (b, k e^{p-g})^T)   A_rb, A_rk = incl((r e^{g-p}) (...)^T)
    T  = (I - A_ab)^{-1}    8 x 8 diagonal blocks as (I + D)(I + D^2)(I + D^4), then doubled to
                            16 and 32 rows by T <- T + T A_off T (`tril_inverse`'s blocked form)
    Wm = T (a e^{gx}),  U0 = T (A_ak V),  Q = r e^{g} + A_rb Wm,  O0^T = V^T A_rk^T + U0^T A_rb^T
    M_c = diag(e^{gC}) + (b e^{gC-g})_c^T Wm_c,   D_c = (k e^{gC-g})_c^T V_c + (b e^{gC-g})_c^T U0_c

Precision: every product is bf16x3 (each float32 operand split into bf16 hi + lo, hi hi + hi lo
+ lo hi accumulated in float32; products with v, exact in bf16, take two), so the maps carry
about 16 significant bits per operand, more than the Triton launch's TF32 products.

Design: one warpgroup per CTA (grid T / 64 x H x B), ~106 KiB of shared memory so that two
CTAs share an SM. Each product's right operand sits in shared memory as a bf16 hi / lo pair of
tiles; the left operand is a split register array or a shared-memory view. Four work pairs are
reused through the chunk's rounds; k and b wait in one of them until the right factors are
formed and are loaded again for the end factors; the outputs leave through TMA from tiles whose
earlier contents are dead (`RefUnion` where the types differ). wgmma contracts over multiples
of 64 tokens, so M_c and D_c take the pair's 64 rows with the other chunk's rows zeroed.
Packed documents (segment ids) are not supported here.

Not wired into `lwm_jax.ops.wkv7.wkv7`: exact (its maps carry ~100x less error than the Triton
launch's TF32 ones) but measured slower than that launch at every anchor shape. Nsight Compute
finds it issue-bound: ~8.8k straight-line instructions per warp for a pair of chunks (a third of
them the bf16 hi / lo splits of the 34 operands), 2 CTAs per SM, a third of the stalls waiting
on instruction fetch (benchmarks/NOTES-wkv7.md, RESULTS-log.md, 2026-11-28).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lwm_jax.ops.wkv7.mosaic_gpu.tiles import (BF16, F32, TILE, WG, load, pl,
                                               plgpu, put, split, swizzled)
from lwm_jax.ops.wkv7.mosaic_gpu.state_pass import _products

_C = 32            # tokens per chunk
_P = 2 * _C        # tokens per CTA
_LEAD = 8          # rows of the g buffer before token 0 (g one token earlier is a shifted read)
_COL = WG.reduce(0)   # one value per column


def chunk_log_decay(w, chunk: int = _C):
    """g: the inclusive cumulative sum of the log decay w `[B, T, H, K]` inside each chunk of
    `chunk` tokens, float32 (T a multiple of `chunk`)."""
    B, T, H, K = w.shape
    x = w.astype(F32).reshape(B, T // chunk, chunk, H, K)
    return jnp.cumsum(x, axis=2).reshape(B, T, H, K)


def _x3(l_hi, l_lo, pair, transposed=False):
    """Terms of (l_hi + l_lo) @ (hi + lo) for a pair [2, rows, 64] of bf16 tiles."""
    b_hi, b_lo = (pair.at[0].T, pair.at[1].T) if transposed else (pair.at[0], pair.at[1])
    return [(l_hi, b_hi), (l_hi, b_lo), (l_lo, b_hi)]


def _put_pair(x, pair):
    put(x, pair.at[0], pair.at[1])


def _kernel(B, Tp, H):
    NP = Tp // _P
    BH, NT = B * H, Tp // _C

    def body(r_ref, k_ref, v_ref, a_ref, b_ref, g_ref, mh_ref, ml_ref, d_ref, qh_ref, ql_ref,
             o0_ref, xs, vs, u_g, p3, u_4, p1, p2, bar, bar_kb):
        gs, o0_stage, d0_stage = u_g
        p4, d1_stage = u_4
        pi, hi, bi = lax.axis_index("p"), lax.axis_index("h"), lax.axis_index("b")
        bh = bi * H + hi
        tok = pl.ds(pi * _P, _P)
        # k and b wait in p3 until the right factors are formed (and come again at the end)
        for src, dst in ((a_ref, xs.at[0]), (r_ref, xs.at[1]), (k_ref, p3.at[0]),
                         (b_ref, p3.at[1]), (v_ref, vs), (g_ref, gs.at[pl.ds(_LEAD, _P)])):
            plgpu.copy_gmem_to_smem(src.at[bi, tok, hi], dst, bar)
        plgpu.barrier_wait(bar)

        row = plgpu.broadcasted_iota(jnp.int32, TILE, 0, layout=WG)
        col = plgpu.broadcasted_iota(jnp.int32, TILE, 1, layout=WG)
        second = row >= _C
        same = (row >> 5) == (col >> 5)
        strict, incl = same & (row > col), same & (row >= col)

        def g_at(t):
            """g at token t of the CTA, per column (a [64] vector)."""
            return plgpu.load(gs.at[_LEAD + t], layout=_COL, optimized=False)

        def wide(x):
            return lax.broadcast_in_dim(x, TILE, [1])

        def per_chunk(t):
            """g at token t of each row's chunk, broadcast along the row."""
            return jnp.where(second, wide(g_at(_C + t)), wide(g_at(t)))

        def g_now():
            return load(gs.at[pl.ds(_LEAD, _P)])

        def g_prev():
            return jnp.where((row & (_C - 1)) == 0, 0.0, load(gs.at[pl.ds(_LEAD - 1, _P)]))

        def inp(ref):
            return load(ref).astype(F32)

        def one(terms, init=None):
            return _products(((TILE, terms, init),))[0]

        # right factors of the pair products: k e^{p-g} -> p1, b e^{p-g} -> p2
        e_right = jnp.exp(per_chunk(_C // 2 - 1) - g_now())
        _put_pair(inp(p3.at[0]) * e_right, p1)
        _put_pair(inp(p3.at[1]) * e_right, p2)
        plgpu.commit_smem()
        # the a rows: A_ak and A_ab stay in registers (A_ak for U0, A_ab for the inverse)
        l_hi, l_lo = split(inp(xs.at[0]) * jnp.exp(g_prev() - per_chunk(_C // 2 - 1)))
        s_ak, s_ab = _products(((TILE, _x3(l_hi, l_lo, p1, True), None),
                                (TILE, _x3(l_hi, l_lo, p2, True), None)))
        a_ak = jnp.where(strict, s_ak, 0.0)
        a_ab = jnp.where(strict, s_ab, 0.0)
        # the r rows: A_rb -> p3, A_rk -> p4 (read by the Q and O0 products)
        l_hi, l_lo = split(inp(xs.at[1]) * jnp.exp(g_now() - per_chunk(_C // 2 - 1)))
        s_rk, s_rb = _products(((TILE, _x3(l_hi, l_lo, p1, True), None),
                                (TILE, _x3(l_hi, l_lo, p2, True), None)))
        _put_pair(jnp.where(incl, s_rb, 0.0), p3)
        _put_pair(jnp.where(incl, s_rk, 0.0), p4)

        # T = (I - A_ab)^{-1}: the 8 x 8 diagonal blocks D first, then two doublings
        eye = jnp.where(row == col, 1.0, 0.0)
        d1 = jnp.where((row >> 3) == (col >> 3), a_ab, 0.0)
        _put_pair(d1, p1)
        plgpu.commit_smem()
        h, l = split(d1)
        d2 = one(_x3(h, l, p1))                                   # D^2
        _put_pair(d2, p1)
        _put_pair(eye + d1, p2)
        plgpu.commit_smem()
        h, l = split(d2)
        d4, t = _products(((TILE, _x3(h, l, p1), None),          # D^4
                           (TILE, _x3(h, l, p2), eye + d1)))     # (I + D^2)(I + D)
        _put_pair(t, p1)
        plgpu.commit_smem()
        h, l = split(d4)
        t = one(_x3(h, l, p1), t)                                 # (I + D^4)(I + D^2)(I + D)
        for shift in (4, 5):
            off = (((row >> shift) == (col >> shift))
                   & ((row >> (shift - 1)) != (col >> (shift - 1))))
            _put_pair(jnp.where(off, a_ab, 0.0), p1)
            _put_pair(t, p2)
            plgpu.commit_smem()
            h, l = split(t)
            t_off = one(_x3(h, l, p1))                            # T A_off
            h, l = split(t_off)
            t = one(_x3(h, l, p2), t)                             # T + T A_off T

        # Wm = T (a e^{gx}) and A_ak V
        _put_pair(inp(xs.at[0]) * jnp.exp(g_prev()), p1)
        plgpu.commit_smem()
        t_hi, t_lo = split(t)
        k_hi, k_lo = split(a_ak)
        wm, av = _products(((TILE, _x3(t_hi, t_lo, p1), None),
                            (TILE, [(k_hi, vs), (k_lo, vs)], None)))
        # U0 = T (A_ak V) and Q = r e^{g} + A_rb Wm
        _put_pair(wm, p1)
        _put_pair(av, p2)
        plgpu.commit_smem()
        rt = inp(xs.at[1]) * jnp.exp(g_now())
        u0, q = _products(((TILE, _x3(t_hi, t_lo, p2), None),
                           (TILE, [(p3.at[0], p1.at[0]), (p3.at[0], p1.at[1]),
                                     (p3.at[1], p1.at[0])], rt)))
        # Q leaves from the input tiles of a and r (dead); U0 -> p2
        _put_pair(q, xs)
        _put_pair(u0, p2)
        plgpu.commit_smem()
        for c in range(2):
            rows = pl.ds(c * _C, _C)
            plgpu.copy_smem_to_gmem(xs.at[0, rows], qh_ref.at[bh, 2 * pi + c])
            plgpu.copy_smem_to_gmem(xs.at[1, rows], ql_ref.at[bh, 2 * pi + c])
        # O0^T = V^T A_rk^T + U0^T A_rb^T
        vt = vs.T
        o0t = one([(vt, p4.at[0].T), (vt, p4.at[1].T), (p2.at[0].T, p3.at[0].T),
                   (p2.at[0].T, p3.at[1].T), (p2.at[1].T, p3.at[0].T)])
        # g's last job: e^{gC-g} per row's chunk and the two chunks' e^{gC} (M's diagonals)
        g_end = (g_at(_C - 1), g_at(_P - 1))
        e_end = jnp.exp(jnp.where(second, wide(g_end[1]), wide(g_end[0])) - g_now())
        # k and b again, into the tiles Q left from (once its copies have read them)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for src, dst in ((k_ref, xs.at[0]), (b_ref, xs.at[1])):
            plgpu.copy_gmem_to_smem(src.at[bi, tok, hi], dst, bar_kb)
        # g's buffer stages O0^T, one [64, 32] box per chunk
        for c in range(2):
            o0_stage.at[c][...] = o0t[:, c * _C:(c + 1) * _C]
        plgpu.commit_smem()
        for c in range(2):
            plgpu.copy_smem_to_gmem(o0_stage.at[c], o0_ref.at[bh, 2 * pi + c])
        plgpu.barrier_wait(bar_kb)

        def end_factors(c):
            """(b e^{gC-g}, k e^{gC-g}) of chunk c's rows (the other chunk's rows zero: wgmma
            contracts over all 64 tokens) -> p3, p4."""
            mine = second if c else ~second
            _put_pair(jnp.where(mine, inp(xs.at[1]) * e_end, 0.0), p3)
            _put_pair(jnp.where(mine, inp(xs.at[0]) * e_end, 0.0), p4)
            plgpu.commit_smem()

        def m_and_d(c):
            """M_c = diag(e^{gC}) + (b e^{gC-g})_c^T Wm, D_c = (k e^{gC-g})_c^T V + (...)^T U0."""
            bt_hi, bt_lo = p3.at[0].T, p3.at[1].T
            kt_hi, kt_lo = p4.at[0].T, p4.at[1].T
            m, d = _products(((TILE, [(bt_hi, p1.at[0]), (bt_hi, p1.at[1]),
                                        (bt_lo, p1.at[0])], None),
                              (TILE, [(kt_hi, vs), (kt_lo, vs), (bt_hi, p2.at[0]),
                                        (bt_hi, p2.at[1]), (bt_lo, p2.at[0])], None)))
            return m + jnp.where(row == col, jnp.exp(wide(g_end[c])), 0.0), d

        end_factors(0)
        m, d = m_and_d(0)
        end_factors(1)               # reads k and b for the last time
        # chunk 0 leaves from the tiles of k, b (M) and of O0^T (D, once its copies have read)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        _put_pair(m, xs)
        d0_stage[...] = d
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(xs.at[0], mh_ref.at[bh, 2 * pi])
        plgpu.copy_smem_to_gmem(xs.at[1], ml_ref.at[bh, 2 * pi])
        plgpu.copy_smem_to_gmem(d0_stage, d_ref.at[bh, 2 * pi])
        m, d = m_and_d(1)
        _put_pair(m, p3)
        d1_stage[...] = d
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(p3.at[0], mh_ref.at[bh, 2 * pi + 1])
        plgpu.copy_smem_to_gmem(p3.at[1], ml_ref.at[bh, 2 * pi + 1])
        plgpu.copy_smem_to_gmem(d1_stage, d_ref.at[bh, 2 * pi + 1])
        plgpu.wait_smem_to_gmem(0)

    pair = lambda: swizzled((2,) + TILE)  # noqa: E731
    scratch = (
        pair(),                                                   # [a, r], Q, [k, b], M_0
        swizzled(TILE),                                        # v
        plgpu.RefUnion(plgpu.SMEM((_LEAD + _P, 64), F32),         # g, then O0^T, then D_0
                       swizzled((2, 64, _C), F32), swizzled(TILE, F32)),
        pair(),                                                   # p3, then M_1
        plgpu.RefUnion(pair(), swizzled(TILE, F32)),          # p4, then D_1
        pair(), pair(),                                           # p1, p2
        plgpu.Barrier(num_arrivals=6), plgpu.Barrier(num_arrivals=2),
    )
    bf = lambda *s: jax.ShapeDtypeStruct((BH, NT) + s, BF16)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct((BH, NT) + s, F32)  # noqa: E731
    out_type = (bf(64, 64), bf(64, 64), f32(64, 64), bf(_C, 64), bf(_C, 64), f32(64, _C))
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  approx_math=True)
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(NP, H, B),
                        grid_names=("p", "h", "b"), compiler_params=params,
                        kernel_name="wkv7_mosaic_pair_maps")


@jax.jit
def pair_maps(r, k, v, a, b, g):
    """The chunk maps (module docstring). r, k, v, a, b `[B, T, H, 64]` bfloat16, g float32
    (`chunk_log_decay` of w), T a multiple of 64."""
    B, Tp, H, K = r.shape
    for name, x in (("r", r), ("k", k), ("v", v), ("a", a), ("b", b)):
        if x.shape != (B, Tp, H, 64) or x.dtype != BF16:
            raise ValueError(f"pair_maps: {name} must be bfloat16 {(B, Tp, H, 64)}, got "
                             f"{x.dtype} {x.shape}")
    if g.shape != r.shape or g.dtype != F32:
        raise ValueError(f"pair_maps: g must be float32 {r.shape}, got {g.dtype} {g.shape}")
    if Tp % _P:
        raise ValueError(f"pair_maps: T must be a multiple of {_P}, got {Tp}")
    return _kernel(B, Tp, H)(r, k, v, a, b, g)


__all__ = ["chunk_log_decay", "pair_maps"]
