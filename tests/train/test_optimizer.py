"""Optimizer groups, AdamW numerics vs float64, fp32 moments, schedule, loss, train step."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lwm_jax.precision.loss_scale import DynamicLossScale, loss_scale_for
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.precision import parse_policy
from lwm_jax.train.config import TrainSection, load_config
from lwm_jax.train.loss import cross_entropy, lm_loss
from lwm_jax.train.optimizer import (clip_by_global_norm, decay_mask, lr_schedule,
                                     make_optimizer, wants_weight_decay)
from lwm_jax.train.params import split_model
from lwm_jax.train.sharding import make_mesh, replicated
from lwm_jax.train.step import TrainState, make_train_step


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_weight_decay_groups_on_the_rwkv7_model():
    cfg = load_config(None, ["model.n_layer=2", "model.n_embd=64"]).model
    model = nnx.eval_shape(lambda: RWKV7(cfg, "fp32", rngs=nnx.Rngs(0)))
    _, params, axes, _ = split_model(model)
    decayed = {n for n, a in axes.items() if wants_weight_decay(n, a)}
    assert decayed == {"emb", "head", "blocks/att/receptance", "blocks/att/key",
                       "blocks/att/value", "blocks/att/output", "blocks/ffn/key",
                       "blocks/ffn/value"}
    # LoRA factors, r_k [heads, head_dim], w0 and every vector stay undecayed
    for name in ("blocks/att/w1", "blocks/att/w2", "blocks/att/g1", "blocks/att/r_k",
                 "blocks/att/w0", "blocks/ln1/weight", "ln0/bias"):
        assert name in axes and name not in decayed
    mask = decay_mask(params, axes)
    assert mask["blocks"]["att"]["key"] is True and mask["blocks"]["att"]["a1"] is False


def _toy_params(rng, dtype=jnp.float32):
    L, C, D, V = 2, 8, 4, 16
    shapes = {"emb": ((V, C), ("vocab", "embed")),
              "blocks/att/w0": ((L, C), ("layers", "embed")),
              "blocks/att/w1": ((L, C, D), ("layers", "embed", "lora")),
              "blocks/att/receptance": ((L, C, C), ("layers", "embed", "heads")),
              "blocks/att/r_k": ((L, 2, 4), ("layers", "heads", "head_dim")),
              "ln0/weight": ((C,), ("embed",))}
    params = {"emb": None, "blocks": {"att": {}}, "ln0": {}}
    for name, (shape, _) in shapes.items():
        node = params
        *parents, leaf = name.split("/")
        for p in parents:
            node = node[p]
        node[leaf] = jnp.asarray(rng.normal(size=shape), dtype)
    return params, {n: a for n, (_, a) in shapes.items()}


def test_adamw_matches_float64_reference():
    rng = np.random.default_rng(0)
    t = TrainSection(lr=1e-2, min_lr=1e-3, warmup_steps=2, steps=6, weight_decay=0.1,
                     betas=(0.9, 0.99), eps=1e-8, grad_clip=1.0)
    params, axes = _toy_params(rng)
    tx, lr_at = make_optimizer(t, params, axes), lr_schedule(t)
    state = tx.init(params)
    names = list(axes)
    flat = lambda tree: [np.asarray(tree_get(tree, n), np.float64) for n in names]  # noqa: E731
    p64 = flat(params)
    m64 = [np.zeros_like(p) for p in p64]
    v64 = [np.zeros_like(p) for p in p64]
    grad_scales = [10.0, 0.01, 3.0, 0.5]        # steps 0 and 2 are clipped, 1 and 3 are not
    for step, gs in enumerate(grad_scales):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        grads = jax.tree.map(lambda g: g * gs / math.sqrt(sum(
            float(jnp.sum(x * x)) for x in jax.tree.leaves(grads))), grads)
        g64 = flat(grads)
        norm = math.sqrt(sum(float((g * g).sum()) for g in g64))
        if norm > t.grad_clip:
            g64 = [g * t.grad_clip / norm for g in g64]
        lr = float(lr_at(step))
        for i, n in enumerate(names):
            m64[i] = 0.9 * m64[i] + 0.1 * g64[i]
            v64[i] = 0.99 * v64[i] + 0.01 * g64[i] ** 2
            upd = (m64[i] / (1 - 0.9 ** (step + 1))) / (np.sqrt(v64[i] / (1 - 0.99 ** (step + 1)))
                                                        + 1e-8)
            if n in ("emb", "blocks/att/receptance"):
                upd = upd + 0.1 * p64[i]
            p64[i] = p64[i] - lr * (2.0 if n.endswith("w0") else 1.0) * upd
        updates, state = tx.update(grads, state, params, lr=lr_at(step))
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        for n, p, ref in zip(names, flat(params), p64):
            assert rel(p, ref) < 2e-6, (step, n, rel(p, ref))


def tree_get(tree, name):
    for part in name.split("/"):
        tree = tree[part]
    return tree


def test_moments_are_float32_with_bf16_params():
    params, axes = _toy_params(np.random.default_rng(1), jnp.bfloat16)
    t = TrainSection(steps=10, warmup_steps=0)
    tx = make_optimizer(t, params, axes)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.bfloat16), params)
    updates, state = tx.update(grads, state, params, lr=jnp.float32(1e-3))
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    assert len(moments) == 2 * len(jax.tree.leaves(params))
    assert all(x.dtype == jnp.float32 for x in moments)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
    new = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new))
    # mu after one step = (1 - beta1) * g, held in fp32 exactly enough to see 1e-4
    mu = state[2].mu["ln0"]["weight"]
    np.testing.assert_allclose(np.asarray(mu), 0.1 * np.float32(jnp.bfloat16(1e-3)), rtol=1e-6)


def test_lr_schedule_warmup_and_cosine():
    t = TrainSection(lr=6e-4, min_lr=6e-5, warmup_steps=10, steps=110)
    lr_at = lr_schedule(t)
    np.testing.assert_allclose(float(lr_at(0)), 6e-4 * 0.01, rtol=1e-6)
    np.testing.assert_allclose(float(lr_at(5)), 6e-4 * (0.01 + 0.99 * 0.5), rtol=1e-6)
    np.testing.assert_allclose(float(lr_at(10)), 6e-4, rtol=1e-6)
    np.testing.assert_allclose(float(lr_at(60)), (6e-4 + 6e-5) / 2, rtol=1e-6)
    np.testing.assert_allclose(float(lr_at(110)), 6e-5, rtol=1e-6)
    np.testing.assert_allclose(float(lr_at(500)), 6e-5, rtol=1e-6)


def test_cross_entropy_and_l2wrap_match_float64():
    rng = np.random.default_rng(2)
    B, T, V = 2, 5, 11
    logits = rng.normal(size=(B, T, V)).astype(np.float32) * 3
    targets = rng.integers(0, V, (B, T))
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    ref_loss = np.mean(lse - np.take_along_axis(x, targets[..., None], -1)[..., 0])
    assert rel(cross_entropy(jnp.asarray(logits), jnp.asarray(targets)), ref_loss) < 1e-6
    softmax = np.exp(x - lse[..., None])
    ref_grad = (softmax - np.eye(V)[targets]) / (B * T)
    ref_grad += np.eye(V)[x.argmax(-1)] * (x.max(-1) * 1e-4 / (B * T))[..., None]
    loss, grad = jax.value_and_grad(lambda z: lm_loss(z, jnp.asarray(targets), use_l2wrap=True))(
        jnp.asarray(logits))
    assert rel(loss, ref_loss) < 1e-6                     # L2Wrap leaves the value alone
    assert rel(grad, ref_grad) < 1e-6
    plain = jax.grad(lambda z: lm_loss(z, jnp.asarray(targets), use_l2wrap=False))(
        jnp.asarray(logits))
    assert rel(plain, (softmax - np.eye(V)[targets]) / (B * T)) < 1e-6


def _tiny_step_setup(precision="fp32", grad_accum=1):
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=64", "train.ctx_len=16",
                             "train.batch_size=4", f"train.grad_accum={grad_accum}",
                             f"precision={precision}", "train.warmup_steps=0"])
    policy = parse_policy(cfg.precision)
    model = RWKV7(cfg.model, policy, rngs=nnx.Rngs(0))
    graphdef, params, axes, _ = split_model(model)
    tx = make_optimizer(cfg.train, params, axes)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1})
    state = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params), loss_scale_for(policy),
                       jax.random.PRNGKey(0))
    state_sh = jax.tree.map(lambda _: replicated(mesh), state)
    state = jax.device_put(state, state_sh)      # as the trainer places it: no re-compile
    step = make_train_step(graphdef, tx, lr_schedule(cfg.train), grad_accum=grad_accum,
                           use_l2wrap=True, mesh=mesh, state_shardings=state_sh)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, 256, jnp.int32)
    return state, step, tokens


def test_grad_accumulation_equals_one_big_batch():
    s1, step1, tokens = _tiny_step_setup(grad_accum=1)
    s2, step2, _ = _tiny_step_setup(grad_accum=2)
    p0 = jax.device_get(s1.params)
    n1, m1 = step1(s1, tokens)
    n2, m2 = step2(s2, tokens.reshape(2, 2, 17))
    assert rel(m2["loss"], m1["loss"]) < 1e-6
    assert rel(m2["grad_norm"], m1["grad_norm"]) < 1e-5
    d1 = jax.tree.map(lambda a, b: np.asarray(a) - b, n1.params, p0)
    d2 = jax.tree.map(lambda a, b: np.asarray(a) - b, n2.params, p0)
    flat1 = np.concatenate([x.ravel() for x in jax.tree.leaves(d1)])
    flat2 = np.concatenate([x.ravel() for x in jax.tree.leaves(d2)])
    assert rel(flat2, flat1) < 1e-4        # Adam's first step is ~sign(g): near-zero grads
    assert int(n2.step) == 1                # may round either way, so compare the whole update


def test_fp16_overflow_skips_the_update_and_halves_the_scale():
    state, step, tokens = _tiny_step_setup(precision="fp16-mixed")
    assert isinstance(state.loss_scale, DynamicLossScale)
    p0 = jax.device_get(state.params)
    huge = dataclasses.replace(state, loss_scale=dataclasses.replace(
        state.loss_scale, scale=jnp.float32(3e38)))
    new, metrics = step(huge, tokens)
    assert float(metrics["finite"]) == 0.0 and float(metrics["skipped_steps"]) == 1.0
    assert int(new.step) == 1 and int(new.opt_state[2].count) == 0
    assert float(new.loss_scale.scale) == pytest.approx(1.5e38, rel=1e-6)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(p0)):
        np.testing.assert_array_equal(np.asarray(a), b)
    newer, metrics3 = step(dataclasses.replace(new, loss_scale=dataclasses.replace(
        new.loss_scale, scale=jnp.float32(2.0 ** 10))), tokens)
    assert float(metrics3["finite"]) == 1.0 and int(newer.opt_state[2].count) == 1
    assert float(metrics3["skipped_steps"]) == 1.0
    assert np.isfinite(float(metrics3["loss"]))
    changed = [not np.array_equal(np.asarray(a), b)
               for a, b in zip(jax.tree.leaves(newer.params), jax.tree.leaves(p0))]
    assert any(changed)


def test_guarded_adam_is_the_plain_update_when_applied_and_keeps_the_state_when_not():
    params, axes = _toy_params(np.random.default_rng(3))
    t = TrainSection(steps=10, warmup_steps=0, grad_clip=0.0)
    b1, b2 = t.betas
    tx = make_optimizer(t, params, axes)
    rng = np.random.default_rng(4)
    guarded = tx.init(params)
    mu = nu = jax.tree.map(jnp.zeros_like, params)
    for _ in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32),
                             params)
        _, guarded = tx.update(grads, guarded, params, lr=jnp.float32(1e-3),
                               apply=jnp.bool_(True))
        # the plain Adam moments, written out: the guard's scalars must not change a bit
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
        for a, b in zip(jax.tree.leaves((guarded[2].mu, guarded[2].nu)),
                        jax.tree.leaves((mu, nu))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(guarded[2].count) == 3
    bad = jax.tree.map(lambda p: jnp.full(p.shape, jnp.nan, jnp.float32), params)
    bad["emb"] = bad["emb"].at[0, 0].set(jnp.inf)
    updates, kept = tx.update(bad, guarded, params, lr=jnp.float32(0), apply=jnp.bool_(False))
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(guarded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))     # moments and count
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


def test_the_step_writes_params_and_moments_without_selecting_old_against_new():
    # the guard lives inside the update (learning rate 0, moments kept by `apply`): a select
    # between the new and the old state after the update is a second pass over params and
    # both moments (~14 ms of a 250 ms 1.5B step on an H100, where XLA did not fuse it)
    state, step, tokens = _tiny_step_setup(precision="bf16-mixed")
    outer = jax.make_jaxpr(step)(state, tokens).jaxpr
    (call,) = [e for e in outer.eqns if "jaxpr" in e.params]
    inner = call.params["jaxpr"].jaxpr
    n_state = len(jax.tree.leaves(state))
    arrays = [v for v in inner.outvars[:n_state]
              if v.aval.ndim > 0 and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    assert len(arrays) == 3 * len(jax.tree.leaves(state.params))   # params, mu, nu
    assert [v for v in arrays if _made_by(inner, v) == "select_n"] == []


def _made_by(jaxpr, var) -> str:
    """The primitive that computes `var` in `jaxpr`, looking through nested jaxpr calls
    (`jnp.where` is a `pjit` around `select_n`)."""
    for eqn in jaxpr.eqns:
        if var in eqn.outvars:
            sub = eqn.params.get("jaxpr")
            if sub is None:
                return eqn.primitive.name
            sub = getattr(sub, "jaxpr", sub)
            return _made_by(sub, sub.outvars[eqn.outvars.index(var)])
    return "input"


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])      # clipping on, off
def test_clip_with_the_steps_norm_is_optaxs_clip(max_norm):
    rng = np.random.default_rng(5)
    grads = {"a": jnp.asarray(rng.standard_normal((7, 5)), jnp.float32),
             "b": jnp.asarray(rng.standard_normal((3,)), jnp.float32)}
    want, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    ours = clip_by_global_norm(max_norm)
    for kwargs in ({}, {"grad_norm": optax.tree.norm(grads)}):
        got, state = ours.update(grads, ours.init(grads), **kwargs)
        assert state == optax.EmptyState()
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
