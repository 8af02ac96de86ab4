"""fp16-mixed ChannelMix: relu(k W)² no longer overflows float16 above pre-activations of 256."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lwm_jax.models.rwkv7.channel_mix import channel_mix_forward
from lwm_jax.precision import parse_policy


def _setup(gain):
    rng = np.random.default_rng(0)
    C, F = 32, 128
    p = {"x_k": jnp.asarray(rng.uniform(0, 1, C), jnp.float32),
         "key": jnp.asarray(rng.normal(size=(C, F)) * gain, jnp.float32),
         "value": jnp.asarray(rng.normal(size=(F, C)) * 0.01, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(2, 16, C)), jnp.float32)
    return p, x


def _run(p, x, preset):
    return channel_mix_forward(p, x, jnp.zeros((2, x.shape[-1])), policy=parse_policy(preset))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_large_preactivations_stay_finite_and_accurate_under_fp16():
    p, x = _setup(gain=40.0)                      # pre-activations up to ~880: squares ~7.7e5
    assert float(jnp.max(jnp.einsum("btc,cf->btf", x, p["key"]))) > 600
    ref = _run(p, x, "fp32")
    out = _run(p, x, "fp16-mixed")
    assert out.dtype == jnp.float16 and bool(jnp.isfinite(out).all())
    assert rel(out, ref) < 3e-3                   # fp16 rounding of the operands and the output

    def loss(p, preset):     # a mean: gradients this size are what fp16 loss scaling keeps
        return jnp.mean(_run(p, x, preset).astype(jnp.float32))
    g16, g32 = jax.grad(loss)(p, "fp16-mixed"), jax.grad(loss)(p, "fp32")
    for name in p:
        assert bool(jnp.isfinite(g16[name]).all()), name
        assert rel(g16[name], g32[name]) < 2e-2, name


def test_small_activations_match_fp32_under_fp16():
    p, x = _setup(gain=1.0)                       # pre-activations below 128: scale 1
    assert float(jnp.max(jnp.einsum("btc,cf->btf", x, p["key"]))) < 128
    assert rel(_run(p, x, "fp16-mixed"), _run(p, x, "fp32")) < 3e-3
