"""AdamW with RWKV-LM's parameter groups, its warmup + cosine schedule, and float32 moments.

Groups (RWKV-LM `configure_optimizers`):
- weight decay only on projection / embedding / head matrices: parameters whose logical axes,
  not counting the stacked `layers` axis, have at least 2 dims, touch `embed`, `vocab` or `mlp`,
  and are not LoRA factors (no `lora` axis). So token-shift mixes, biases, norms, `r_k`
  [heads, head_dim] and the LoRA `w1/w2/a1/...` matrices are not decayed — in RWKV-LM those are
  not `*.weight` tensors.
- `w0` (decay bias) at 2x the learning rate (and no decay: it is 1-D per layer).

The update is `p <- p - lr(step) * mult * (m̂ / (sqrt(v̂) + eps) + wd * p)` (decoupled decay as
in `torch.optim.AdamW`), after clipping the gradient's global norm. The learning rate is passed
to `update(..., lr=...)` by the train step (computed from the train state's step with
`lr_schedule`), so the schedule follows optimizer steps even when an fp16 overflow skips one.
Adam moments are float32 whatever the parameter dtype; updates are float32 and are cast to the
parameter dtype only when added (`optax.apply_updates`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lwm_jax.train.config import TrainSection
from lwm_jax.train.params import map_with_names

W0_LR_MULT = 2.0
_MATRIX_AXES = {"embed", "vocab", "mlp"}


def wants_weight_decay(name: str, logical_axes: tuple) -> bool:
    """True for a projection/embedding/head matrix (see the module doc for the rule)."""
    del name
    axes = [a for a in logical_axes if a != "layers"]
    return len(axes) >= 2 and "lora" not in axes and bool(_MATRIX_AXES & set(axes))


def lr_multiplier(name: str) -> float:
    """2.0 for `w0` (any parameter whose last path component is `w0`), else 1.0."""
    return W0_LR_MULT if name.rsplit("/", 1)[-1] == "w0" else 1.0


def decay_mask(params: Any, axes_by_name: dict[str, tuple]) -> Any:
    """Pytree of bools (same structure as `params`): which leaves get weight decay."""
    return map_with_names(lambda n, _: wants_weight_decay(n, axes_by_name[n]), params)


def lr_schedule(t: TrainSection) -> Callable[[jax.Array], jax.Array]:
    """RWKV-LM schedule: cosine from `lr` to `min_lr` over the steps after warmup, times the
    warmup multiplier `0.01 + 0.99 * step / warmup_steps` while `step < warmup_steps`.

    `step` is the 0-based index of the optimizer step; returns a float32 scalar.
    """
    ratio = t.min_lr / t.lr
    decay_steps = max(1, t.steps - t.warmup_steps)

    def lr_at(step):
        s = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((s - t.warmup_steps) / decay_steps, 0.0, 1.0)
        mult = (0.5 + ratio / 2) + (0.5 - ratio / 2) * jnp.cos(math.pi * progress)
        if t.warmup_steps > 0:
            mult = mult * jnp.where(s < t.warmup_steps, 0.01 + 0.99 * s / t.warmup_steps, 1.0)
        return (t.lr * mult).astype(jnp.float32)

    return lr_at


class AdamF32State(NamedTuple):
    count: jax.Array   # int32 scalar: moment updates so far (for bias correction)
    mu: Any            # float32, structure of params
    nu: Any            # float32, structure of params


def scale_by_adam_f32(b1: float, b2: float, eps: float) -> optax.GradientTransformationExtraArgs:
    """Adam direction `m̂ / (sqrt(v̂) + eps)` with both moments stored in float32.

    `update(..., apply=flag)` (a bool scalar; None = True) guards the step: where `flag` is
    False the moments and the count come back unchanged and the gradients (which may hold
    NaN/inf) are never read into them. The guard is folded into the update's own scalars
    (`b1, 1 - b1` become `1, 0`, the gradient is read as 0) instead of selecting between new
    and old moments afterwards, so one fused pass writes each moment once; where `flag` is
    True the arithmetic is the unguarded update's, bit for bit.
    """

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
        return AdamF32State(jnp.zeros([], jnp.int32), jax.tree.map(zeros, params),
                            jax.tree.map(zeros, params))

    def update(grads, state, params=None, *, apply=None, **extra):
        del params, extra
        f32 = jnp.float32
        apply = jnp.asarray(True if apply is None else apply)
        pick = lambda on, off: jnp.where(apply, f32(on), f32(off))  # noqa: E731
        keep_m, new_m, keep_v, new_v = pick(b1, 1.0), pick(1 - b1, 0.0), pick(b2, 1.0), \
            pick(1 - b2, 0.0)
        count = state.count + apply.astype(jnp.int32)
        g32 = jax.tree.map(lambda g: jnp.where(apply, g.astype(f32), f32(0)), grads)
        mu = jax.tree.map(lambda m, g: keep_m * m + new_m * g, state.mu, g32)
        nu = jax.tree.map(lambda v, g: keep_v * v + new_v * g * g, state.nu, g32)
        # a skipped first step leaves count 0: its direction is discarded (lr 0), but must stay
        # finite, so the bias corrections use at least one step
        steps = jnp.maximum(count, 1).astype(f32)
        c1 = 1 - b1 ** steps
        c2 = 1 - b2 ** steps
        direction = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return direction, AdamF32State(count, mu, nu)

    return optax.GradientTransformationExtraArgs(init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm`'s rule (leaves unchanged below `max_norm`, else scaled by
    `max_norm / norm`, the same arithmetic), with the norm passed in as `update(...,
    grad_norm=n)` when the caller has it: the train step computes the gradient's norm once, for
    this clip, its metric and its non-finite check. Without `grad_norm` it is computed here.
    State: `optax.EmptyState`, as optax's."""

    def update(updates, state, params=None, *, grad_norm=None, **extra):
        del params, extra
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        below = norm < max_norm
        return jax.tree.map(lambda t: jnp.where(below, t, (t / norm.astype(t.dtype)) * max_norm),
                            updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def guarded_update(tx: optax.GradientTransformationExtraArgs, grads: Any, opt_state: Any,
                   params: Any, lr: jax.Array, loss: jax.Array | None = None):
    """The train step's update of `params` by `tx` (`make_optimizer`'s chain), skipped where
    the loss or the gradient is not finite: `(params, opt_state, grad_norm, finite)`.

    One pass over the gradient gives its float32 global norm, for the clip, the `grad_norm`
    metric and the check: a NaN/inf anywhere makes it non-finite (so does a norm beyond
    float32's range, ~1.8e19). Where not finite the params and moments come back unchanged
    (learning rate 0, moments and count kept by `scale_by_adam_f32`'s `apply`): guarding inside
    the update, not by selecting between the new and old state after it, keeps it one pass over
    params and moments. `loss`: float scalar also checked (None: the gradient alone).
    """
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
    finite = jnp.isfinite(grad_norm)
    if loss is not None:
        finite = finite & jnp.isfinite(loss)
    updates, opt_state = tx.update(grads, opt_state, params, lr=jnp.where(finite, lr, 0.0),
                                   apply=finite, grad_norm=grad_norm)
    return optax.apply_updates(params, updates), opt_state, grad_norm, finite


def applied_updates(opt_state: Any) -> jax.Array:
    """int32 count of updates the optimizer has applied (fp16-skipped steps excluded)."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AdamF32State))
             if isinstance(x, AdamF32State)]
    if len(found) != 1:
        raise ValueError(f"optimizer state holds {len(found)} Adam states, expected 1")
    return found[0].count


def scale_by_lr(multipliers: Any) -> optax.GradientTransformationExtraArgs:
    """Multiply each update by `-lr * multiplier`; `lr` is an extra argument of `update`."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, lr, **extra):
        del params, extra
        lr = jnp.asarray(lr, jnp.float32)
        return jax.tree.map(lambda u, m: (-lr * m) * u.astype(jnp.float32),
                            updates, multipliers), state

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(t: TrainSection, params: Any,
                   axes_by_name: dict[str, tuple]) -> optax.GradientTransformationExtraArgs:
    """The full update rule. Call as `tx.update(grads, opt_state, params, lr=lr_at(step))`.

    `params` may be abstract (`jax.ShapeDtypeStruct` leaves): only its structure and names are
    used here.
    """
    clip = clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
    return optax.chain(
        optax.stateless(lambda g, p=None: jax.tree.map(lambda x: x.astype(jnp.float32), g)),
        clip,
        scale_by_adam_f32(t.betas[0], t.betas[1], t.eps),
        optax.add_decayed_weights(t.weight_decay, mask=decay_mask(params, axes_by_name)),
        scale_by_lr(map_with_names(lambda n, _: lr_multiplier(n), params)),
    )
