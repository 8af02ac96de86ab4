"""Packed-document bookkeeping for WKV7: segment ids, reset flags and segment counters.

A packed batch row holds several documents back to back. `segment_ids [B, T]` (int32) labels each
position with its document; the WKV state is reset to zero at every position whose id differs from
the previous position's. Position 0 never resets (it starts from the caller's initial state), so a
sequence split into two calls that carry the state gives the same result as one call.

Ids only matter through "differs from the previous position": `[0, 0, 1, 1, 0]` holds three
documents. Inside the implementations the resets are turned into a running counter
(`segment_counter`), so "same document" is an exact integer comparison of counters.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp


def segment_ids_from_cu_seqlens(cu_seqlens, total_len: int) -> jnp.ndarray:
    """FLA-style cumulative sequence lengths -> segment ids for one packed row.

    Args:
      cu_seqlens: integer sequence `[N + 1]`: `0 = c_0 < c_1 < ... < c_N = total_len`; document
        `n` covers positions `[c_n, c_{n+1})`. Must be concrete (a list, NumPy or JAX array).
      total_len: T, the packed length.

    Returns:
      int32 array `[1, T]` whose entry at position t is the index n of the document holding t.
    """
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens must be a 1-D list [0, ..., total_len] with at least 2 "
                         f"entries, got shape {cu.shape}")
    if not np.issubdtype(cu.dtype, np.integer):
        raise TypeError(f"cu_seqlens must hold integers, got dtype {cu.dtype}")
    total_len = int(total_len)
    if cu[0] != 0 or cu[-1] != total_len:
        raise ValueError(f"cu_seqlens must start at 0 and end at total_len={total_len}, got "
                         f"first={int(cu[0])}, last={int(cu[-1])}")
    if np.any(np.diff(cu) <= 0):
        raise ValueError("cu_seqlens must be strictly increasing (every document needs at least "
                         f"one token), got {cu.tolist()}")
    lengths = np.diff(cu)
    ids = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
    return jnp.asarray(ids[None, :], dtype=jnp.int32)


def reset_flags(segment_ids_BT):
    """`[B, T]` bool: True where the state resets (id differs from the previous position's).

    Position 0 is always False. Works on NumPy and JAX arrays alike (returns the same kind).
    """
    xp = jnp if isinstance(segment_ids_BT, jnp.ndarray) else np
    if segment_ids_BT.shape[1] == 1:
        return xp.zeros(segment_ids_BT.shape, dtype=bool)
    changed = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    return xp.pad(changed, ((0, 0), (1, 0)), constant_values=False)


def segment_counter(segment_ids_BT):
    """`[B, T]` int32 running count of resets up to and including each position (0 at t = 0).

    Two positions t >= s lie in the same document iff their counters are equal.
    """
    return jnp.cumsum(reset_flags(jnp.asarray(segment_ids_BT)).astype(jnp.int32), axis=1)


def chunk_reset_counter(segment_ids_BT, T_pad: int, C: int):
    """`[B, T_pad]` int32: resets counted from the start of each length-`C` chunk up to and
    including each position; 0 means "same document as the state that enters the chunk". The
    ids are padded to `T_pad` (a multiple of `C`) by repeating the last id, so padded positions
    never reset. The chunked kernels (GPU and TPU) compare these per-chunk counters."""
    B, T = segment_ids_BT.shape
    ids = jnp.pad(jnp.asarray(segment_ids_BT).astype(jnp.int32), ((0, 0), (0, T_pad - T)),
                  mode="edge")
    count_BNC = segment_counter(ids).reshape(B, T_pad // C, C)
    before_BN = jnp.pad(count_BNC[:, :-1, -1], ((0, 0), (1, 0)))
    return (count_BNC - before_BN[:, :, None]).reshape(B, T_pad)
