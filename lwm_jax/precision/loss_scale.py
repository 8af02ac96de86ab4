"""Dynamic loss scaling for fp16 training (the `fp16-mixed` policy).

The loss is multiplied by `scale` before differentiation so that small fp16 gradients do not
flush to zero; gradients are divided by it afterwards (in fp32). If any gradient is non-finite the
optimizer step is skipped and the scale is halved; after `growth_interval` finite steps in a row
it is doubled. All state is fp32/int32 arrays, so it lives in the jitted train state and in
checkpoints.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Loss-scale state. `scale`: f32 scalar; `good_steps`: int32 scalar (finite steps in a row).

    `growth_interval`, `factor`, `min_scale` and `max_scale` are static (not traced).
    """

    scale: jax.Array
    good_steps: jax.Array
    growth_interval: int = dataclasses.field(default=2000, metadata=dict(static=True))
    factor: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    min_scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    max_scale: float = dataclasses.field(default=2.0**24, metadata=dict(static=True))

    @classmethod
    def create(cls, initial_scale: float = 2.0**15, growth_interval: int = 2000,
               factor: float = 2.0, min_scale: float = 1.0, max_scale: float = 2.0**24):
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.asarray(0, jnp.int32),
                   growth_interval, factor, min_scale, max_scale)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """Return `loss * scale` (fp32)."""
        return loss.astype(jnp.float32) * self.scale

    def unscale(self, grads):
        """Divide every gradient leaf by `scale`, in fp32 (leaves are returned as fp32)."""
        inv = 1.0 / self.scale
        return jax.tree.map(lambda g: g.astype(jnp.float32) * inv, grads)

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """New state after a step: halve on overflow, double after `growth_interval` good steps."""
        grown = self.good_steps + 1 >= self.growth_interval
        scale_if_finite = jnp.where(grown, jnp.minimum(self.scale * self.factor, self.max_scale),
                                    self.scale)
        new_scale = jnp.where(grads_finite, scale_if_finite,
                              jnp.maximum(self.scale / self.factor, self.min_scale))
        new_good = jnp.where(grads_finite & ~grown, self.good_steps + 1, 0).astype(jnp.int32)
        return dataclasses.replace(self, scale=new_scale.astype(jnp.float32), good_steps=new_good)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoLossScale:
    """Stand-in with the same interface for policies that do not scale the loss."""

    def scale_loss(self, loss):
        return loss.astype(jnp.float32)

    def unscale(self, grads):
        return grads

    def adjust(self, grads_finite):
        return self


def all_finite(tree) -> jax.Array:
    """True (bool scalar) iff every element of every floating leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def loss_scale_for(policy) -> DynamicLossScale | NoLossScale:
    """The loss-scale state a policy asks for (`policy.loss_scale`)."""
    return DynamicLossScale.create() if policy.loss_scale == "dynamic" else NoLossScale()
