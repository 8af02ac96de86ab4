"""WKV7 backward as a Pallas TPU (Mosaic) kernel: reverse chunk sweep, dstate carried in VMEM.

Grid: `(N, NT)` with N = B*H (`parallel`) and the chunk axis (`arbitrary`) walked from the last
chunk to the first (block index `NT - 1 - j`). Each step reads the chunk's inputs, the state at
the chunk's start (saved by the forward kernel, `[N, NT, V, K]` float32) and the output cotangent,
recomputes the chunk's intra-chunk terms and runs `tiles.chunk_backward` against the gradient
w.r.t. the chunk's end state held in a float32 VMEM scratch `[V, K]`. Nothing per token beyond the
inputs' own size is stored.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lwm_jax.ops.wkv7.pallas_tpu.tiles import chunk_backward, chunk_masks

SQ = pl.squeezed  # a block dimension of size 1 that the kernel does not see


def _bwd_kernel(*refs, C, n_chunks, has_seg, precision):
    if has_seg:
        (r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, s0_ref, do_ref, dhT_ref, seg_col_ref,
         seg_row_ref, *out_refs, dstate_ref) = refs
        masks = chunk_masks(C, seg_col_ref[...], seg_row_ref[...])
    else:
        (r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, s0_ref, do_ref, dhT_ref,
         *out_refs, dstate_ref) = refs
        masks = chunk_masks(C)
    dr_ref, dw_ref, dk_ref, dv_ref, da_ref, db_ref, dh0_ref = out_refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _load_final_state_cotangent():
        dstate_ref[...] = dhT_ref[...]

    f32 = lambda ref: ref[...].astype(jnp.float32)
    grads = chunk_backward(f32(r_ref), f32(w_ref), f32(k_ref), f32(v_ref), f32(a_ref),
                           f32(b_ref), s0_ref[...], f32(do_ref), dstate_ref[...], masks,
                           precision)
    for ref, g in zip((dr_ref, dw_ref, dk_ref, dv_ref, da_ref, db_ref), grads[:6]):
        ref[...] = g.astype(ref.dtype)
    dstate_ref[...] = grads[6]

    @pl.when(j == n_chunks - 1)
    def _store_initial_state_cotangent():
        dh0_ref[...] = grads[6]


def wkv7_bwd_pallas(r, w, k, v, a, b, states, do, dhT, seg_col, seg_row, *, H, C, precision,
                    interpret):
    """Run the backward kernel on head-major arrays.

    Args:
      r, w, k, a, b: `[N, T, K]`; v: `[N, T, V]` (the forward's inputs).
      states: `[N, NT, V, K]` float32 chunk-start states from the forward kernel.
      do: `[N, T, V]` output cotangent (any float dtype).
      dhT: `[N, V, K]` float32 cotangent of the final state (transposed).
      seg_col, seg_row, H, C, precision, interpret: as in `wkv7_fwd_pallas`.

    Returns:
      `(dr, dw, dk, dv, da, db, dh0)`: gradients in the dtypes of r, w, k, v, a, b and
      `dh0 [N, V, K]` float32.
    """
    N, T, K = r.shape
    V = v.shape[-1]
    NT = T // C
    has_seg = seg_col is not None
    rev = lambda n, j: (n, NT - 1 - j, 0)
    key_spec = pl.BlockSpec((SQ, C, K), rev)
    val_spec = pl.BlockSpec((SQ, C, V), rev)
    state_spec = pl.BlockSpec((SQ, V, K), lambda n, j: (n, 0, 0))
    in_specs = [key_spec, key_spec, key_spec, val_spec, key_spec, key_spec,
                pl.BlockSpec((SQ, SQ, V, K), lambda n, j: (n, NT - 1 - j, 0, 0)),
                val_spec, state_spec]
    args = [r, w, k, v, a, b, states, do, dhT]
    if has_seg:
        batch = lambda n: jax.lax.div(n, H)  # not `//`: floor division lowers via sign on TPU
        in_specs += [pl.BlockSpec((SQ, C, 1), lambda n, j: (batch(n), NT - 1 - j, 0)),
                     pl.BlockSpec((SQ, SQ, 1, C), lambda n, j: (batch(n), NT - 1 - j, 0, 0))]
        args += [seg_col, seg_row]
    out_shape = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (r, w, k, v, a, b)) + (
        jax.ShapeDtypeStruct((N, V, K), jnp.float32),)
    out_specs = (key_spec, key_spec, key_spec, val_spec, key_spec, key_spec, state_spec)
    kernel = functools.partial(_bwd_kernel, C=C, n_chunks=NT, has_seg=has_seg,
                               precision=precision)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(N, NT),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((V, K), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="wkv7_bwd_tpu",
    )(*args)
