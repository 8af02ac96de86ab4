"""The train state and the jitted train / eval steps.

One optimizer step = forward + backward over `grad_accum` micro-batches (a `lax.scan`, gradients
summed in float32 and divided by `grad_accum`, which equals the gradient of the mean loss over
the whole batch), optional fp16 loss scaling, global-norm clipping, AdamW. Everything runs in
ONE `jax.jit` whose inputs and outputs carry explicit `NamedSharding`s over the mesh.

Non-finite guard (every policy): when the loss or any gradient is NaN/inf (under an FP8 policy
also any GEMM's recorded amax or scale), the step's update is not applied — parameters and Adam moments stay as they were, the step counter still advances
(the batch is consumed) and `finite` is 0 in the metrics. A NaN therefore never reaches the
parameters or a checkpoint; the trainer stops a run whose steps keep failing
(`train.max_consecutive_skips`) and names the op that produced the first non-finite value.

Packed documents (`data.reset_at_document_boundary`): with an `eod_id`, the steps derive
segment ids from the inputs' end-of-document tokens (`document_segment_ids`, inside the jitted
step, sharded like the inputs) and pass them to the model on every path (each micro-batch of
gradient accumulation, evaluation, the fused loss's features), so the recurrent state (RWKV-7)
or attention and positions (Llama) restart at every document.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from lwm_jax.mesh_axes import activation_spec
from lwm_jax.precision import fp8
from lwm_jax.precision.loss_scale import DynamicLossScale, NoLossScale
from lwm_jax.models.registry import loss_head
from lwm_jax.train.loss import chunked_cross_entropy, cross_entropy, fused_lm_loss, lm_loss
from lwm_jax.train.optimizer import applied_updates, guarded_update
from lwm_jax.train.params import merge_model
from lwm_jax.train.sharding import replicated, tokens_sharding


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes during training (all arrays; checkpointed as one pytree).

    step: int32 scalar, optimizer steps taken (fp16 overflow-skipped steps included).
    params: nested dict of parameter arrays (`policy.param_dtype`).
    opt_state: optax state (float32 Adam moments).
    loss_scale: `DynamicLossScale` (fp16) or `NoLossScale`.
    rng: uint32 [2] base PRNG key of the run (per-step keys: `fold_in(rng, step)`; the RWKV-7
      model has no stochastic layers today, the key is kept so that resumes stay exact when it
      gets one).
    fp8: under an FP8 policy, the nested dict of the model's `Fp8Meta` arrays (the GEMMs'
      delayed-scaling state, `lwm_jax.precision.fp8`); None otherwise. A None field is not a
      pytree child at all, so the state of every other policy has exactly the tree (and the
      checkpoint layout) it had before FP8 existed.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale: DynamicLossScale | NoLossScale
    rng: jax.Array
    fp8: Any = None


_STATE_FIELDS = ("step", "params", "opt_state", "loss_scale", "rng")


def _state_flatten_with_keys(s: TrainState):
    names = _STATE_FIELDS + (("fp8",) if s.fp8 is not None else ())
    return ([(jax.tree_util.GetAttrKey(n), getattr(s, n)) for n in names],
            s.fp8 is not None)


def _state_flatten(s: TrainState):
    children, has_fp8 = _state_flatten_with_keys(s)
    return [c for _, c in children], has_fp8


def _state_unflatten(has_fp8: bool, children) -> TrainState:
    return TrainState(*children) if has_fp8 else TrainState(*children, fp8=None)


jax.tree_util.register_pytree_with_keys(TrainState, _state_flatten_with_keys, _state_unflatten,
                                        _state_flatten)


def split_tokens(tokens_BT1: jax.Array, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """Windows `[B, T+1]` -> (inputs, targets) `[B, T]`, constrained to the activation sharding."""
    sh = NamedSharding(mesh, activation_spec())
    inputs = jax.lax.with_sharding_constraint(tokens_BT1[:, :-1].astype(jnp.int32), sh)
    targets = jax.lax.with_sharding_constraint(tokens_BT1[:, 1:].astype(jnp.int32), sh)
    return inputs, targets


def document_segment_ids(inputs_BT: jax.Array, eod_id: int) -> jax.Array:
    """int32 `[B, T]` packed-document ids of training inputs: the id rises by one AT every
    end-of-document token. The EOD that closes one document therefore opens the next one's
    segment (it acts as that document's beginning token: from a fresh state it predicts the
    document's first token), while the EOD as a target stays with the document it ends.
    Models never reset at position 0 (a window starts from a zero state anyway)."""
    return jnp.cumsum(inputs_BT == eod_id, axis=1, dtype=jnp.int32)


def _segments(inputs_BT, eod_id: int | None, mesh: Mesh):
    """`document_segment_ids` sharded like the inputs, or None when `eod_id` is None."""
    if eod_id is None:
        return None
    return jax.lax.with_sharding_constraint(document_segment_ids(inputs_BT, eod_id),
                                            NamedSharding(mesh, activation_spec()))


def model_loss(model, inputs_BT, targets_BT, *, use_l2wrap: bool, loss_chunk: int,
               with_grad: bool = True, segment_ids_BT=None):
    """Mean next-token cross-entropy of `model` (fused, chunked loss when `loss_chunk` > 0);
    `segment_ids_BT`: optional packed-document ids passed to the model."""
    if loss_chunk <= 0:
        logits_BTV = model(inputs_BT, segment_ids=segment_ids_BT)
        if not with_grad:
            return cross_entropy(logits_BTV, targets_BT)
        return lm_loss(logits_BTV, targets_BT, use_l2wrap=use_l2wrap)
    x_BTC = model.features(inputs_BT, segment_ids=segment_ids_BT)
    fn, hp, mesh = loss_head(model), model.head_params(), getattr(model, "mesh", None)
    if not with_grad:
        return chunked_cross_entropy(fn, x_BTC, hp, targets_BT, chunk_tokens=loss_chunk,
                                     mesh=mesh)
    return fused_lm_loss(fn, x_BTC, hp, targets_BT, chunk_tokens=loss_chunk,
                         use_l2wrap=use_l2wrap, mesh=mesh,
                         platform=getattr(model, "platform", None))


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformationExtraArgs,
                    lr_at: Callable, *, grad_accum: int, use_l2wrap: bool, mesh: Mesh,
                    state_shardings: Any, loss_chunk: int = 0,
                    eod_id: int | None = None) -> Callable:
    """Build `step(state, tokens) -> (state, metrics)`, jitted with explicit shardings.

    tokens: int `[B, T+1]` when `grad_accum == 1`, else `[grad_accum, B/grad_accum, T+1]`.
    loss_chunk: tokens per chunk of the fused loss (`train.loss_chunk`; 0 = unfused).
    eod_id: end-of-document token id: restart the model at every document of each window
      (`document_segment_ids`); None = documents flow into each other (RWKV-LM's way).
    metrics: dict of float32 scalars `loss` (mean cross-entropy, nats), `grad_norm` (global norm
      of the unscaled, unclipped gradient), `lr`, `loss_scale`, `finite` (1 = update applied,
      0 = skipped: non-finite loss or gradient, or a gradient norm beyond float32),
      `skipped_steps` (steps skipped so far).
    State buffers are donated: the caller must use the returned state.
    """

    def loss_fn(params, fp8_metas, tokens_BT1, loss_scale):
        inputs_BT, targets_BT = split_tokens(tokens_BT1, mesh)
        loss = model_loss(merge_model(graphdef, params, fp8_metas), inputs_BT, targets_BT,
                          use_l2wrap=use_l2wrap, loss_chunk=loss_chunk,
                          segment_ids_BT=_segments(inputs_BT, eod_id, mesh))
        return loss_scale.scale_loss(loss), loss

    # FP8 metas are differentiated too: what comes back for them is their updated value
    # (`lwm_jax.precision.fp8`), never a gradient the optimizer sees
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def gradients(params, fp8_metas, tokens, loss_scale):
        """(mean loss, parameter gradients, the FP8 metas' returned values or None)."""
        if grad_accum == 1:
            (_, loss), (grads, metas) = grad_fn(params, fp8_metas, tokens, loss_scale)
            return loss, grads, metas

        def body(carry, micro_BT1):
            loss_sum, grad_sum, meta_max = carry
            (_, loss), (grads, metas) = grad_fn(params, fp8_metas, micro_BT1, loss_scale)
            grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
            # every micro-batch starts from the same metas: their maximum is the step's
            # (zeros start it: scales and maxima are positive)
            meta_max = fp8.combine_accumulated(meta_max, metas)
            return (loss_sum + loss, grad_sum, meta_max), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        no_metas = jax.tree.map(jnp.zeros_like, fp8_metas)
        (loss_sum, grad_sum, metas), _ = jax.lax.scan(
            body, (jnp.zeros([], jnp.float32), zeros, no_metas), tokens)
        return loss_sum / grad_accum, jax.tree.map(lambda g: g / grad_accum, grad_sum), metas

    def step(state: TrainState, tokens):
        loss, grads, metas = gradients(state.params, state.fp8, tokens, state.loss_scale)
        grads = state.loss_scale.unscale(grads)
        lr = lr_at(state.step)
        # non-finite loss or gradient (fp16 overflow, divergence): params and moments unchanged
        # (under fp16 the scale is halved below)
        # Under FP8 a non-finite tensor can leave the loss finite (quantization clips it to
        # the format's range) but would put inf into its amax history, and so hold that GEMM's
        # scale for `fp8.HISTORY` steps: a non-finite scaling state fails the step like a
        # non-finite loss (the metric keeps the real loss)
        guard_loss = loss if metas is None else jnp.where(fp8.all_finite(metas), loss, jnp.nan)
        with jax.named_scope("optimizer"):
            params, opt_state, grad_norm, finite = guarded_update(
                tx, grads, state.opt_state, state.params, lr, guard_loss)
        # a skipped step keeps the old FP8 metas too
        new_fp8 = None if state.fp8 is None else fp8.overwrite(state.fp8, metas, finite)
        new_state = TrainState(state.step + 1, params, opt_state,
                               state.loss_scale.adjust(finite), state.rng, new_fp8)
        scale = getattr(new_state.loss_scale, "scale", jnp.ones([], jnp.float32))
        metrics = {"loss": loss.astype(jnp.float32),
                   "grad_norm": grad_norm,
                   "lr": lr,
                   "loss_scale": scale.astype(jnp.float32),
                   "finite": finite.astype(jnp.float32),
                   "skipped_steps": (new_state.step - applied_updates(opt_state)
                                     ).astype(jnp.float32)}
        return new_state, metrics

    tokens_sh = tokens_sharding(mesh, with_accum_axis=grad_accum > 1)
    return jax.jit(step, in_shardings=(state_shardings, tokens_sh),
                   out_shardings=(state_shardings, replicated(mesh)), donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef, *, mesh: Mesh, params_shardings: Any,
                   loss_chunk: int = 0, eod_id: int | None = None) -> Callable:
    """Build `eval_loss(params, fp8_metas, tokens_BT1) -> float32 mean cross-entropy`, jitted
    (`fp8_metas`: the state's `fp8`, None but under an FP8 policy, whose GEMMs quantize with
    the run's current scales; `eod_id` as in `make_train_step`)."""

    def eval_loss(params, fp8_metas, tokens_BT1):
        inputs_BT, targets_BT = split_tokens(tokens_BT1, mesh)
        return model_loss(merge_model(graphdef, params, fp8_metas), inputs_BT, targets_BT,
                          use_l2wrap=False, loss_chunk=loss_chunk, with_grad=False,
                          segment_ids_BT=_segments(inputs_BT, eod_id, mesh))

    return jax.jit(eval_loss, in_shardings=(params_shardings, replicated(mesh),
                                            tokens_sharding(mesh)),
                   out_shardings=replicated(mesh))
