"""WKV7 as a token-by-token `lax.scan` (simple, exact, slow: T sequential steps).

Per head, state S in R^{K x V} indexed [key, value]:
`S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T`, `o_t = S_t^T r_t`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lwm_jax.ops.segments import reset_flags


def recurrent_scan(r, w, k, v, a, b, initial_state, segment_ids, compute_dtype=jnp.float32):
    """The recurrence in `compute_dtype` (float32; float64 under `jax.enable_x64` for references).

    Args:
      r, w, k, a, b: `[B, T, H, K]`; v: `[B, T, H, V]` (any float dtype, upcast here).
      initial_state: `[B, H, K, V]` or None (zeros).
      segment_ids: int `[B, T]` or None; the state is zeroed before a position whose id differs
        from the previous position's.
      compute_dtype: dtype of the state and of all arithmetic.

    Returns:
      `(o [B, T, H, V], final_state [B, H, K, V])`, both in `compute_dtype`.
    """
    B, T, H, K = r.shape
    V = v.shape[-1]
    to_TBH = lambda x: jnp.swapaxes(x.astype(compute_dtype), 0, 1)  # [B,T,H,*] -> [T,B,H,*]
    r_T, w_T, k_T, v_T, a_T, b_T = (to_TBH(x) for x in (r, w, k, v, a, b))
    if segment_ids is None:
        reset_TB = jnp.zeros((T, B), dtype=bool)
    else:
        reset_TB = jnp.swapaxes(reset_flags(jnp.asarray(segment_ids)), 0, 1)
    if initial_state is None:
        S0_BHKV = jnp.zeros((B, H, K, V), compute_dtype)
    else:
        S0_BHKV = initial_state.astype(compute_dtype)

    if T == 1:   # one decode step (never a reset: position 0 cannot start a new segment)
        S_BHKV, o_BHV = _one_token(S0_BHKV, *(x[0] for x in (r_T, w_T, k_T, v_T, a_T, b_T)))
        return o_BHV[:, None], S_BHKV

    def step(S_BHKV, xs):
        r_BHK, w_BHK, k_BHK, v_BHV, a_BHK, b_BHK, reset_B = xs
        S_BHKV = jnp.where(reset_B[:, None, None, None], jnp.zeros_like(S_BHKV), S_BHKV)
        return _one_token(S_BHKV, r_BHK, w_BHK, k_BHK, v_BHV, a_BHK, b_BHK)

    S_BHKV, o_TBHV = jax.lax.scan(step, S0_BHKV, (r_T, w_T, k_T, v_T, a_T, b_T, reset_TB))
    return jnp.swapaxes(o_TBHV, 0, 1), S_BHKV


def _one_token(S_BHKV, r_BHK, w_BHK, k_BHK, v_BHV, a_BHK, b_BHK):
    """One recurrence step `(S [B,H,K,V], o [B,H,V])`, written as broadcasts and sums over the key
    axis (not batched matmuls: exact in `compute_dtype` with no matmul precision to choose), so
    XLA fuses it into a reduction over S and one read-modify-write of S with the output
    reduction: the memory-bound shape of decoding (state >> weights at large batch)."""
    sa_BHV = jnp.sum(a_BHK[..., None] * S_BHKV, axis=-2)
    S_BHKV = (jnp.exp(w_BHK)[..., None] * S_BHKV + b_BHK[..., None] * sa_BHV[:, :, None, :]
              + k_BHK[..., None] * v_BHV[:, :, None, :])
    return S_BHKV, jnp.sum(r_BHK[..., None] * S_BHKV, axis=-2)


@functools.partial(jax.jit, static_argnames=("output_dtype",))
def wkv7_recurrent(r, w, k, v, a, b, initial_state, segment_ids, output_dtype):
    """Float32 recurrent WKV7 (inputs already validated by `dispatch.wkv7`).

    Returns `(o [B, T, H, V] in output_dtype, final_state [B, H, K, V] float32)`.
    """
    o, state = recurrent_scan(r, w, k, v, a, b, initial_state, segment_ids, jnp.float32)
    return o.astype(output_dtype), state
