"""The narrow forward output chain on two warpgroups: the chain on one, the outputs on the other.

    o, final = warp_specialized_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, H=H, block_v=BV)

Same contract as `state_pass.forward_outputs` at `block_v` = 16 or 32 without the chunk
states (shapes there): o_c = Q_c S_c + O0_c, S_{c+1} = M_c S_c + D_c, bf16x3 products.

Why two warpgroups: in the one-warpgroup chain the step's critical path is the chain's
products, reading the next state back, its bf16 split and the shared-memory stores the next
products read; the outputs' products and stores queue beside it on the same warps. Here
warpgroup 0 runs only that critical path and warpgroup 1 forms and stores the outputs:

  warpgroup 0, chunk c: wait for M_c, D_c; S_{c+1} = D_c + M_c S_c (S_c's bf16 tiles in buffer
    c % 2); wait until warpgroup 1 has read buffer (c + 1) % 2 (it held S_{c-1}); split
    S_{c+1} into it; signal `ready[(c + 1) % 2]`.
  warpgroup 1, chunk c: wait for Q_c, O0_c and `ready[c % 2]`; o_c = O0_c + Q_c S_c; signal
    `free[c % 2]`; o_c leaves by TMA.

One `ready` and one `free` barrier per state buffer: a single pair could complete two phases
before the other warpgroup waits for the first, which a phase-parity wait cannot tell apart.
Each warpgroup has its own ring of maps (`_STAGES` chunks) and issues its own loads; both
meet at a last barrier before leaving (a warpgroup that exits while the other still issues
wgmma can fault).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lwm_jax.ops.wkv7.mosaic_gpu.state_pass import (_C, _STAGES, _products, _value_in,
                                                    _value_out, _zero_ring)
from lwm_jax.ops.wkv7.mosaic_gpu.tiles import (BF16, F32, TILE, load, pl, plgpu, split,
                                               swizzled)


def _kernel(BH, NT, H, BV):
    B = BH // H
    C = _C
    val = (64, BV)
    top = pl.ds(0, C)

    def body(mh_ref, ml_ref, d_ref, qh_ref, ql_ref, o0_ref, s0_ref, o_ref, sT_ref,
             mh, ml, ds, qh, ql, o0s, o_stage, s_hi, s_lo, stage,
             map_bar, out_bar, s0_bar, ready, free, done):
        bi, hi, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
        wg = lax.axis_index("wg")
        bh = bi * H + hi
        cols = pl.ds(j * BV, BV)

        @pl.when(wg == 0)
        def _chain():
            def issue(c):
                slot = c % _STAGES
                bar = map_bar.at[slot]
                plgpu.copy_gmem_to_smem(mh_ref.at[bh, c], mh.at[slot], bar)
                plgpu.copy_gmem_to_smem(ml_ref.at[bh, c], ml.at[slot], bar)
                plgpu.copy_gmem_to_smem(d_ref.at[bh, c, :, cols], ds.at[slot], bar)

            for c in range(min(_STAGES - 1, NT)):
                issue(c)
            s_init = _value_in(s0_ref.at[bi, hi, :, cols], stage, s0_bar)
            hi_, lo_ = split(s_init)
            s_hi.at[0][...] = hi_
            s_lo.at[0][...] = lo_
            plgpu.commit_smem()
            plgpu.barrier_arrive(ready.at[0])

            def step(c, s):
                slot, b = c % _STAGES, c % 2

                @pl.when(c + _STAGES - 1 < NT)
                def _prefetch():   # the slot is free: this warpgroup's products of c - 1 ended
                    issue(c + _STAGES - 1)

                plgpu.barrier_wait(map_bar.at[slot])
                sh, sl = s_hi.at[b], s_lo.at[b]
                terms = [(mh.at[slot], sh), (mh.at[slot], sl), (ml.at[slot], sh)]
                nxt = _products(((val, terms, load(ds.at[slot])),))[0]

                @pl.when(c > 0)
                def _buffer_read():   # the outputs of chunk c - 1 have read S_{c-1}
                    plgpu.barrier_wait(free.at[1 - b])

                hi_, lo_ = split(nxt)
                s_hi.at[1 - b][...] = hi_
                s_lo.at[1 - b][...] = lo_
                plgpu.commit_smem()
                plgpu.barrier_arrive(ready.at[1 - b])
                return nxt

            _value_out(lax.fori_loop(0, NT, step, s_init), stage, sT_ref.at[bi, hi, :, cols])

        @pl.when(wg == 1)
        def _outputs():
            # the lower halves of the [Q; 0] and [O0; 0] tiles stay zero: their rows add nothing
            _zero_ring(((qh, BF16), (ql, BF16), (o0s, F32)))

            def issue(c):
                slot = c % _STAGES
                bar = out_bar.at[slot]
                plgpu.copy_gmem_to_smem(qh_ref.at[bh, c], qh.at[slot, top], bar)
                plgpu.copy_gmem_to_smem(ql_ref.at[bh, c], ql.at[slot, top], bar)
                plgpu.copy_gmem_to_smem(o0_ref.at[bh, c, :, cols], o0s.at[slot, top], bar)

            for c in range(min(_STAGES - 1, NT)):
                issue(c)

            def step(c, carry):
                slot, b = c % _STAGES, c % 2

                @pl.when(c + _STAGES - 1 < NT)
                def _prefetch():
                    issue(c + _STAGES - 1)

                plgpu.barrier_wait(out_bar.at[slot])
                plgpu.barrier_wait(ready.at[b])
                sh, sl = s_hi.at[b], s_lo.at[b]
                terms = [(qh.at[slot], sh), (qh.at[slot], sl), (ql.at[slot], sh)]
                o = _products(((val, terms, load(o0s.at[slot])),))[0]
                plgpu.barrier_arrive(free.at[b])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # o of chunk c - 2 has left
                o_stage.at[b][...] = o.astype(BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_stage.at[b, top],
                                        o_ref.at[bi, pl.ds(c * C, C), hi, cols])
                return carry

            lax.fori_loop(0, NT, step, None)
            plgpu.wait_smem_to_gmem(0)

        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    opnd = 2 * BV   # the [64, 64] operands' swizzle: the bytes of the state tiles' bf16 rows

    def ring(shape, dtype=BF16, swizzle=None):
        return swizzled((_STAGES,) + shape, dtype, swizzle)
    scratch = (ring(TILE, BF16, opnd), ring(TILE, BF16, opnd), ring(val, F32),   # M hi / lo, D
               ring(TILE, BF16, opnd), ring(TILE, BF16, opnd), ring(val, F32),   # [Q; 0], [O0; 0]
               swizzled((2,) + val),                                           # o staging
               swizzled((2,) + val), swizzled((2,) + val),                     # S hi / lo
               swizzled((2,) + val, F32),                                      # s0 / final
               plgpu.Barrier(num_arrivals=3, num_barriers=_STAGES),
               plgpu.Barrier(num_arrivals=3, num_barriers=_STAGES),
               plgpu.Barrier(num_arrivals=1),
               plgpu.Barrier(num_arrivals=1, num_barriers=2),     # ready: S in buffer b
               plgpu.Barrier(num_arrivals=1, num_barriers=2),     # free: buffer b read
               plgpu.Barrier(num_arrivals=2))                     # both warpgroups done
    out_type = (jax.ShapeDtypeStruct((B, NT * C, H, 64), BF16),
                jax.ShapeDtypeStruct((B, H) + TILE, F32))
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch,
                        grid=(B, H, 64 // BV), grid_names=("b", "h", "j"),
                        num_threads=2, thread_name="wg", compiler_params=params,
                        kernel_name="wkv7_mosaic_seq_fwd_out_ws")


@functools.partial(jax.jit, static_argnames=("H", "block_v"))
def warp_specialized_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, *, H, block_v):
    """`state_pass.forward_outputs` (without chunk states) at `block_v` = 16 or 32 on two
    warpgroups (module docstring). Returns `(o [B, NT * 32, H, 64] bfloat16, final_state
    [B, H, 64, 64] float32)`."""
    if block_v not in (16, 32):
        raise ValueError(f"warp_specialized_outputs: block_v must be 16 or 32, got {block_v!r}")
    BH, NT = M_hi.shape[:2]
    return _kernel(BH, NT, H, block_v)(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0.astype(F32))
