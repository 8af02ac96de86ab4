"""Checks of a model call's inputs, shared by every family (one-line ValueErrors naming the
model class)."""
from __future__ import annotations

import jax.numpy as jnp


def checked_inputs(owner: str, tokens_BT, segment_ids_BT=None):
    """`(tokens, segment_ids)` as arrays: tokens an integer `[B, T]` array, segment_ids None or
    of the tokens' shape. `owner` names the model class in the error."""
    tokens_BT = jnp.asarray(tokens_BT)
    if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
        raise ValueError(f"{owner}: tokens must be an integer array [B, T], got shape "
                         f"{tokens_BT.shape} dtype {tokens_BT.dtype}")
    if segment_ids_BT is not None:
        if tuple(jnp.shape(segment_ids_BT)) != tokens_BT.shape:
            raise ValueError(f"{owner}: segment_ids shape {jnp.shape(segment_ids_BT)} must "
                             f"equal the tokens' shape {tokens_BT.shape}")
        segment_ids_BT = jnp.asarray(segment_ids_BT)
    return tokens_BT, segment_ids_BT
