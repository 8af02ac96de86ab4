"""Token shift: `shift(x)_t = x_{t-1}`, fed by the carried state at t = 0.

With packed documents (`segment_ids`), a position that starts a new document sees zeros instead
of the previous document's last token, the same rule the WKV state follows
(`lwm_jax.ops.segments.reset_flags`): position 0 always uses the carried state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lwm_jax.ops.segments import reset_flags
from lwm_jax.precision import check_trailing


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


def token_shift_mixes(x_BTC, prev_BC, mus, segment_ids_BT=None):
    """RWKV's token-shift interpolations `x + (shift(x) - x) * mu`, one output per `mu`.

    The forward is `x + param_mul(shift(x) - x, mu)` for each mu, bit for bit (mu cast to x's
    dtype, products and sums in x's dtype). The backward reads the shifted difference and the
    outputs' cotangents in one kernel for all mus: every mu's gradient (a sum over the B*T
    tokens) in float32 from one reduction of the stacked products, and the activations'
    gradient formed in float32 and rounded once to x's dtype. With one `param_mul` per mu the
    six TimeMix mixes took six reductions, each reading the difference again (H100 profiles,
    benchmarks/RESULTS.md).

    Args:
      x_BTC: `[B, T, C]` inputs (any float dtype).
      prev_BC: `[B, C]` the token before position 0 (as `token_shift`).
      mus: non-empty sequence of parameters of one shape, x's trailing dims (e.g. `[C]`), any
        float dtype; their gradients come back in their own dtypes.
      segment_ids_BT: optional int `[B, T]` (as `token_shift`).
    Returns:
      tuple of `[B, T, C]` arrays in x's dtype, one per mu.
    """
    mus = tuple(mus)
    if not mus:
        raise ValueError("token_shift_mixes: needs at least one mix parameter")
    for mu in mus:
        check_trailing(x_BTC, mu, "token_shift_mixes")
        if mu.shape != mus[0].shape:
            raise ValueError(f"token_shift_mixes: mixes of different shapes {tuple(mu.shape)} "
                             f"and {tuple(mus[0].shape)}; pass one shape per call")
    xx = token_shift(x_BTC, prev_BC, segment_ids_BT) - x_BTC
    return _mixes(x_BTC, xx, mus)


@jax.custom_vjp
def _mixes(x, xx, mus):
    return tuple(x + xx * mu.astype(x.dtype) for mu in mus)


def _mixes_fwd(x, xx, mus):
    return _mixes(x, xx, mus), (xx, mus)


def _mixes_bwd(res, gs):
    xx, mus = res
    f32 = jnp.float32
    lead = tuple(range(xx.ndim - mus[0].ndim))
    g32 = [g.astype(f32) for g in gs]
    xx32 = xx.astype(f32)
    # one reduction of the stacked products `[M, B, T, C]`: XLA fuses the stack and the
    # products into one kernel (a variadic `lax.reduce` was slower on an H100: XLA wrote the
    # float32 products to memory first; benchmarks/RESULTS.md)
    d_mus = list(jnp.sum(jnp.stack([g * xx32 for g in g32]), axis=tuple(1 + i for i in lead)))
    # the forward multiplied by mu rounded to x's dtype: its derivative uses the same value
    mus_used = [mu.astype(xx.dtype).astype(f32) for mu in mus]
    dx = sum(g32[1:], g32[0])
    dxx = sum((g * m for g, m in zip(g32[1:], mus_used[1:])), g32[0] * mus_used[0])
    return (dx.astype(xx.dtype), dxx.astype(xx.dtype),
            tuple(d.astype(mu.dtype) for d, mu in zip(d_mus, mus)))


_mixes.defvjp(_mixes_fwd, _mixes_bwd)
