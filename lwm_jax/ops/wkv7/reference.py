"""Float64 NumPy token-by-token WKV7 reference (the ground truth every implementation is tested on).

Per batch row and head, with the state S in R^{K x V} indexed [key, value]:

    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,     o_t = S_t^T r_t

`S_{t-1}` is replaced by zeros at positions where `segment_ids` changes (packed documents).
"""
from __future__ import annotations

import numpy as np

from lwm_jax.ops.segments import reset_flags


def wkv7_reference_np(r, w, k, v, a, b, initial_state=None, segment_ids=None):
    """Run the WKV7 recurrence in float64 NumPy, one token at a time.

    Args:
      r, w, k, a, b: `[B, T, H, K]` arrays of any float dtype (converted to float64); `w` is the
        log-decay (per-step decay `exp(w)`).
      v: `[B, T, H, V]`.
      initial_state: `[B, H, K, V]` or None (zeros).
      segment_ids: int `[B, T]` or None (one document per row).

    Returns:
      `(o [B, T, H, V], final_state [B, H, K, V])`, both float64 NumPy arrays.
    """
    r, w, k, v, a, b = (np.asarray(x, dtype=np.float64) for x in (r, w, k, v, a, b))
    B, T, H, K = r.shape
    V = v.shape[-1]
    if initial_state is None:
        S_BHKV = np.zeros((B, H, K, V))
    else:
        S_BHKV = np.array(initial_state, dtype=np.float64)
    if segment_ids is None:
        reset_BT = np.zeros((B, T), dtype=bool)
    else:
        reset_BT = reset_flags(np.asarray(segment_ids))
    o_BTHV = np.empty((B, T, H, V))
    for t in range(T):
        S_BHKV = np.where(reset_BT[:, t, None, None, None], 0.0, S_BHKV)
        sa_BHV = np.einsum("bhk,bhkv->bhv", a[:, t], S_BHKV)
        S_BHKV = (np.exp(w[:, t])[..., None] * S_BHKV
                  + b[:, t][..., None] * sa_BHV[:, :, None, :]
                  + k[:, t][..., None] * v[:, t][:, :, None, :])
        o_BTHV[:, t] = np.einsum("bhk,bhkv->bhv", r[:, t], S_BHKV)
    return o_BTHV, S_BHKV
