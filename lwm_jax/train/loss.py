"""Language-model loss: float32 cross-entropy and RWKV-LM's L2Wrap.

L2Wrap leaves the loss value unchanged and, in the backward pass, adds
`max_logit * 1e-4 / (B*T)` to the gradient of each position's largest logit. It discourages the
logits from drifting upwards (RWKV-LM uses it in every run). The extra gradient is multiplied by
the loss's incoming cotangent, so loss scaling (fp16) and micro-batch averaging treat it exactly
like a term of the loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

L2WRAP_FACTOR = 1e-4


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats (float32 scalar).

    logits_BTV: any float dtype, upcast to float32 before the logsumexp.
    targets_BT: int token ids in [0, V).
    """
    logits = logits_BTV.astype(jnp.float32)
    lse_BT = jax.nn.logsumexp(logits, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits, targets_BT[..., None].astype(jnp.int32),
                                          axis=-1)[..., 0]
    return jnp.mean(lse_BT - target_logit_BT)


@jax.custom_vjp
def l2wrap(loss: jax.Array, logits_BTV: jax.Array) -> jax.Array:
    """Identity on `loss`; its VJP adds the L2Wrap gradient to `logits_BTV` (see module doc)."""
    del logits_BTV
    return loss


def _l2wrap_fwd(loss, logits_BTV):
    idx_BT = jnp.argmax(logits_BTV, axis=-1)
    max_BT = jnp.max(logits_BTV, axis=-1).astype(jnp.float32)
    # Residuals must be arrays: an empty [0, V] array carries the vocabulary size and dtype.
    proto_0V = jnp.zeros((0, logits_BTV.shape[-1]), logits_BTV.dtype)
    return loss, (idx_BT, max_BT, proto_0V)


def _l2wrap_bwd(res, g):
    idx_BT, max_BT, proto_0V = res
    vocab, dtype = proto_0V.shape[1], proto_0V.dtype
    n_positions = max_BT.size                                    # B*T
    value_BT = max_BT * (L2WRAP_FACTOR / n_positions) * g.astype(jnp.float32)
    grad_BTV = jax.nn.one_hot(idx_BT, vocab, dtype=jnp.float32) * value_BT[..., None]
    return g, grad_BTV.astype(dtype)


l2wrap.defvjp(_l2wrap_fwd, _l2wrap_bwd)


def lm_loss(logits_BTV: jax.Array, targets_BT: jax.Array, *, use_l2wrap: bool) -> jax.Array:
    """Cross-entropy (float32 scalar), with L2Wrap's extra gradient when `use_l2wrap`."""
    loss = cross_entropy(logits_BTV, targets_BT)
    return l2wrap(loss, logits_BTV) if use_l2wrap else loss
