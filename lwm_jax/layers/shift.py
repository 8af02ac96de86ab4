"""Token shift: `shift(x)_t = x_{t-1}`, fed by the carried state at t = 0.

With packed documents (`segment_ids`), a position that starts a new document sees zeros instead
of the previous document's last token, the same rule the WKV state follows
(`lwm_jax.ops.segments.reset_flags`): position 0 always uses the carried state.
"""
from __future__ import annotations

import jax.numpy as jnp

from lwm_jax.ops.segments import reset_flags


def token_shift(x_BTC, prev_BC, segment_ids_BT=None):
    """Previous token's features at every position.

    Args:
      x_BTC: `[B, T, C]` inputs (any float dtype).
      prev_BC: `[B, C]` the token before position 0 (zeros for a fresh sequence); cast to x's dtype.
      segment_ids_BT: optional int `[B, T]`; positions whose id differs from the previous
        position's get zeros.
    Returns:
      `[B, T, C]` in x's dtype.
    """
    prev = prev_BC.astype(x_BTC.dtype)[:, None, :]
    shifted = jnp.concatenate([prev, x_BTC[:, :-1]], axis=1)
    if segment_ids_BT is not None:
        reset_BT1 = reset_flags(jnp.asarray(segment_ids_BT))[..., None]
        shifted = jnp.where(reset_BT1, jnp.zeros_like(shifted), shifted)
    return shifted
