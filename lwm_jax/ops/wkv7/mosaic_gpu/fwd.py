"""Fused WKV7 forward kernel on Pallas Mosaic GPU (H100 / H200, one CTA per head).

    o, final_state = wkv7_mosaic_fwd(r, w, k, v, a, b, initial_state=None, output_dtype=None)

Inputs (FLA layout): r, k, a, b `[B, T, H, 64]` and v `[B, T, H, 64]` bfloat16; w (log-decay,
<= 0) `[B, T, H, 64]` bfloat16 or float32; initial_state `[B, H, 64, 64]` float (or None = 0).
Returns o `[B, T, H, 64]` (output_dtype, default v's) and the final state float32 `[B, H, 64, 64]`.
Recurrence per head, state S [K, V] float32 throughout:
`S_t = diag(e^{w_t}) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T`, `o_t = S_t^T r_t`.

Design. One CTA per (batch, head), two warpgroups: warpgroup j runs chunks j, j + 2, ... of
C = 32 tokens (T padded to an even number of chunks), so one chunk's state-independent work
overlaps the other's; the state (bf16 hi/lo in SMEM, the wgmma operand) is handed between them
in chunk order through two mbarriers, and each warpgroup's TMA loads its next chunk as soon as
it has read the current one. Every product is a 64-row wgmma on 64 x 64 tiles, so the 32-token
quantities are stacked: X = [a; r] and Y = [b; k] (two TMA copies into the halves of one SMEM
tile), v as [0; v] and w as [w; 0]. Per chunk, with g = inclusive cumsum of w, gx = exclusive,
p = g at token 15
(the pivot), gC = g at token 31:

    [gx; g], [g; g], p, gC        0/1 lower-triangular matrices (bf16, exact) times [w; 0]
    PA = (X e^{[gx; g] - p}) (Y e^{p - [g; g]})^T    all four pair matrices in one product:
         [[A_ab, A_ak], [A_rb, A_rk]], masked strictly (a rows) / inclusively (r rows) causal
    T  = (I - [[A_ab, 0], [0, 0]])^{-1} = [[inv, 0], [0, I]]: 8 x 8 diagonal blocks by the
         product (I + D)(I + D^2)(I + D^4), then T <- T + T A_off T for 16 and 32 rows
         (lwm_jax/ops/wkv7/tril_inverse.py's blocked form)
    [Wm; 0] = T [a e^{gx}; 0],   [U0; V] = T [A_ak V; V]     (A_ak V, A_rk V = PA [0; V])
    PA [Wm; 0] -> rows 32..63: A_rb Wm,  PA [U0; V] -> rows 32..63: O0 = A_rb U0 + A_rk V
    Ye = [b; k] e^{gC - g}:  M = diag(e^{gC}) + Ye^T [Wm; 0],  D = Ye^T [U0; V]
    o = Q S + O0 (Q = r e^{g} + A_rb Wm, rows 32..63),   S <- M S + D

Exponents: |gx - p|, |g - p| <= 16 * 0.61 for RWKV-7's w >= -e^{-1/2}; every other exponent
is a sum of w over a forward interval (<= 0). Masked (acausal) entries are finite and zeroed.

Precision. The cumulative sums are exact products of 0/1 with bf16 parts of w (float32 w is
split into two bf16 parts), accumulated in float32. Every other product is "bf16x3": each
float32 operand is split into bf16 hi + lo and hi*hi + hi*lo + lo*hi is accumulated in float32
(about 16 significant bits per operand; products with v, exact in bf16, take two passes). The
state, all accumulators and the elementwise math are float32; o is rounded once at the end.

Not supported (yet): backward, segment_ids, K or V other than 64, r/k/v/a/b other than bf16,
chunk sizes other than 32. Not wired into `lwm_jax.ops.wkv7.wkv7`: one dependent chain per head
is latency-bound and measured slower than the Pallas-Triton forward at every anchor shape
(`benchmarks/wkv7_mosaic.py`; figures in benchmarks/RESULTS-log.md, 2026-11-27).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lwm_jax.ops.wkv7.tile_dots import split_bf16

try:
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    _WG = plgpu.Layout.WGMMA
except (ImportError, AttributeError) as _err:  # pragma: no cover - depends on the jax build
    raise ImportError(f"lwm_jax.ops.wkv7.mosaic_gpu needs jax's Pallas Mosaic GPU API: {_err}") \
        from _err

CHUNK = 32          # tokens per chunk
DIM = 64            # K = V
_R = 2 * CHUNK      # rows of every tile (the wgmma M)
_F32, _BF16 = jnp.float32, jnp.bfloat16
_SHAPE = (_R, DIM)


def _swizzled(shape, dtype=_BF16):
    """SMEM tiled (8, 128 bytes) and 128-byte swizzled: the wgmma operand / TMA layout."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def _iota(dim):
    return plgpu.broadcasted_iota(jnp.int32, _SHAPE, dim, layout=_WG)


def _load(ref):
    return plgpu.load(ref, layout=_WG, optimized=False)


_split = split_bf16    # float32 register tile -> (hi, lo) bfloat16


def _put(x, hi_ref, lo_ref):
    hi, lo = _split(x)
    hi_ref[...] = hi
    lo_ref[...] = lo


def _mms(*groups):
    """Products issued together, one float32 [64, 64] accumulator per group, then awaited.

    Each group is `(terms, init)`: `init + sum(a @ b for a, b in terms)` (init None = 0).
    `a`: bf16 register array (WGMMA layout) or SMEM ref (a transposed view allowed); `b`: SMEM
    ref or transposed view. Reading the accumulators waits for all products; the optimization
    barrier keeps later arithmetic after that wait.
    """
    def issue(accs):
        for acc, (terms, _) in zip(accs, groups):
            for a, b in terms:
                plgpu.wgmma(acc, a, b)

    if all(init is None for _, init in groups):
        def scoped(*accs):
            issue(accs)
            return tuple(acc[...] for acc in accs)
        outs = pl.run_scoped(scoped, *(plgpu.ACC(_SHAPE, _F32) for _ in groups))
    else:
        zero = lambda: plgpu.layout_cast(jnp.zeros(_SHAPE, _F32), _WG)  # noqa: E731
        outs = pl.run_state(issue)(tuple(plgpu.ACC.init(zero() if init is None else init)
                                         for _, init in groups))
    return lax.optimization_barrier(tuple(outs))


def _mm(terms, init=None):
    return _mms((terms, init))[0]


def _x3(x, b_hi, b_lo):
    """Terms of the bf16x3 product of a float32 register array `x` with an SMEM pair."""
    x_hi, x_lo = _split(x)
    return [(x_hi, b_hi), (x_hi, b_lo), (x_lo, b_hi)]


def _x3_pair(a_hi, a_lo, b_hi, b_lo):
    return [(a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi)]


def _ones_where(cond):
    return jnp.where(cond, 1.0, 0.0).astype(_BF16)


def _chunk_terms(xs, ys, vs, ws, p_hi, p_lo, q_hi, q_lo, ye_hi, ye_lo, after_inputs):
    """The state-independent part of one chunk from its SMEM input tiles (module docstring).

    Returns float32 [64, 64] register tiles (Q, O0, M, D): rows 32..63 of Q and O0 are the
    chunk's 32 rows (rows 0..31 are unused); M, D are [K, K] and [K, V]. `after_inputs()` runs
    once every input tile has been read (the caller reuses the input buffers from there on).
    """
    row, col = _iota(0), _iota(1)
    rr, cc = row & (CHUNK - 1), col & (CHUNK - 1)
    is_top, first = row < CHUNK, col < CHUNK
    # cumulative log decays from ws = [w part 0; w part 1 (or 0)] (each row of the 0/1 matrix
    # takes both halves): [gx; g], [g; g], p (g at token 15) and gC, broadcast over rows
    tok = col & (CHUNK - 1)
    g_left, g_right, piv, g_end = _mms(*[([(_ones_where(sel), ws)], None) for sel in (
        jnp.where(is_top, tok < rr, tok <= rr), tok <= rr, tok <= CHUNK // 2 - 1, tok >= 0)])
    x_f = _load(xs).astype(_F32)                # [a; r]
    y_f = _load(ys).astype(_F32)                # [b; k]
    v_f = _load(vs).astype(_F32)                # [0; v]
    _put(y_f * jnp.exp(piv - g_right), p_hi, p_lo)
    _put(y_f * jnp.exp(g_end - g_right), ye_hi, ye_lo)   # [b e^{gC-g}; k e^{gC-g}]
    plgpu.commit_smem()
    pa = _mm(_x3(x_f * jnp.exp(g_left - piv), p_hi.T, p_lo.T))
    pa = jnp.where(jnp.where(is_top, rr > cc, rr >= cc), pa, 0.0)
    pa_hi, pa_lo = _split(pa)
    r1 = _mm([(pa_hi, vs), (pa_lo, vs)])        # [A_ak V; A_rk V]
    after_inputs()

    # T = (I - [[A_ab, 0], [0, 0]])^{-1}: 8 x 8 diagonal blocks first
    a_ab = jnp.where(is_top & first, pa, 0.0)
    eye = jnp.where(row == col, 1.0, 0.0)
    d8 = jnp.where((row >> 3) == (col >> 3), a_ab, 0.0)
    _put(d8, p_hi, p_lo)
    plgpu.commit_smem()
    d2 = _mm(_x3(d8, p_hi, p_lo))                             # D^2
    t1 = eye + d8
    _put(d2, p_hi, p_lo)
    _put(t1, q_hi, q_lo)
    plgpu.commit_smem()
    d2_hi, d2_lo = _split(d2)
    d4, t2 = _mms((_x3_pair(d2_hi, d2_lo, p_hi, p_lo), None),    # D^4
                  (_x3_pair(d2_hi, d2_lo, q_hi, q_lo), t1))      # (I + D^2)(I + D)
    _put(t2, q_hi, q_lo)
    plgpu.commit_smem()
    inv = _mm(_x3(d4, q_hi, q_lo), init=t2)                      # (I + D^4)(I + D^2)(I + D)
    for shift in (4, 5):                                         # T <- T + T A_off T
        off = ((row >> shift) == (col >> shift)) & ((row >> (shift - 1)) != (col >> (shift - 1)))
        _put(jnp.where(off, a_ab, 0.0), p_hi, p_lo)
        _put(inv, q_hi, q_lo)
        plgpu.commit_smem()
        t_off = _mm(_x3(inv, p_hi, p_lo))
        inv = _mm(_x3(t_off, q_hi, q_lo), init=inv)

    xe = x_f * jnp.exp(g_left)                  # [a e^{gx}; r e^{g}]
    _put(jnp.where(is_top, xe, 0.0), p_hi, p_lo)
    _put(jnp.where(is_top, r1, v_f), q_hi, q_lo)
    plgpu.commit_smem()
    inv_hi, inv_lo = _split(inv)
    wl, wr = _mms((_x3_pair(inv_hi, inv_lo, p_hi, p_lo), None),  # [Wm; 0]
                  (_x3_pair(inv_hi, inv_lo, q_hi, q_lo), None))  # [U0; V]
    _put(wl, p_hi, p_lo)
    _put(wr, q_hi, q_lo)
    plgpu.commit_smem()
    q_full, o0 = _mms((_x3_pair(pa_hi, pa_lo, p_hi, p_lo), xe),  # rows 32..: Q
                      (_x3_pair(pa_hi, pa_lo, q_hi, q_lo), None))  # rows 32..: O0
    diag_m = jnp.where(row == col, jnp.exp(g_end), 0.0)
    m, d = _mms((_x3_pair(ye_hi.T, ye_lo.T, p_hi, p_lo), diag_m),
                (_x3_pair(ye_hi.T, ye_lo.T, q_hi, q_lo), None))
    return q_full, o0, m, d


def _make_kernel(B, Tp, H, n_wparts, out_dtype):
    """Two warpgroups per (batch, head): warpgroup j runs chunks c = j, j + 2, ... The
    state-independent work of a chunk overlaps the other warpgroup's; the state S (bf16 hi/lo
    in SMEM, the wgmma operand) passes between them through two barriers, in chunk order."""
    NT = Tp // CHUNK
    half = NT // 2
    stage_type = (_swizzled((2, _R, DIM), out_dtype) if jnp.dtype(out_dtype).itemsize == 2
                  else plgpu.SMEM((2, _R, DIM), out_dtype))

    def body(r_ref, k_ref, v_ref, a_ref, b_ref, *rest):
        w_refs, (s0_ref, o_ref, sT_ref) = rest[:n_wparts], rest[n_wparts:n_wparts + 3]
        (xs, ys, vs, ws, p_hi, p_lo, q_hi, q_lo, ye_hi, ye_lo, s_hi, s_lo, s_f32, stage,
         load_bar, state_bar, s0_bar, done_bar) = rest[n_wparts + 3:]
        bi, hi, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("wg")
        top, bottom = pl.ds(0, CHUNK), pl.ds(CHUNK, CHUNK)

        def issue_loads(c):
            tok = pl.ds(c * CHUNK, CHUNK)
            bar = load_bar.at[j]
            for src, dst in ((a_ref, xs.at[j, top]), (r_ref, xs.at[j, bottom]),
                             (b_ref, ys.at[j, top]), (k_ref, ys.at[j, bottom]),
                             (v_ref, vs.at[j, bottom])):
                plgpu.copy_gmem_to_smem(src.at[bi, tok, hi], dst, bar)
            for p in range(n_wparts):
                plgpu.copy_gmem_to_smem(w_refs[p].at[bi, tok, hi], ws.at[j, (top, bottom)[p]], bar)

        # the halves no TMA copy writes stay zero: [0; v] and [w; 0]
        zeros = plgpu.layout_cast(jnp.zeros(_SHAPE, _BF16), _WG)
        vs.at[j][...] = zeros
        ws.at[j][...] = zeros
        plgpu.commit_smem()
        issue_loads(j)

        @pl.when(j == 0)
        def _initial_state():
            plgpu.copy_gmem_to_smem(s0_ref.at[bi, hi], s_f32, s0_bar)
            plgpu.barrier_wait(s0_bar)
            _put(_load(s_f32), s_hi, s_lo)
            plgpu.commit_smem()
            plgpu.barrier_arrive(state_bar.at[0])

        def chunk(i, carry):
            c = 2 * i + j
            plgpu.barrier_wait(load_bar.at[j])

            def after_inputs():
                @pl.when(c + 2 < NT)
                def _prefetch():
                    issue_loads(c + 2)

            q_full, o0, m, d = _chunk_terms(
                xs.at[j], ys.at[j], vs.at[j], ws.at[j], p_hi.at[j], p_lo.at[j], q_hi.at[j],
                q_lo.at[j], ye_hi.at[j], ye_lo.at[j], after_inputs)
            q_hi_, q_lo_ = _split(q_full)
            m_hi, m_lo = _split(m)
            plgpu.barrier_wait(state_bar.at[j])          # S before chunk c is in s_hi / s_lo
            o, s_new = _mms((_x3_pair(q_hi_, q_lo_, s_hi, s_lo), o0),
                            (_x3_pair(m_hi, m_lo, s_hi, s_lo), d))
            _put(s_new, s_hi, s_lo)
            plgpu.commit_smem()
            plgpu.barrier_arrive(state_bar.at[1 - j])    # hand S after chunk c over

            @pl.when(c == NT - 1)
            def _final_state():
                s_f32[...] = s_new
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(s_f32, sT_ref.at[bi, hi])

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's previous store
            stage.at[j][...] = o.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage.at[j, bottom], o_ref.at[bi, pl.ds(c * CHUNK, CHUNK), hi])
            return carry

        lax.fori_loop(0, half, chunk, None)
        plgpu.wait_smem_to_gmem(0)
        # both warpgroups finish together (one exiting while the other issues wgmma is unsafe)
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)

    per_wg = lambda shape: _swizzled((2,) + shape)  # noqa: E731
    scratch = (
        per_wg(_SHAPE), per_wg(_SHAPE), per_wg(_SHAPE),        # [a;r] [b;k] [0;v]
        per_wg(_SHAPE),                                        # [w; 0] or [w hi; w lo]
        per_wg(_SHAPE), per_wg(_SHAPE), per_wg(_SHAPE), per_wg(_SHAPE),   # p, q (hi, lo)
        per_wg(_SHAPE), per_wg(_SHAPE),                        # ye (hi, lo)
        _swizzled(_SHAPE), _swizzled(_SHAPE),                  # S (hi, lo), shared
        plgpu.SMEM(_SHAPE, _F32),                              # state in / out
        stage_type,                                            # output tiles
        plgpu.Barrier(num_arrivals=5 + n_wparts, num_barriers=2),
        plgpu.Barrier(num_arrivals=1, num_barriers=2),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=2),
    )
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, DIM), out_dtype),
                jax.ShapeDtypeStruct((B, H, DIM, DIM), _F32))
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  approx_math=True)
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(B, H),
                        grid_names=("b", "h"), num_threads=2, thread_name="wg",
                        compiler_params=params, kernel_name="wkv7_mosaic_fwd")


def _w_parts(w):
    """bf16 parts of w whose sum is w: (w,) for bf16, (hi, lo) for wider floats (16 bits)."""
    if w.dtype == _BF16:
        return (w,)
    w = w.astype(_F32)
    hi = w.astype(_BF16)
    return hi, (w - hi.astype(_F32)).astype(_BF16)


def check_inputs(fn: str, r, w, k, v, a, b) -> None:
    """The kernels' input contract, errors named after `fn`: r, k, v, a, b bfloat16
    `[B, T, H, 64]`, w of r's shape (bfloat16 or float32)."""
    B, T, H, K = r.shape
    if K != DIM or v.shape[-1] != DIM:
        raise ValueError(f"{fn}: K and V must be {DIM}, got K={K}, V={v.shape[-1]}")
    for name, x in (("r", r), ("k", k), ("v", v), ("a", a), ("b", b)):
        if x.dtype != _BF16:
            raise TypeError(f"{fn}: {name} must be bfloat16, got {x.dtype}")
        if x.shape != (B, T, H, DIM):
            raise ValueError(f"{fn}: {name} must be {(B, T, H, DIM)}, got {x.shape}")
    if w.shape != r.shape:
        raise ValueError(f"{fn}: w must be {r.shape}, got {w.shape}")


@functools.partial(jax.jit, static_argnames=("output_dtype",))
def wkv7_mosaic_fwd(r, w, k, v, a, b, initial_state=None, output_dtype=None):
    """WKV7 forward (see the module docstring). Returns `(o, final_state)`."""
    check_inputs("wkv7_mosaic_fwd", r, w, k, v, a, b)
    B, T, H, _ = r.shape
    out_dtype = jnp.dtype(v.dtype if output_dtype is None else output_dtype)
    Tp = -(-T // (2 * CHUNK)) * 2 * CHUNK  # an even number of chunks
    parts = _w_parts(w)
    xs = (r, k, v, a, b) + parts
    if Tp != T:  # padded steps: w = 0 and zero vectors leave the state unchanged
        xs = tuple(jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0))) for x in xs)
    s0 = (jnp.zeros((B, H, DIM, DIM), _F32) if initial_state is None
          else initial_state.astype(_F32))
    o, sT = _make_kernel(B, Tp, H, len(parts), out_dtype)(*xs, s0)
    return o[:, :T], sT
