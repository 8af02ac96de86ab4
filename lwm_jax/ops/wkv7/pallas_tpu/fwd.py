"""WKV7 forward as a Pallas TPU (Mosaic) kernel: grid (heads, chunks), state carried in VMEM.

Grid: `(N, NT)` with N = B*H (`parallel`) and NT = T / C chunks (`arbitrary`: sequential, in
order). Each grid step loads one chunk `[C, K]` of r/w/k/a/b and `[C, V]` of v, runs
`tiles.chunk_forward` against the state held in a float32 VMEM scratch `[V, K]`, writes the
chunk's output and leaves the new state in the scratch for the next chunk. The final state is
written once, at the last chunk. With `save_states=True` the state at the START of every chunk is
also written out (`[N, NT, V, K]` float32): the backward kernel's residual.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lwm_jax.ops.wkv7.pallas_tpu.tiles import chunk_forward, chunk_masks

SQ = pl.squeezed  # a block dimension of size 1 that the kernel does not see


def _fwd_kernel(*refs, C, n_chunks, has_seg, save_states, precision):
    if has_seg:
        (r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, h0_ref, seg_col_ref, seg_row_ref,
         *out_refs, state_ref) = refs
        masks = chunk_masks(C, seg_col_ref[...], seg_row_ref[...])
    else:
        r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, h0_ref, *out_refs, state_ref = refs
        masks = chunk_masks(C)
    o_ref, hT_ref = out_refs[:2]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _load_initial_state():
        state_ref[...] = h0_ref[...]

    ST0 = state_ref[...]
    if save_states:
        out_refs[2][...] = ST0
    f32 = lambda ref: ref[...].astype(jnp.float32)
    o, ST = chunk_forward(f32(r_ref), f32(w_ref), f32(k_ref), f32(v_ref), f32(a_ref),
                          f32(b_ref), ST0, masks, precision)
    o_ref[...] = o.astype(o_ref.dtype)
    state_ref[...] = ST

    @pl.when(j == n_chunks - 1)
    def _store_final_state():
        hT_ref[...] = ST


def wkv7_fwd_pallas(r, w, k, v, a, b, h0, seg_col, seg_row, *, H, C, output_dtype,
                    save_states, precision, interpret):
    """Run the forward kernel on head-major arrays.

    Args:
      r, w, k, a, b: `[N, T, K]` (N = B*H, T a multiple of C); v: `[N, T, V]`.
      h0: `[N, V, K]` float32 initial state (transposed: [value, key]).
      seg_col: int32 `[B, T, 1]` per-chunk reset counters (see `tiles`), or None.
      seg_row: int32 `[B, NT, 1, C]` the same counters laid out as rows, or None.
      H: heads per batch row (grid row n reads the segment arrays of batch row n // H).
      C: chunk length (multiple of 16).
      output_dtype: dtype of `o`.
      save_states: also return the chunk-start states.
      precision: `jax.lax.Precision` of the in-kernel matmuls.
      interpret: passed to `pl.pallas_call`.

    Returns:
      `o [N, T, V]` (output_dtype), `hT [N, V, K]` float32, and with save_states
      `states [N, NT, V, K]` float32.
    """
    N, T, K = r.shape
    V = v.shape[-1]
    NT = T // C
    has_seg = seg_col is not None
    key_spec = pl.BlockSpec((SQ, C, K), lambda n, j: (n, j, 0))
    val_spec = pl.BlockSpec((SQ, C, V), lambda n, j: (n, j, 0))
    state_spec = pl.BlockSpec((SQ, V, K), lambda n, j: (n, 0, 0))
    in_specs = [key_spec, key_spec, key_spec, val_spec, key_spec, key_spec, state_spec]
    args = [r, w, k, v, a, b, h0]
    if has_seg:
        batch = lambda n: jax.lax.div(n, H)  # not `//`: floor division lowers via sign on TPU
        in_specs += [pl.BlockSpec((SQ, C, 1), lambda n, j: (batch(n), j, 0)),
                     pl.BlockSpec((SQ, SQ, 1, C), lambda n, j: (batch(n), j, 0, 0))]
        args += [seg_col, seg_row]
    out_shape = [jax.ShapeDtypeStruct((N, T, V), output_dtype),
                 jax.ShapeDtypeStruct((N, V, K), jnp.float32)]
    out_specs = [val_spec, state_spec]
    if save_states:
        out_shape.append(jax.ShapeDtypeStruct((N, NT, V, K), jnp.float32))
        out_specs.append(pl.BlockSpec((SQ, SQ, V, K), lambda n, j: (n, j, 0, 0)))
    kernel = functools.partial(_fwd_kernel, C=C, n_chunks=NT, has_seg=has_seg,
                               save_states=save_states, precision=precision)
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(N, NT),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        scratch_shapes=[pltpu.VMEM((V, K), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="wkv7_fwd_tpu",
    )(*args)
