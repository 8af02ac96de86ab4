"""The chunk chains of the WKV7 GPU kernel on Pallas Mosaic GPU (Hopper: wgmma + TMA).

    states, final = forward_states(M_hi, M_lo, D, s0)
    o, final = forward_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0_t, s0, H=H)
    o, states, final = forward_outputs(..., with_states=True)
    dS_end, ds0 = backward_states(M_hi, M_lo, Q_hi, Q_lo, do, dsT, H=H)

They replace the Pallas-Triton `seq_fwd` and `seq_bwd` launches (`pallas_gpu/launches.py`),
whose chunk-parallel launches produce the per-chunk maps:

    forward   S_{c+1} = M_c S_c + D_c                    (chunk c's start state S_c [K, V])
    outputs   o_c = Q_c S_c + O0_c                       (chunk c's 32 rows of o)
    backward  dS_{c-1} = M_c^T dS_c + Q_c^T dO_c         (dS_c: cotangent of chunk c's end state)

Shapes (BH = B * H heads, NT chunks of C = 32 tokens, K = V = 64):
  M_hi, M_lo  [BH, NT, 64, 64] bfloat16, M ~= M_hi + M_lo (16 significant bits)
  D           [BH, NT, 64, 64] float32
  Q_hi, Q_lo  [BH, NT, 32, 64] bfloat16, Q ~= Q_hi + Q_lo
  O0_t        [BH, NT, 64, 32] float32 (O0_c transposed)
  do          [B, NT * 32, H, 64] bfloat16 (the output cotangent, exact as an operand)
  s0, dsT     [B, H, 64, 64] float32
Returns float32: `states` [BH, NT, 64, 64] (S_c, the start state of every chunk) and the final
state [B, H, 64, 64]; o [B, NT * 32, H, 64] bfloat16; `dS_end` [BH, NT, 64, 64] (dS_c) and
d(initial state) [B, H, 64, 64].

Design. One CTA (one warpgroup) per head and block of value columns (`block_v` = 64, 32 or 16:
the columns evolve independently) carries its [64, block_v] part of the state in float32
registers as the wgmma accumulator; narrower blocks mean more CTAs for few heads and a shorter
step (less to split, store and multiply per chunk), at the cost of reading M once per block.
Per chunk the state is split into bf16 hi / lo tiles in shared memory and the step is one
accumulation of bf16 products ("bf16x3": M_hi S_hi + M_hi S_lo + M_lo S_hi, about 16
significant bits per operand, more than the TF32 products of the Triton launches); the
backward adds Q^T dO as two products (dO is bf16 already; its 32 rows sit in the lower half of
a 64-row tile whose upper half, and Q's, stay zero); the outputs are three more products of
the same step, o_c^T = S_c^T Q_c^T + O0_c^T (S's bf16 tiles read transposed; with narrower
blocks o_c = Q_c S_c + O0_c, Q_c in the upper half of a 64-row tile, and the step waits for
the chain's products alone: the next state is split into a second pair of bf16 tiles while
the outputs' products still read the first; without the chunk states that narrow form runs on
two warpgroups, `output_chain.py`). TMA brings the maps of the next `_STAGES - 1`
chunks while a chunk runs; every chunk's state (or outputs) leaves through TMA from one of two
staging tiles, stored while the step's products are in flight. Both operands of every product
come from shared memory, so the accumulator is the only large register array (no wgmma
serialisation for want of registers).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lwm_jax.ops.wkv7.mosaic_gpu.tiles import (BF16, F32, TILE, WG, load, pl,
                                               plgpu, split, swizzled)

_STAGES = 3   # chunks of maps in flight (the one in use and the next two)
_C = 32       # chunk length the Triton chunk launches use


def _state_out(x, stage, slot, dst, pending=1):
    """Stores the float32 [64, BV] register tile `x` into staging tile `slot` and sends it to
    `dst` (HBM) by TMA; the staging tile used two stores ago must have been read out, with
    `pending` later stores (the chain's stores per step, of either kind) still in flight."""
    plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
    stage.at[slot][...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage.at[slot], dst)


def _value_in(src, stage, bar):
    """The chain's start value [64, BV] float32 from HBM `src`, through staging tile 1."""
    plgpu.copy_gmem_to_smem(src, stage.at[1], bar)
    plgpu.barrier_wait(bar)
    return load(stage.at[1])


def _value_out(x, stage, dst):
    """The chain's last value to HBM `dst` through staging tile 0, once every earlier store
    has left; returns when it has."""
    plgpu.wait_smem_to_gmem(0)
    stage.at[0][...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage.at[0], dst)
    plgpu.wait_smem_to_gmem(0)


def _products(groups, during=None):
    """Products issued together, then awaited: one float32 accumulator per group, each group
    `(shape, terms, init)` = `init + sum(a @ b for a, b in terms)` with both operands SMEM
    refs (or their transposed views) and `init` a float32 register array of `shape` (None:
    zeros). `during()` runs while the products are in flight (the chain's stores: off its
    critical path)."""
    zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, F32), WG)  # noqa: E731

    def issue(accs):
        for acc, (_, terms, _) in zip(accs, groups):
            for a, b in terms:
                plgpu.wgmma(acc, a, b)
        if during is not None:
            during()
    outs = pl.run_state(issue)(tuple(plgpu.ACC.init(zeros(shape) if init is None else init)
                                     for shape, _, init in groups))
    return lax.optimization_barrier(tuple(outs))


def _zero_ring(tiles):
    """Zero every slot of each `(ring, dtype)` shared-memory ring before the first load: the
    half of a 64-row tile that its TMA copies never write must hold exact zeros."""
    for slot in range(_STAGES):
        for t, dt in tiles:
            t.at[slot][...] = plgpu.layout_cast(jnp.zeros(t.shape[1:], dt), WG)
    plgpu.commit_smem()


def _forward_kernel(BH, NT, H, with_out, BV=64, with_states=False):
    """The forward chain over value columns [j BV, (j + 1) BV) of each head (grid B x H x
    64 / BV). It writes every chunk's start state (for the backward), or with `with_out` every
    chunk's outputs o_c = Q_c S_c + O0_c instead (and with `with_states` as well, both leaving
    by TMA while the step's products run), formed beside the chain's product of the
    same step: at BV = 64 transposed (o_c^T = S_c^T Q_c^T + O0_c^T: the state's bf16 tiles are
    the A operand, 64 value rows, N = C tokens), at narrower blocks as Q_c S_c with Q_c in the
    upper half of a 64-row tile whose lower half (and O0's) stays zero (wgmma needs 64 rows)."""
    B = BH // H
    C = _C
    narrow = BV < 64
    val = (64, BV)
    both = with_out and with_states
    pending = 2 if both else 1   # TMA stores a step issues

    def body(*refs):
        n_in, n_out = (7 if with_out else 4), (3 if both else 2)
        ins, outs, scratch = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
        x_ref, sT_ref = outs[0], outs[-1]
        st_ref = outs[1] if both else None   # chunk states beside the outputs
        mh_ref, ml_ref, d_ref = ins[:3]
        mh, ml, ds = scratch[:3]
        if with_out:
            qh_ref, ql_ref, o0_ref = ins[3:6]
            qh, ql, o0s, o_stage = scratch[3:7]
        s_hi, s_lo, stage, load_bar, s0_bar = scratch[-5:]
        bi, hi, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
        bh = bi * H + hi
        cols = pl.ds(j * BV, BV)
        top = pl.ds(0, C)

        def issue(c):
            slot = c % _STAGES
            bar = load_bar.at[slot]
            plgpu.copy_gmem_to_smem(mh_ref.at[bh, c], mh.at[slot], bar)
            plgpu.copy_gmem_to_smem(ml_ref.at[bh, c], ml.at[slot], bar)
            plgpu.copy_gmem_to_smem(d_ref.at[bh, c, :, cols], ds.at[slot], bar)
            if with_out and narrow:
                plgpu.copy_gmem_to_smem(qh_ref.at[bh, c], qh.at[slot, top], bar)
                plgpu.copy_gmem_to_smem(ql_ref.at[bh, c], ql.at[slot, top], bar)
                plgpu.copy_gmem_to_smem(o0_ref.at[bh, c, :, cols], o0s.at[slot, top], bar)
            elif with_out:
                plgpu.copy_gmem_to_smem(qh_ref.at[bh, c], qh.at[slot], bar)
                plgpu.copy_gmem_to_smem(ql_ref.at[bh, c], ql.at[slot], bar)
                plgpu.copy_gmem_to_smem(o0_ref.at[bh, c], o0s.at[slot], bar)

        if with_out and narrow:  # the lower halves stay zero: their products add nothing
            _zero_ring(((qh, BF16), (ql, BF16), (o0s, F32)))
        for c in range(min(_STAGES - 1, NT)):
            issue(c)
        s_init = _value_in(ins[-1].at[bi, hi, :, cols], stage, s0_bar)

        def o_out(o, c):
            """Chunk c's outputs leave as o [C, BV]; the staging tile used two chunks ago
            must have been read."""
            plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
            if narrow:
                o_stage.at[c % 2][...] = o.astype(BF16)
                src = o_stage.at[c % 2, top]
            else:   # o^T: the transposed register layout stores into the transposed view
                o_stage.at[c % 2].T[...] = plgpu.layout_cast(o.astype(BF16),
                                                             plgpu.Layout.WGMMA_TRANSPOSED)
                src = o_stage.at[c % 2]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(src, x_ref.at[bi, pl.ds(c * C, C), hi, cols])

        def step(c, carry):
            if with_out and narrow:
                return narrow_out_step(c, *carry)
            s, o_prev = carry if with_out else (carry, None)
            slot = c % _STAGES
            hi_, lo_ = split(s)
            s_hi[...] = hi_
            s_lo[...] = lo_
            plgpu.commit_smem()
            # the slot chunk c - 1 used is free: every thread passed the barrier above
            @pl.when(c + _STAGES - 1 < NT)
            def _prefetch():
                issue(c + _STAGES - 1)

            plgpu.barrier_wait(load_bar.at[slot])
            chain = (val, [(mh.at[slot], s_hi), (mh.at[slot], s_lo), (ml.at[slot], s_hi)],
                     load(ds.at[slot]))
            if not with_out:   # S_c leaves while the step's products run
                return _products((chain,), lambda: _state_out(s, stage, c % 2,
                                                              x_ref.at[bh, c, :, cols]))[0]
            q_hi_t, q_lo_t = qh.at[slot].T, ql.at[slot].T
            out = ((TILE[1], C), [(s_hi.T, q_hi_t), (s_lo.T, q_hi_t), (s_hi.T, q_lo_t)],
                   load(o0s.at[slot]))
            # chunk c - 1's outputs leave before chunk c's products are issued (the narrow
            # chain's overlapped step, `narrow_out_step`, measured 0-4% slower in this form)
            pl.when(c > 0)(lambda: o_out(o_prev, c - 1))

            def send():   # S_c leaves beside the outputs while the step's products run
                _state_out(s, stage, c % 2, st_ref.at[bh, c, :, cols], pending)
            return _products((chain, out), send if both else None)

        def narrow_out_step(c, s, o_prev):
            """Chunk c of the narrow output chain, S_c's bf16 tiles in buffer c % 2 (S_c itself,
            the carry, is read only to store it, with `with_states`): the chain's products
            are issued, then the outputs'; the next state is awaited alone, split and stored
            into the other buffer while the outputs' products (which read this one) still
            run, and chunk c - 1's outputs (and S_c) leave while all of them run."""
            slot, b = c % _STAGES, c % 2
            sh, sl = s_hi.at[b], s_lo.at[b]

            @pl.when(c + _STAGES - 1 < NT)
            def _prefetch():   # the slot is free: every thread passed the last commit's barrier
                issue(c + _STAGES - 1)

            plgpu.barrier_wait(load_bar.at[slot])
            chain = [(mh.at[slot], sh), (mh.at[slot], sl), (ml.at[slot], sh)]
            out = [(qh.at[slot], sh), (qh.at[slot], sl), (ql.at[slot], sh)]

            def run(accs):
                acc_s, acc_o = accs
                for a, b_ in chain:
                    plgpu.wgmma(acc_s, a, b_)
                for a, b_ in out:
                    plgpu.wgmma(acc_o, a, b_)
                pl.when(c > 0)(lambda: o_out(o_prev, c - 1))
                if both:
                    _state_out(s, stage, c % 2, st_ref.at[bh, c, :, cols], pending)
                nxt = plgpu.wgmma_accumulator_load(acc_s, wait_n=len(out))
                hi_, lo_ = split(nxt)
                s_hi.at[1 - b][...] = hi_
                s_lo.at[1 - b][...] = lo_
                plgpu.commit_smem()
            accs = (plgpu.ACC.init(load(ds.at[slot])), plgpu.ACC.init(load(o0s.at[slot])))
            return lax.optimization_barrier(tuple(pl.run_state(run)(accs)))

        if not with_out:
            _value_out(lax.fori_loop(0, NT, step, s_init), stage, sT_ref.at[bi, hi, :, cols])
            return
        if narrow:   # S_0's bf16 tiles, in buffer 0 (`narrow_out_step`)
            hi_, lo_ = split(s_init)
            s_hi.at[0][...] = hi_
            s_lo.at[0][...] = lo_
            plgpu.commit_smem()
        o_shape = val if narrow else (TILE[1], C)
        o_init = plgpu.layout_cast(jnp.zeros(o_shape, F32), WG)
        s_last, o_last = lax.fori_loop(0, NT, step, (s_init, o_init))
        o_out(o_last, NT - 1)
        _value_out(s_last, stage, sT_ref.at[bi, hi, :, cols])

    def ring(shape, dtype=BF16, swizzle=None):
        return swizzled((_STAGES,) + shape, dtype, swizzle)
    opnd = 2 * BV   # the A operands' swizzle: the bytes of the B operands' bf16 rows
    tiles = [ring(TILE, BF16, opnd), ring(TILE, BF16, opnd), ring(val, F32)]   # M hi / lo, D
    if with_out and narrow:
        tiles += [ring(TILE, BF16, opnd), ring(TILE, BF16, opnd),         # [Q; 0] hi / lo
                  ring(val, F32), swizzled((2,) + val)]                    # [O0; 0], o staging
    elif with_out:
        tiles += [ring((C, 64)), ring((C, 64)), ring((64, C), F32),         # Q hi / lo, O0^T
                  swizzled((2, C, 64))]                                    # o staging
    states = jax.ShapeDtypeStruct((BH, NT) + TILE, F32)
    out_type = ((jax.ShapeDtypeStruct((B, NT * C, H, 64), BF16),) if with_out else ()) \
        + ((states,) if with_states or not with_out else ()) \
        + (jax.ShapeDtypeStruct((B, H) + TILE, F32),)
    name = "wkv7_mosaic_seq_fwd" + ("_out" if with_out else "") + ("_states" if both else "")
    return _launch(body, tiles, 6 if with_out else 3, B, H, out_type, name, BV,
                   state_buffers=2 if with_out and narrow else 1)


def _launch(body, tiles, loads_per_chunk, B, H, out_type, name, BV, state_buffers=1):
    """`plgpu.kernel` of a chain: grid (B, H, 64 / BV), one warpgroup; scratch = `tiles` (the
    maps' ring and what else the chain needs), the carried value's bf16 hi / lo operand tiles
    [64, BV] (`state_buffers` of each), two float32 [64, BV] staging tiles, the ring's barriers
    and one for the start value."""
    val = (64, BV)
    s_tile = val if state_buffers == 1 else (state_buffers,) + val
    scratch = (*tiles, swizzled(s_tile), swizzled(s_tile), swizzled((2,) + val, F32),
               plgpu.Barrier(num_arrivals=loads_per_chunk, num_barriers=_STAGES),
               plgpu.Barrier(num_arrivals=1))
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(body, out_type=tuple(out_type), scratch_types=scratch,
                        grid=(B, H, 64 // BV), grid_names=("b", "h", "j"),
                        compiler_params=params, kernel_name=name)


def _backward_kernel(BH, NT, H, BV=64):
    val = (64, BV)

    def body(mh_ref, ml_ref, qh_ref, ql_ref, do_ref, dsT_ref, dS_ref, ds0_ref,
             mh, ml, qh, ql, dos, g_hi, g_lo, stage, load_bar, s0_bar):
        bi, hi, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
        bh = bi * H + hi
        cols = pl.ds(j * BV, BV)
        bottom = pl.ds(_C, _C)

        def issue(i):
            c = NT - 1 - i
            slot = i % _STAGES
            bar = load_bar.at[slot]
            plgpu.copy_gmem_to_smem(mh_ref.at[bh, c], mh.at[slot], bar)
            plgpu.copy_gmem_to_smem(ml_ref.at[bh, c], ml.at[slot], bar)
            plgpu.copy_gmem_to_smem(qh_ref.at[bh, c], qh.at[slot, bottom], bar)
            plgpu.copy_gmem_to_smem(ql_ref.at[bh, c], ql.at[slot, bottom], bar)
            plgpu.copy_gmem_to_smem(do_ref.at[bi, pl.ds(c * _C, _C), hi, cols],
                                    dos.at[slot, bottom], bar)

        # the upper halves of the Q and dO tiles stay zero: their products add nothing
        _zero_ring(((qh, BF16), (ql, BF16), (dos, BF16)))
        for i in range(min(_STAGES - 1, NT)):
            issue(i)
        g_init = _value_in(dsT_ref.at[bi, hi, :, cols], stage, s0_bar)

        def step(i, g):
            c = NT - 1 - i
            slot = i % _STAGES
            hi_, lo_ = split(g)
            g_hi[...] = hi_
            g_lo[...] = lo_
            plgpu.commit_smem()

            @pl.when(i + _STAGES - 1 < NT)
            def _prefetch():
                issue(i + _STAGES - 1)

            plgpu.barrier_wait(load_bar.at[slot])
            m_hi_t, m_lo_t = mh.at[slot].T, ml.at[slot].T
            terms = [(m_hi_t, g_hi), (m_hi_t, g_lo), (m_lo_t, g_hi),
                     (qh.at[slot].T, dos.at[slot]), (ql.at[slot].T, dos.at[slot])]
            # dS_c leaves while the step's products run
            return _products(((val, terms, None),),
                             lambda: _state_out(g, stage, i % 2, dS_ref.at[bh, c, :, cols]))[0]

        _value_out(lax.fori_loop(0, NT, step, g_init), stage, ds0_ref.at[bi, hi, :, cols])

    # M hi / lo, [0; Q] hi / lo (the A operands: the swizzle of the B operands' bf16 rows),
    # [0; dO]
    tiles = (tuple(swizzled((_STAGES,) + TILE, BF16, 2 * BV) for _ in range(4))
             + (swizzled((_STAGES,) + val),))
    B = BH // H
    out_type = (jax.ShapeDtypeStruct((BH, NT) + TILE, F32),
                jax.ShapeDtypeStruct((B, H) + TILE, F32))
    return _launch(body, tiles, 5, B, H, out_type, "wkv7_mosaic_seq_bwd", BV)


def check_maps(fn: str, M_hi, M_lo, D) -> None:
    """The forward chain's contract, errors named after `fn`."""
    if M_hi.ndim != 4 or M_hi.shape[2:] != TILE:
        raise ValueError(f"{fn}: M_hi must be [BH, NT, 64, 64], got {M_hi.shape}")
    for name, x, dt in (("M_hi", M_hi, BF16), ("M_lo", M_lo, BF16), ("D", D, F32)):
        if x.shape != M_hi.shape or x.dtype != dt:
            raise ValueError(f"{fn}: {name} must be {dt.__name__} {M_hi.shape}, "
                             f"got {x.dtype} {x.shape}")


BLOCKS_V = (16, 32, 64)   # value columns per CTA the chains take


def _check_block(fn: str, block_v) -> None:
    if block_v not in BLOCKS_V:
        raise ValueError(f"{fn}: block_v must be one of {BLOCKS_V}, got {block_v!r}")


@functools.partial(jax.jit, static_argnames=("block_v",))
def forward_states(M_hi, M_lo, D, s0, *, block_v=64):
    """Forward chain (module docstring), `block_v` value columns per CTA. `s0` [B, H, 64, 64]
    float32. Returns `(states [BH, NT, 64, 64], final_state [B, H, 64, 64])`, float32."""
    check_maps("forward_states", M_hi, M_lo, D)
    _check_block("forward_states", block_v)
    B, H = s0.shape[:2]
    BH, NT = M_hi.shape[:2]
    if BH != B * H or s0.shape[2:] != TILE:
        raise ValueError(f"forward_states: s0 must be [B, H, 64, 64] with B * H = {BH}, "
                         f"got {s0.shape}")
    return _forward_kernel(BH, NT, H, False, BV=block_v)(M_hi, M_lo, D, s0.astype(F32))


@functools.partial(jax.jit, static_argnames=("H", "block_v"))
def backward_states(M_hi, M_lo, Q_hi, Q_lo, do, dsT, *, H, block_v=64):
    """Backward chain (module docstring), `block_v` value columns per CTA. Returns `(dS_end
    [BH, NT, 64, 64], d_initial_state [B, H, 64, 64])`, float32."""
    _check_block("backward_states", block_v)
    BH, NT = M_hi.shape[:2]
    B = BH // H
    want_q = (BH, NT, _C, 64)
    for name, x in (("Q_hi", Q_hi), ("Q_lo", Q_lo)):
        if x.shape != want_q or x.dtype != BF16:
            raise ValueError(f"backward_states: {name} must be bfloat16 {want_q}, got "
                             f"{x.dtype} {x.shape}")
    if do.shape != (B, NT * _C, H, 64) or do.dtype != BF16:
        raise ValueError(f"backward_states: do must be bfloat16 {(B, NT * _C, H, 64)}, got "
                         f"{do.dtype} {do.shape}")
    return _backward_kernel(BH, NT, H, block_v)(M_hi, M_lo, Q_hi, Q_lo, do, dsT.astype(F32))


@functools.partial(jax.jit, static_argnames=("H", "block_v", "with_states", "warp_specialized"))
def forward_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, *, H, block_v=64, with_states=False,
                    warp_specialized=True):
    """Forward chain writing the outputs instead of the chunk states (`_forward_kernel`), or
    with `with_states` both, `block_v` value columns per CTA. At 16 or 32 columns without the
    states it runs on two warpgroups (`output_chain.py`: the same outputs bit for bit, measured
    faster) unless `warp_specialized` is False. `Q_hi, Q_lo` [BH, NT, 32, 64]
    bfloat16 (a `split_bf16` pair); `O0` float32, each chunk's O0 transposed [BH, NT, 64, 32]
    (value rows, token columns) at `block_v` = 64, else as is [BH, NT, 32, 64]. Returns `(o
    [B, NT * 32, H, 64] bfloat16[, states [BH, NT, 64, 64] float32], final_state [B, H, 64,
    64] float32)`."""
    check_maps("forward_outputs", M_hi, M_lo, D)
    _check_block("forward_outputs", block_v)
    BH, NT = M_hi.shape[:2]
    want = {"Q_hi": ((BH, NT, _C, 64), BF16), "Q_lo": ((BH, NT, _C, 64), BF16),
            "O0": ((BH, NT) + ((64, _C) if block_v == 64 else (_C, 64)), F32),
            "s0": ((BH // H, H, 64, 64), F32)}
    for (name, (shape, dt)), x in zip(want.items(), (Q_hi, Q_lo, O0, s0)):
        if x.shape != shape or (x.dtype != dt and name != "s0"):
            raise ValueError(f"forward_outputs: {name} must be {dt.__name__} {shape}, got "
                             f"{x.dtype} {x.shape}")
    if warp_specialized and block_v < 64 and not with_states:
        from lwm_jax.ops.wkv7.mosaic_gpu.output_chain import warp_specialized_outputs
        return warp_specialized_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, H=H, block_v=block_v)
    return _forward_kernel(BH, NT, H, True, BV=block_v, with_states=with_states)(
        M_hi, M_lo, D, Q_hi, Q_lo, O0, s0.astype(F32))
