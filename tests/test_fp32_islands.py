"""fp32 islands of RWKV-7: each test runs the library's own code twice, once as it is and once
with the island's function replaced, where the model looks it up, by the same math in the
compute dtype ("without the island"). The second run must be far off a float64 reference and
the first close to it: that shows both that the island is needed and that it is on the path the
model really takes (a library that bypassed the island function would fail the first half or
no longer degrade in the second).

Islands: (a) decay w, (b) WKV state, (c) LayerNorm/GroupNorm statistics, (d) kk normalisation,
(e) logits and loss, (f) per-channel parameter gradients (summed over the tokens in float32).
Plus: under fp16-mixed, r/k/v/a/b reach the WKV op in one dtype (f16).
"""
from __future__ import annotations

import dataclasses
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax.runtime import Runtime
from lwm_jax import PRESETS, ModelConfig
from lwm_jax.probe import Probe
from lwm_jax.models.rwkv7.time_mix import DECAY_SCALE, decay_log, normalize_heads, time_mix_forward
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.models.rwkv7.testing import param_dict, randomize_params
from lwm_jax.ops.layer_norm import layer_norm
from lwm_jax.ops.wkv7 import wkv7_reference_np
from lwm_jax.ops.wkv7.recurrent import recurrent_scan
from lwm_jax.train.loss import cross_entropy, lm_loss

time_mix_module = importlib.import_module("lwm_jax.models.rwkv7.time_mix")  # where TimeMix finds wkv7
model_module = importlib.import_module("lwm_jax.models.rwkv7.model")  # where RWKV7 finds ln0's LN
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# same shapes as tests/models/rwkv7/test_model.py, so a shared pytest process reuses compiled eager ops
CFG = ModelConfig(vocab_size=97, n_layer=3, n_embd=32, head_size=16)
RT = Runtime(chunk_size=16)


def exact_products(preset: str):
    """`preset` with IEEE float32 products (matmul and WKV precision "highest"). An island is
    about where float32 is stored and accumulated; the mixed presets' float32 products are TF32
    on a GPU by design (~3e-4 relative on logits and the WKV state: docs/precision.md,
    "Measuring a policy"), which would sit above the float32 tolerances these tests hold on
    every platform. On a CPU the numbers are the preset's own."""
    return dataclasses.replace(PRESETS[preset], name=f"{preset}, IEEE products",
                               matmul_precision="highest", wkv_precision="highest")


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def layer_params(policy, layer=1, seed=0):
    """One layer's TimeMix parameters of a randomized small model (layer 1: value residual on)."""
    model = randomize_params(RWKV7(CFG, policy, runtime=RT, rngs=nnx.Rngs(seed)), seed=seed + 1)
    att = param_dict(model)["blocks"]["att"]
    return jax.tree.map(lambda a: a[layer], att)


def normal(seed, shape, dtype=F32, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def _capture_wkv7(monkeypatch):
    """Replace the WKV op TimeMix calls by a recorder around the real one."""
    calls = []
    real = time_mix_module.wkv7

    def recorder(r, w, k, v, a, b, **kw):
        out = real(r, w, k, v, a, b, **kw)
        calls.append({"args": (r, w, k, v, a, b), "kw": kw, "out": out})
        return out
    monkeypatch.setattr(time_mix_module, "wkv7", recorder)
    return calls


def _decay_in_compute_dtype(p, x_w_BTC, policy):
    """`decay_log` without the island: the LoRA through the policy's compute-dtype matmuls
    (`Policy.einsum`, the path of the a/v/g LoRAs), w0 and the sigmoid in the compute dtype."""
    hidden = jnp.tanh(policy.einsum("btc,cr->btr", x_w_BTC, p["w1"]))
    d = p["w0"].astype(policy.compute_dtype) + policy.einsum("btr,rc->btc", hidden, p["w2"])
    return (-DECAY_SCALE * jax.nn.sigmoid(d)).astype(F32)


def _decay_reaching_wkv(monkeypatch, island: bool):
    """Run TimeMix (bf16-mixed) with or without the decay island; return the `w` it hands to
    wkv7 and the float64 decay of the `x_w` and parameters it used."""
    policy = PRESETS["bf16-mixed"]
    C = CFG.n_embd
    p = layer_params(policy)
    p["w0"] = jnp.linspace(-8.0, 3.0, C, dtype=F32)          # the init's range of w0
    p["w1"], p["w2"] = normal(1, p["w1"].shape, scale=0.3), normal(2, p["w2"].shape, scale=0.1)
    seen = []
    decay = decay_log if island else _decay_in_compute_dtype
    monkeypatch.setattr(time_mix_module, "decay_log",
                        lambda p_, x_w, pol: seen.append(x_w) or decay(p_, x_w, pol))
    calls = _capture_wkv7(monkeypatch)
    time_mix_forward(p, normal(3, (1, 8, C), BF16), jnp.zeros((1, C)), jnp.zeros((1, 2, 16, 16)),
                     normal(4, (1, 8, C), BF16), first=False, policy=policy,
                     head_size=CFG.head_size)
    (x_w,), w = seen, calls[0]["args"][1]
    assert w.dtype == F32
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    d64 = p64["w0"] + np.tanh(np.asarray(x_w, np.float64) @ p64["w1"]) @ p64["w2"]
    return np.asarray(w, np.float64).reshape(d64.shape), -np.exp(-0.5) / (1 + np.exp(-d64))


def test_a_decay_is_computed_in_fp32(monkeypatch):
    # relative error of the log-decay = relative error of each channel's memory time 1/|w|
    rel_max = lambda w, w64: float(np.max(np.abs(w - w64) / np.abs(w64)))  # noqa: E731
    # what that means over a long context: decay^T = exp(T w), T = 4096, on the slow channels
    T = 4096
    long_err = lambda w, w64: float(  # noqa: E731
        np.abs(np.exp(T * w) - np.exp(T * w64))[w64 > -1e-3].max())
    # without the island bf16 rounds d (spacing 1/16 at |d| ~ 8): w off by up to ~3%, decay^T
    # by up to ~0.37 * 3% where T |w| ~ 1 (observed 0.038 and 0.012)
    bad, bad64 = _decay_reaching_wkv(monkeypatch, island=False)
    assert rel_max(bad, bad64) > 5e-3 and long_err(bad, bad64) > 5e-3
    monkeypatch.undo()
    good, good64 = _decay_reaching_wkv(monkeypatch, island=True)
    assert rel_max(good, good64) < 1e-5 and long_err(good, good64) < 1e-4


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed", "fp32-fast"])
def test_a_decay_lora_products_are_float32_accurate_under_every_policy(preset):
    # a CPU multiplies float32 exactly at any precision, so the float64 comparison above shows a
    # TF32 decay only on a GPU; here the traced forward must ask for IEEE float32 (HIGHEST) on
    # float32 operands, or (bf16 compute) for bf16 x bf16 products of the operands' bf16 pieces
    # accumulated in float32 (`lwm_jax.precision.bf16_split`): exact products on every backend, and the
    # float64 comparison above checks that the pieces add up to float32 accuracy
    policy = PRESETS[preset]
    p = layer_params(policy)
    R = p["w1"].shape[-1]
    jaxpr = jax.make_jaxpr(lambda x: decay_log(p, x, policy))(normal(3, (1, 8, CFG.n_embd), BF16))
    dots = list(_dot_generals(jaxpr.jaxpr))
    assert len(dots) == 2
    for e in dots:
        dtypes = [v.aval.dtype for v in e.invars]
        if preset == "bf16-mixed":
            assert dtypes == [jnp.dtype(BF16)] * 2, dtypes
            assert e.params["preferred_element_type"] == jnp.dtype(F32)
        else:
            assert dtypes == [jnp.dtype(F32)] * 2
            assert tuple(e.params["precision"]) == (jax.lax.Precision.HIGHEST,) * 2, e.params
    if preset == "bf16-mixed":
        # x_w is bf16 (one piece) times w1's three pieces side by side; tanh(...) @ w2 as the
        # six terms i + j <= 2 of their three pieces each, along the contracted axis
        assert dots[0].invars[1].aval.shape == (CFG.n_embd, R, 3)
        assert dots[1].invars[0].aval.shape[-1] == 6 * R


def _eqns(jaxpr, primitive):
    """Every `primitive` equation of `jaxpr` and of its sub-jaxprs (custom_vjp, pjit, scan)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner, primitive)


def _dot_generals(jaxpr):
    return _eqns(jaxpr, "dot_general")


def test_b_wkv_state_is_fp32_over_a_long_sequence(monkeypatch):
    policy = exact_products("bf16-mixed")
    p = layer_params(policy)
    B, T, C, N = 1, 512, CFG.n_embd, CFG.head_size
    x = normal(4, (B, T, C), BF16)
    state0 = normal(5, (B, C // N, N, N), scale=0.5)
    calls = _capture_wkv7(monkeypatch)
    _, _, state = time_mix_forward(p, x, jnp.zeros((B, C)), state0, normal(6, (B, T, C), BF16),
                                   first=False, policy=policy, head_size=N, chunk_size=64)
    (args,) = [c["args"] for c in calls]
    assert calls[0]["kw"]["initial_state"].dtype == F32 and state.dtype == F32
    _, ref_state = wkv7_reference_np(*args, initial_state=np.asarray(state0))
    # without the island: the same recurrence with a bf16 state drifts
    _, bf16_state = recurrent_scan(*args, state0, None, compute_dtype=BF16)
    assert rel(bf16_state, ref_state) > 1e-2
    assert rel(state, ref_state) < 1e-4


def test_b_model_state_stays_fp32_under_bf16():
    model = RWKV7(CFG, "bf16", runtime=RT, rngs=nnx.Rngs(0))
    _, st = model(jnp.ones((1, 4), jnp.int32), return_state=True)
    _, st = model(jnp.ones((1, 4), jnp.int32), state=st, return_state=True)
    assert {x.dtype for x in jax.tree.leaves(st)} == {jnp.dtype(F32)}


def _norm_in_compute_dtype(x, weight, bias, groups, eps, out_dtype):
    """LayerNorm / GroupNorm without the island: statistics and affine in x's dtype."""
    xg = x.reshape(*x.shape[:-1], groups, -1)
    mean = jnp.mean(xg, axis=-1, keepdims=True, dtype=x.dtype)
    var = jnp.mean(jnp.square(xg - mean), axis=-1, keepdims=True, dtype=x.dtype)
    y = ((xg - mean) * jax.lax.rsqrt(var + jnp.asarray(eps, x.dtype))).reshape(x.shape)
    return (y * weight.astype(x.dtype) + bias.astype(x.dtype)).astype(out_dtype or x.dtype)


def _norm_ref(x, weight, bias, groups, eps):
    x64 = np.asarray(x, np.float64)
    xg = x64.reshape(*x64.shape[:-1], groups, -1)
    y = (xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + eps)
    return y.reshape(x64.shape) * np.asarray(weight, np.float64) + np.asarray(bias, np.float64)


def _ln0_through_the_model(monkeypatch, island: bool):
    """The bf16 model's ln0 on embeddings 300 + N(0, 2²) (large mean, spread ~ bf16's spacing
    of 2 at 300): (probe 'ln0', float64 LayerNorm of probe 'emb')."""
    model = RWKV7(CFG, "bf16", runtime=RT, rngs=nnx.Rngs(0))
    model.emb[...] = (300 + normal(9, model.emb[...].shape, scale=2.0)).astype(BF16)
    model.ln0.weight[...] = (normal(7, (CFG.n_embd,), scale=0.5) + 1).astype(BF16)
    model.ln0.bias[...] = normal(8, (CFG.n_embd,), scale=0.1).astype(BF16)
    if not island:
        monkeypatch.setattr(model_module, "layer_norm",
                            lambda x, w, b, *, eps=1e-5, out_dtype=None:
                            _norm_in_compute_dtype(x, w, b, 1, eps, out_dtype))
    probe = Probe()
    model(jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 8))), probe=probe)
    taps = dict(probe.records)
    return taps["ln0"], _norm_ref(taps["emb"], model.ln0.weight[...], model.ln0.bias[...], 1,
                                  1e-5)


def _ln_x_through_time_mix(monkeypatch, island: bool):
    """TimeMix's ln_x (GroupNorm over heads, bf16-mixed) on a WKV output with a large common
    offset: the state starts at 300 + N(0, 1). (probe 'ln_x', float64 GroupNorm of probe
    'wkv_out')."""
    policy = PRESETS["bf16-mixed"]
    p = layer_params(policy)
    C, N = CFG.n_embd, CFG.head_size
    if not island:
        monkeypatch.setattr(time_mix_module, "group_norm",
                            lambda x, w, b, *, n_groups, eps, out_dtype=None, **impl_args:
                            _norm_in_compute_dtype(x, w, b, n_groups, eps, out_dtype))
    probe = Probe()
    time_mix_forward(p, normal(4, (2, 8, C), BF16), jnp.zeros((2, C)),
                     300 + normal(5, (2, C // N, N, N)), normal(6, (2, 8, C), BF16),
                     first=False, policy=policy, head_size=N, probe=probe)
    taps = dict(probe.records)
    o = np.asarray(taps["wkv_out"], np.float64).reshape(2, 8, C)
    return taps["ln_x"], _norm_ref(o, p["ln_x"]["weight"], p["ln_x"]["bias"], C // N, N * 1e-5)


@pytest.mark.parametrize("kind", ["layer", "group"])
def test_c_norm_statistics_in_fp32(monkeypatch, kind):
    run = _ln0_through_the_model if kind == "layer" else _ln_x_through_time_mix
    bad, ref = run(monkeypatch, island=False)
    assert rel(bad, ref) > 0.1                  # bf16 mean rounded to bf16's spacing of 2
    monkeypatch.undo()
    y, ref = run(monkeypatch, island=True)
    assert y.dtype == BF16 and rel(y, ref) < 5e-3


def test_c_layer_norm_of_fp32_input_with_tiny_spread():
    x = 300 + normal(10, (8, 64), scale=0.01)                # f32: bf16 cannot hold the spread
    x64 = np.asarray(x, np.float64)
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    ones, zeros = jnp.ones(64), jnp.zeros(64)
    collapsed = np.asarray(layer_norm(x.astype(BF16), ones, zeros), np.float64)
    assert rel(collapsed, ref) > 0.5
    assert rel(layer_norm(x, ones, zeros, out_dtype=BF16), ref) < 1e-2


@pytest.mark.parametrize("scale", [1e-4, 300.0])
def test_d_kk_normalisation_in_fp32(scale):
    x = normal(11, (2, 3, 4, 16), F16, scale=scale)   # tiny: x² underflows f16; big: overflows
    x64 = np.asarray(x, np.float64)
    ref = x64 / np.linalg.norm(x64, axis=-1, keepdims=True)
    kk = normalize_heads(x)
    assert kk.dtype == F32 and rel(kk, ref) < 1e-6


def _normalize_in_f16(x, scale=None, eps=1e-12):
    """`normalize_heads` without the island: the same formula in float16."""
    x = x.astype(F16) * (1 if scale is None else scale.astype(F16))
    sumsq = jnp.sum(x * x, axis=-1, keepdims=True, dtype=F16)
    return (x * jax.lax.rsqrt(jnp.maximum(sumsq, jnp.asarray(eps * eps, F16)))).astype(F32)


@pytest.mark.parametrize("keys", ["tiny", "huge"])
def test_d_time_mix_sends_unit_kk_to_wkv_under_fp16(monkeypatch, keys):
    """fp16-mixed TimeMix with keys ~1e-4 (k² underflows f16) or ~300 (the sum of k² overflows
    it): `a = -kk` reaches the WKV with unit norm per head only thanks to the island."""
    policy = PRESETS["fp16-mixed"]
    p = layer_params(policy)
    p["key"] = normal(12, p["key"].shape, scale=2e-5 if keys == "tiny" else 50.0)

    def a_norms(island):
        if not island:
            monkeypatch.setattr(time_mix_module, "normalize_heads", _normalize_in_f16)
        calls = _capture_wkv7(monkeypatch)
        time_mix_forward(p, normal(13, (1, 8, CFG.n_embd), F16), jnp.zeros((1, CFG.n_embd)),
                         jnp.zeros((1, 2, 16, 16)), normal(14, (1, 8, CFG.n_embd), F16),
                         first=False, policy=policy, head_size=CFG.head_size)
        monkeypatch.undo()
        r, w, k, v, a, b = calls[0]["args"]
        return np.linalg.norm(np.asarray(a, np.float64), axis=-1)

    bad = a_norms(island=False)
    assert not np.all(np.isfinite(bad)) or np.abs(bad - 1).max() > 0.5
    good = a_norms(island=True)
    assert np.all(np.isfinite(good)) and np.abs(good - 1).max() < 2e-3


def test_e_logits_and_loss_in_fp32():
    """Logits island (`head_logits`: fp32 LayerNorm and head) and loss island
    (`lwm_jax.train.loss`: fp32 logsumexp) on a 65536-way softmax with trained-like logits."""
    V, C, T = 65536, 32, 8
    model = RWKV7(ModelConfig(vocab_size=V, n_layer=1, n_embd=C, head_size=16),
                  exact_products("bf16-mixed"), rngs=nnx.Rngs(0))
    model.head[...] = normal(16, (C, V), scale=3 / np.sqrt(C))   # trained-like logits ~ N(0, 9)
    x = normal(15, (1, T, C), BF16)
    labels = jnp.asarray(np.random.default_rng(17).integers(0, V, (1, T)))
    logits = model.head_logits(x)
    assert logits.dtype == F32
    x64 = np.asarray(x, np.float64)
    xo = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    ref = xo @ np.asarray(model.head[...], np.float64)
    assert rel(logits, ref) < 1e-5

    def loss64(z):                                   # float64 cross-entropy per token
        z = np.asarray(z, np.float64)
        top = z.max(-1, keepdims=True)
        lse = np.log(np.exp(z - top).sum(-1)) + top[..., 0]
        return lse - np.take_along_axis(z, np.asarray(labels)[..., None], -1)[..., 0]

    def per_token(fn, z):                            # the library's mean loss, token by token
        return np.array([float(fn(z[:, t:t + 1], labels[:, t:t + 1])) for t in range(T)])

    ref_loss = loss64(ref)[0]
    l2wrap_loss = lambda z, y: lm_loss(z, y, use_l2wrap=True)   # noqa: E731
    # without the logits island: the loss of the logits rounded to bf16 is off by > 1e-2
    bad = per_token(cross_entropy, logits.astype(BF16))
    assert np.abs(bad - ref_loss).max() > 1e-2
    # the loss island: bf16 logits are upcast, so the loss adds no error of its own to theirs
    # (a bf16 logsumexp over 65536 terms would add ~1e-2)
    assert cross_entropy(logits.astype(BF16), labels).dtype == F32
    assert np.abs(bad - loss64(logits.astype(BF16))[0]).max() < 1e-4
    # with both islands: the library's loss (plain and with L2Wrap) of the fp32 logits
    for fn in (cross_entropy, l2wrap_loss):
        assert fn(logits, labels).dtype == F32
        assert np.abs(per_token(fn, logits) - ref_loss).max() < 1e-4


@pytest.mark.parametrize("preset,V,C,B,T", [("bf16-mixed", 512, 64, 2, 24),
                                             ("fp16-mixed", 512, 64, 2, 24),
                                             ("fp16-mixed", 4096, 16, 1, 32768)])
def test_e_logits_island_is_the_forward_and_its_gradients_use_the_compute_dtype(preset, V, C,
                                                                               B, T):
    """The trainer's fused loss under a 16-bit policy: the head's forward product takes float32
    operands (the island) and its two gradient products take 16-bit ones (as every other
    backward product of the step; as TF32 they were two thirds of the head's time on an H200).
    The loss equals the one from a plain float32 head; the gradients equal float32 ones to
    16-bit rounding -- also at 32768 positions and 4096 classes, where the mean's 1 / (B T) folded into
    an fp16 cotangent would leave its entries ~1e-8, below fp16's smallest subnormal."""
    from lwm_jax.models.rwkv7 import head_fn
    from lwm_jax.train.loss import fused_lm_loss

    policy, low = exact_products(preset), jnp.dtype(PRESETS[preset].compute_dtype)
    params = (1.0 + normal(1, (C,), scale=0.1), normal(2, (C,), scale=0.1),
              normal(3, (C, V), scale=1 / np.sqrt(C)))
    x = normal(4, (B, T, C), low)
    labels = jnp.asarray(np.random.default_rng(5).integers(0, V, (B, T)))

    def loss(x, p, pol):
        return fused_lm_loss(head_fn(pol), x, p, labels, chunk_tokens=max(16, T // 4),
                             use_l2wrap=True)

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    jaxpr = jax.make_jaxpr(lambda x, p: grad(x, p, policy))(x, params).jaxpr
    dtypes = [tuple(jnp.dtype(v.aval.dtype) for v in e.invars) for e in _dot_generals(jaxpr)]
    names = sorted("x".join(d.name for d in pair) for pair in dtypes)
    assert names == sorted(["float32xfloat32"] + [f"{low.name}x{low.name}"] * 2), names
    value, (dx, dp) = grad(x, params, policy)
    value32, (dx32, dp32) = grad(x, params, PRESETS["fp32"])
    assert float(value) == pytest.approx(float(value32), rel=1e-6)
    assert dx.dtype == low and all(g.dtype == F32 for g in dp)
    # 16-bit rounding of the operands: ~3e-3 (bf16), ~1e-3 (fp16); with the 1 / (B T) inside
    # the fp16 cotangent the 32768-position case was 2.6e-2 (dx) and 0.29 (head)
    assert rel(dx, dx32) < 5e-3 and rel(dp[2], dp32[2]) < 5e-3
    assert rel(dp[2], dp32[2]) > 0          # the products really were rounded


@pytest.mark.parametrize("preset,dtype", [("fp16-mixed", F16), ("bf16-mixed", BF16),
                                          ("bf16", BF16), ("fp32", F32)])
def test_wkv_inputs_share_one_dtype(monkeypatch, preset, dtype):
    calls = _capture_wkv7(monkeypatch)
    model = randomize_params(RWKV7(CFG, preset, runtime=RT, rngs=nnx.Rngs(0)), seed=1)
    model(jnp.ones((1, 6), jnp.int32))
    assert len(calls) == CFG.n_layer
    for call in calls:
        r, w, k, v, a, b = call["args"]
        assert [x.dtype for x in (r, k, v, a, b)] == [jnp.dtype(dtype)] * 5
        assert w.dtype == F32 and call["kw"]["initial_state"].dtype == F32
        assert call["out"][1].dtype == F32


@pytest.mark.parametrize("preset", ["bf16-mixed", "fp16-mixed"])
def test_f_parameter_gradients_are_summed_over_tokens_in_fp32(preset):
    """A per-channel parameter applied to 16-bit activations (the token-shift mixes, a0, v0,
    k_a, r_k, ChannelMix's x_k) gets its gradient as a sum over B*T tokens: that sum must be
    float32. Structural: no 16-bit `reduce_sum` over the batch axis anywhere in the gradient of
    the model's loss (a 16-bit sum of 32768 terms keeps ~8 bits; numbers in
    `lwm_jax.precision.param_mul`). Numerical: `param_mul` / `param_add` pull a biased 16-bit
    cotangent over 32768 tokens back to the float64 sum of the same 16-bit numbers."""
    B, T = 2, 24
    model = randomize_params(RWKV7(CFG, preset, runtime=RT, rngs=nnx.Rngs(0)), seed=1)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (B, T + 1)))

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return cross_entropy(logits, tokens[:, 1:])

    where = _sixteen_bit_batch_sums(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert not where, f"16-bit sums over the batch axis: {where}"
    # and numerically, at the scale where it matters: 32768 tokens of a biased cotangent
    from lwm_jax.precision import param_add, param_mul
    low = jnp.dtype(PRESETS[preset].compute_dtype)
    x = (1.0 + normal(7, (4, 8192, 8), scale=0.5)).astype(low)
    g = (1.0 + normal(8, (4, 8192, 8), scale=0.5)).astype(low)
    mu = normal(9, (8,))
    _, pull = jax.vjp(param_mul, x, mu)
    ref = np.sum(np.asarray(g, np.float64) * np.asarray(x, np.float64), axis=(0, 1))
    assert rel(pull(g)[1], ref) < 1e-6
    _, pull = jax.vjp(param_add, x, mu)
    assert rel(pull(g)[1], np.asarray(g, np.float64).sum(axis=(0, 1))) < 1e-6


def _sixteen_bit_batch_sums(jaxpr):
    """Where (name stacks) `jaxpr` sums a 16-bit array over its batch axis: axis 0, or the
    batch axis 1 of a stack of `[B, T, C]` arrays (`token_shift_mixes`' backward sums its
    `[M, B, T, C]` products over axes 1 and 2)."""
    return sorted({str(e.source_info.name_stack) for e in _eqns(jaxpr, "reduce_sum")
                   if jnp.dtype(e.invars[0].aval.dtype).itemsize == 2
                   and e.invars[0].aval.ndim >= 2
                   and (0 in e.params["axes"]
                        or (e.invars[0].aval.ndim == 4 and {1, 2} <= set(e.params["axes"])))})


@pytest.mark.parametrize("config", ["llama-tiny.yaml", "rwkv7-hybrid-tiny.yaml"])
def test_f_other_families_sum_parameter_gradients_in_fp32(config):
    """The same structural check for the transformer and the hybrid (their norms' weights and
    the hybrid's TimeMix parameters), under bf16-mixed."""
    from lwm_jax.models.registry import arch_of_config
    from lwm_jax.train.config import load_config

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", config)).model
    model = arch_of_config(cfg).model_cls(cfg, "bf16-mixed", rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17)))

    def loss(params):
        return cross_entropy(nnx.merge(graphdef, params)(tokens[:, :-1]), tokens[:, 1:])

    where = _sixteen_bit_batch_sums(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert not where, f"16-bit sums over the batch axis: {where}"
