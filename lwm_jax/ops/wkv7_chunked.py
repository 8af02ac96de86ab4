"""Chunk-parallel WKV7 in pure JAX (float32 inside; the reference algebra for chunked kernels).

1. Pad T up to a multiple of the chunk length C with tokens that change nothing (w = 0 and
   r = k = v = a = b = 0: the state passes through them untouched), and cut into chunks.
2. For every chunk at once (`chunk_terms`): intra-chunk matrices, the triangular solve for the
   rank-1 (a, b) coupling, and the affine map `S_end = M S_start + S_intra`, `o = Q S_start + O`.
3. `lax.scan` over chunks carries the state ([K, K] x [K, V] matmul per chunk and head).
4. Outputs of all chunks from their start states, then un-pad.
Gradients (to every input and to `initial_state`) come from JAX autodiff of these steps.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lwm_jax.ops.segments import segment_counter
from lwm_jax.ops.wkv7_chunk_math import chunk_terms, sub_block_size

_HIGHEST = jax.lax.Precision.HIGHEST


def _document_masks(segment_ids, B, NC, C, pad):
    """Masks for `chunk_terms` (shapes `[B, 1, NC, ...]`, broadcast over heads) from segment ids.

    Padding repeats each row's last id, so padded tokens never start a new document.
    """
    seg_BT = jnp.pad(jnp.asarray(segment_ids), ((0, 0), (0, pad)), mode="edge")
    cnt = segment_counter(seg_BT).reshape(B, 1, NC, C)
    # Counter of the token just before each chunk (position -1 counts as document 0).
    if NC == 1:
        cnt_prev = jnp.zeros((B, 1, 1), cnt.dtype)
    else:
        cnt_prev = jnp.pad(cnt[:, :, :-1, -1], ((0, 0), (0, 0), (1, 0)))
    same_ts = cnt[..., :, None] == cnt[..., None, :]
    m0 = cnt == cnt_prev[..., None]
    m_end = cnt == cnt[..., -1:]
    return same_ts, m0, m_end


@functools.partial(jax.jit, static_argnames=("chunk_size", "output_dtype"))
def wkv7_chunked(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype):
    """Chunk-parallel WKV7 (inputs already validated by `lwm_jax.ops.wkv7`).

    Args:
      r, w, k, a, b: `[B, T, H, K]`; v: `[B, T, H, V]` (any float dtype; upcast to float32).
      initial_state: `[B, H, K, V]` or None (zeros).
      segment_ids: int `[B, T]` or None.
      chunk_size: C (static). Any C >= 1 works; 64 suits accelerators, 16-32 suits CPUs.
      output_dtype: dtype of `o` (static).

    Returns:
      `(o [B, T, H, V] in output_dtype, final_state [B, H, K, V] float32)`.
    """
    B, T, H, K = r.shape
    V = v.shape[-1]
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T

    def to_chunks(x):  # [B, T, H, D] -> [B, H, NC, C, D], float32, zero padded
        x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(B, NC, C, H, x.shape[-1]).transpose(0, 3, 1, 2, 4)

    r_c, w_c, k_c, v_c, a_c, b_c = (to_chunks(x) for x in (r, w, k, v, a, b))
    masks = None if segment_ids is None else _document_masks(segment_ids, B, NC, C, pad)
    Q_CK, O_CV, M_KK, S_KV = chunk_terms(r_c, w_c, k_c, v_c, a_c, b_c, masks, sub_block_size(C))

    if initial_state is None:
        S0_BHKV = jnp.zeros((B, H, K, V), jnp.float32)
    else:
        S0_BHKV = initial_state.astype(jnp.float32)

    def step(S_BHKV, xs):
        M_BHKK, Sin_BHKV = xs
        S_next = jnp.einsum("bhkj,bhjv->bhkv", M_BHKK, S_BHKV, precision=_HIGHEST,
                            preferred_element_type=jnp.float32) + Sin_BHKV
        return S_next, S_BHKV

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # [B, H, NC, ...] -> [NC, B, H, ...]
    S_final, S_start_NBHKV = jax.lax.scan(step, S0_BHKV, (chunk_major(M_KK), chunk_major(S_KV)))
    S_start = jnp.moveaxis(S_start_NBHKV, 0, 2)  # [B, H, NC, K, V]
    o_BHNCV = jnp.einsum("bhnck,bhnkv->bhncv", Q_CK, S_start, precision=_HIGHEST,
                         preferred_element_type=jnp.float32) + O_CV
    o_BTHV = o_BHNCV.transpose(0, 2, 3, 1, 4).reshape(B, NC * C, H, V)[:, :T]
    return o_BTHV.astype(output_dtype), S_final
