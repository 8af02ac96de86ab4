"""GPU only (skipped elsewhere): 16-bit causal attention takes cuDNN's fused kernel and agrees
with the XLA form. Run on a GPU machine with `python -m pytest -q tests/layers/test_attention_gpu.py`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.layers.attention import self_attention

pytestmark = pytest.mark.gpu


def _qkv(B=2, T=512, H=8, K=2, D=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, T, K, D)), dtype)
    return q, k, v


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def test_bf16_causal_attention_runs_cudnn_and_matches_xla():
    q, k, v = _qkv()
    fused = jax.jit(lambda q, k, v: self_attention(q, k, v, precision="default"))
    hlo = fused.lower(q, k, v).compile().as_text()
    assert "cudnn" in hlo.lower(), "16-bit causal attention did not take cuDNN's fused kernel"
    # the XLA form of the same attention: a boolean causal mask forces implementation=None
    seg = jnp.zeros(q.shape[:2], jnp.int32)
    xla = self_attention(q, k, v, precision="default", segment_ids_BT=seg)
    assert _rel(fused(q, k, v), xla) < 1e-2

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
    g_fused = jax.grad(loss(lambda *a: self_attention(*a, precision="default")), (0, 1, 2))(q, k, v)
    g_xla = jax.grad(loss(lambda *a: self_attention(*a, precision="default",
                                                    segment_ids_BT=seg)), (0, 1, 2))(q, k, v)
    for a, b in zip(g_fused, g_xla):
        assert _rel(a, b) < 2e-2
