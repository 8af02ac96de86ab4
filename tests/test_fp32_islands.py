"""fp32 islands of RWKV-7: each test shows the error bf16/f16 makes without the island, then that
the module's own function keeps the error small under low-precision compute.

Islands: (a) decay w, (b) WKV state, (c) LayerNorm/GroupNorm statistics, (d) kk normalisation,
(e) logits and loss. Plus: under fp16-mixed, r/k/v/a/b reach the WKV op in one dtype (f16).
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lwm_jax import PRESETS, ModelConfig
from lwm_jax.layers.norms import group_norm, layer_norm
from lwm_jax.layers.time_mix import decay_log, normalize_heads, time_mix_forward
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.models.testing import param_dict, randomize_params
from lwm_jax.ops import wkv7_reference_np
from lwm_jax.ops.wkv7_recurrent import recurrent_scan

time_mix_module = importlib.import_module("lwm_jax.layers.time_mix")  # where TimeMix finds wkv7
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# same shapes as tests/test_model.py, so a shared pytest process reuses compiled eager ops
CFG = ModelConfig(vocab_size=97, n_layer=3, n_embd=32, head_size=16, chunk_size=16)


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def layer_params(policy, layer=1, seed=0):
    """One layer's TimeMix parameters of a randomized small model (layer 1: value residual on)."""
    model = randomize_params(RWKV7(CFG, policy, rngs=nnx.Rngs(seed)), seed=seed + 1)
    att = param_dict(model)["blocks"]["att"]
    return jax.tree.map(lambda a: a[layer], att)


def normal(seed, shape, dtype=F32, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def test_a_decay_is_computed_in_fp32():
    policy = PRESETS["bf16-mixed"]
    C, R = 64, 16
    p = {"w0": jnp.linspace(-8.0, 3.0, C, dtype=F32),       # the init's range of w0
         "w1": normal(1, (C, R), scale=0.3), "w2": normal(2, (R, C), scale=0.1)}
    x_w = normal(3, (1, 8, C), BF16)
    x64, p64 = np.asarray(x_w, np.float64), jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    d64 = p64["w0"] + np.tanh(x64 @ p64["w1"]) @ p64["w2"]
    w64 = -np.exp(-0.5) / (1 + np.exp(-d64))
    # relative error of the log-decay = relative error of each channel's memory time 1/|w|
    rel_max = lambda w: float(np.max(np.abs(np.asarray(w, np.float64) - w64) / np.abs(w64)))
    # without the island: the same formula evaluated in bf16 (d rounded to bf16 spacing)
    d_bf = p["w0"].astype(BF16) + jnp.tanh(x_w @ p["w1"].astype(BF16)) @ p["w2"].astype(BF16)
    w_bf = -jnp.exp(jnp.asarray(-0.5, BF16)) * jax.nn.sigmoid(d_bf)
    assert rel_max(w_bf) > 5e-3
    w = decay_log(p, x_w, policy)
    assert w.dtype == F32
    assert rel_max(w) < 1e-5
    # what that means over a long context: decay^T = exp(T w) for T = 4096 on the slow channels
    T, slow = 4096, w64 > -1e-3
    bad_T = np.abs(np.exp(T * np.asarray(w_bf, np.float64)) - np.exp(T * w64))[slow].max()
    good_T = np.abs(np.exp(T * np.asarray(w, np.float64)) - np.exp(T * w64))[slow].max()
    assert bad_T > 1e-2 and good_T < 1e-4


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


def test_b_wkv_state_is_fp32_over_a_long_sequence(monkeypatch):
    policy = PRESETS["bf16-mixed"]
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
    model = RWKV7(CFG, "bf16", rngs=nnx.Rngs(0))
    _, st = model(jnp.ones((1, 4), jnp.int32), return_state=True)
    _, st = model(jnp.ones((1, 4), jnp.int32), state=st, return_state=True)
    assert {x.dtype for x in jax.tree.leaves(st)} == {jnp.dtype(F32)}


@pytest.mark.parametrize("kind", ["layer", "group"])
def test_c_norm_statistics_in_fp32(kind):
    C, G = 64, 4
    weight, bias = normal(7, (C,), scale=0.5) + 1, normal(8, (C,), scale=0.1)
    x = (300 + normal(9, (16, C), scale=2.0)).astype(BF16)   # large mean, spread ~ bf16 ulp
    x64 = np.asarray(x, np.float64).reshape(16, G if kind == "group" else 1, -1)
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) +
                                                         (1e-5 if kind == "layer" else 16e-5))
    ref = ref.reshape(16, C) * np.asarray(weight) + np.asarray(bias)
    # without the island: statistics kept in bf16 (mean rounded to bf16's spacing of 2 at 300)
    xb = x.reshape(16, G if kind == "group" else 1, -1)
    mean = jnp.mean(xb, axis=-1, keepdims=True, dtype=BF16)
    var = jnp.mean(jnp.square(xb - mean), axis=-1, keepdims=True, dtype=BF16)
    bad = ((xb - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(16, C) * weight.astype(BF16)
    assert rel(bad + bias.astype(BF16), ref) > 0.1
    if kind == "layer":
        y = layer_norm(x, weight, bias, out_dtype=BF16)
    else:
        y = group_norm(x, weight, bias, n_groups=G, eps=16e-5, out_dtype=BF16)
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
    # without the island: the same normalisation in f16 (sum of squares 0 or inf)
    sumsq = jnp.sum(x * x, axis=-1, keepdims=True, dtype=F16)
    bad = np.asarray(x / jnp.maximum(jnp.sqrt(sumsq), jnp.asarray(1e-12, F16)), np.float64)
    assert not np.all(np.isfinite(bad)) or rel(bad, ref) > 0.5
    kk = normalize_heads(x)
    assert kk.dtype == F32 and rel(kk, ref) < 1e-6


def test_d_time_mix_sends_unit_kk_to_wkv_under_fp16_with_tiny_keys(monkeypatch):
    policy = PRESETS["fp16-mixed"]
    p = layer_params(policy)
    p["key"] = normal(12, p["key"].shape, scale=2e-5)         # keys ~1e-4: k² underflows f16
    calls = _capture_wkv7(monkeypatch)
    time_mix_forward(p, normal(13, (1, 8, CFG.n_embd), F16), jnp.zeros((1, CFG.n_embd)),
                     jnp.zeros((1, 2, 16, 16)), normal(14, (1, 8, CFG.n_embd), F16), first=False,
                     policy=policy, head_size=CFG.head_size)
    r, w, k, v, a, b = calls[0]["args"]
    norms = np.linalg.norm(np.asarray(a, np.float64), axis=-1)
    assert np.all(np.isfinite(norms)) and np.abs(norms - 1).max() < 2e-3


def test_e_logits_and_loss_in_fp32():
    V, C, T = 65536, 32, 8
    model = RWKV7(ModelConfig(vocab_size=V, n_layer=1, n_embd=C, head_size=16), "bf16-mixed",
                  rngs=nnx.Rngs(0))
    model.head[...] = normal(16, (C, V), scale=3 / np.sqrt(C))   # trained-like logits ~ N(0, 9)
    x = normal(15, (1, T, C), BF16)
    labels = jnp.asarray(np.random.default_rng(17).integers(0, V, (1, T)))
    logits = model.head_logits(x)
    assert logits.dtype == F32
    x64 = np.asarray(x, np.float64)
    xo = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    ref = xo @ np.asarray(model.head[...], np.float64)
    assert rel(logits, ref) < 1e-5
    top = ref.max(-1, keepdims=True)
    lse = np.log(np.exp(ref - top).sum(-1)) + top[..., 0]
    ref_loss = lse - np.take_along_axis(ref, np.asarray(labels)[..., None], -1)[..., 0]
    # without the island: bf16 logits and a bf16 loss over a 65536-way softmax (per token)
    bad = optax.softmax_cross_entropy_with_integer_labels(logits.astype(BF16), labels)
    assert np.abs(np.asarray(bad, np.float64) - ref_loss).max() > 1e-2
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    assert loss.dtype == F32 and np.abs(np.asarray(loss, np.float64) - ref_loss).max() < 1e-4


@pytest.mark.parametrize("preset,dtype", [("fp16-mixed", F16), ("bf16-mixed", BF16),
                                          ("bf16", BF16), ("fp32", F32)])
def test_wkv_inputs_share_one_dtype(monkeypatch, preset, dtype):
    calls = _capture_wkv7(monkeypatch)
    model = randomize_params(RWKV7(CFG, preset, rngs=nnx.Rngs(0)), seed=1)
    model(jnp.ones((1, 6), jnp.int32))
    assert len(calls) == CFG.n_layer
    for call in calls:
        r, w, k, v, a, b = call["args"]
        assert [x.dtype for x in (r, k, v, a, b)] == [jnp.dtype(dtype)] * 5
        assert w.dtype == F32 and call["kw"]["initial_state"].dtype == F32
        assert call["out"][1].dtype == F32
