"""Chunk-parallel WKV7 in pure JAX (float32 inside; the reference algebra for chunked kernels).

1. Pad T up to a multiple of the chunk length C with tokens that change nothing (w = 0 and
   r = k = v = a = b = 0: the state passes through them untouched), and cut into chunks.
2. For every chunk at once (`chunk_terms`): intra-chunk matrices, the triangular solve for the
   rank-1 (a, b) coupling, and the affine map `S_end = M S_start + S_intra`, `o = Q S_start + O`.
3. `lax.scan` over chunks carries the state ([K, K] x [K, V] matmul per chunk and head).
4. Outputs of all chunks from their start states, then un-pad.
Gradients (to every input and to `initial_state`) come from JAX autodiff of these steps.

Memory: step 2 builds pairwise decay tensors `[.., C, c, K]` per chunk (c = sub-block length,
16) and several `[.., C, C]` matrices; for all chunks at once that is about 14 GiB of float32
temporaries for fwd+bwd at B, T, H, K = 8, 4096, 12, 64, and a model kept them for every layer.
So step 2 runs as a `lax.map` over groups of chunks (`GROUP_BUDGET` bounds one group's largest
temporary), each group under `jax.checkpoint`: its backward recomputes one group at a time. The
op as a whole is checkpointed too and keeps for the backward only the chunk terms and the
chunk-start states (`[B, H, T, K]`-sized, `lwm_jax.remat_names.WKV7_CHUNK_TERMS_NAME` /
`WKV7_CHUNK_STATES_NAME`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.ops.segments import segment_counter
from lwm_jax.ops.wkv7.chunk_math import RoundedOperands, chunk_terms, product, sub_block_size
from lwm_jax.remat_names import WKV7_CHUNK_STATES_NAME, WKV7_CHUNK_TERMS_NAME



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


_SAVE = jax.checkpoint_policies.save_only_these_names(WKV7_CHUNK_STATES_NAME,
                                                      WKV7_CHUNK_TERMS_NAME)
GROUP_BUDGET = 1 << 25   # float32 entries of one chunk group's largest temporary (128 MiB)


@functools.partial(jax.jit, static_argnames=("chunk_size", "output_dtype", "precision"))
def wkv7_chunked(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype,
                 precision="highest"):
    """Chunk-parallel WKV7 (inputs already validated by `dispatch.wkv7`).

    Args:
      r, w, k, a, b: `[B, T, H, K]`; v: `[B, T, H, V]` (any float dtype; upcast to float32).
      initial_state: `[B, H, K, V]` or None (zeros).
      segment_ids: int `[B, T]` or None.
      chunk_size: C (static). Any C >= 1 works; 64 suits accelerators, 16-32 suits CPUs.
      output_dtype: dtype of `o` (static).
      precision: matmul precision name of the input products ("default" | "high" |
        "highest", static), or a `RoundedOperands` (a model of short-operand products); the
        log-decay interval sums are always exact fp32.

    Returns:
      `(o [B, T, H, V] in output_dtype, final_state [B, H, K, V] float32)`.
    """
    if not isinstance(precision, RoundedOperands):
        precision = jax.lax.Precision(precision)
    body = functools.partial(_chunked, chunk_size=chunk_size, output_dtype=output_dtype,
                             precision=precision)
    return jax.checkpoint(body, policy=_SAVE)(r, w, k, v, a, b, initial_state, segment_ids)


def _chunked(r, w, k, v, a, b, initial_state, segment_ids, *, chunk_size, output_dtype,
             precision):
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
    terms = _grouped_chunk_terms((r_c, w_c, k_c, v_c, a_c, b_c), masks, C, precision)
    Q_CK, O_CV, M_KK, S_KV = (checkpoint_name(x, WKV7_CHUNK_TERMS_NAME) for x in terms)

    if initial_state is None:
        S0_BHKV = jnp.zeros((B, H, K, V), jnp.float32)
    else:
        S0_BHKV = initial_state.astype(jnp.float32)

    def step(S_BHKV, xs):
        M_BHKK, Sin_BHKV = xs
        S_next = product("bhkj,bhjv->bhkv", M_BHKK, S_BHKV, precision=precision) + Sin_BHKV
        return S_next, S_BHKV

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # [B, H, NC, ...] -> [NC, B, H, ...]
    S_final, S_start_NBHKV = jax.lax.scan(step, S0_BHKV, (chunk_major(M_KK), chunk_major(S_KV)))
    S_start = checkpoint_name(jnp.moveaxis(S_start_NBHKV, 0, 2),
                              WKV7_CHUNK_STATES_NAME)                   # [B,H,NC,K,V]
    o_BHNCV = product("bhnck,bhnkv->bhncv", Q_CK, S_start, precision=precision) + O_CV
    o_BTHV = o_BHNCV.transpose(0, 2, 3, 1, 4).reshape(B, NC * C, H, V)[:, :T]
    return o_BTHV.astype(output_dtype), S_final


def _grouped_chunk_terms(inputs, masks, C, precision):
    """`chunk_terms` of every chunk, computed over groups of G chunks with `lax.map`.

    inputs: r, w, k, v, a, b as `[B, H, NC, C, D]` float32; masks: None or arrays shaped
    `[B, 1, NC, ...]`. G is the largest divisor of NC whose group keeps the biggest temporary
    (pairwise decays `[B, H, G, C, c, K]` or `[B, H, G, C, C]` matrices) within `GROUP_BUDGET`
    entries. Each group is checkpointed, so its backward holds one group's temporaries.
    """
    B, H, NC, _, K = inputs[0].shape
    c = sub_block_size(C)
    per_chunk = B * H * C * max(c * K, C)
    cap = max(1, GROUP_BUDGET // per_chunk)
    G = max(d for d in range(1, min(NC, cap) + 1) if NC % d == 0)
    if G == NC:
        return chunk_terms(*inputs, masks, c, precision)
    NG = NC // G

    def split(x):   # [B, H, NC, ...] -> [NG, B, H, G, ...]
        return jnp.moveaxis(x.reshape(*x.shape[:2], NG, G, *x.shape[3:]), 2, 0)

    def merge(x):   # [NG, B, H, G, ...] -> [B, H, NC, ...]
        return jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], NC, *x.shape[4:])

    group = jax.checkpoint(lambda xs_ms: chunk_terms(*xs_ms[0], xs_ms[1], c, precision))
    groups = (tuple(split(x) for x in inputs),
              None if masks is None else tuple(split(m) for m in masks))
    return tuple(merge(x) for x in jax.lax.map(group, groups))
