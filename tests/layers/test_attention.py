"""Grouped-query attention: causal and packed-document masks, float32 softmax for 16-bit
inputs, and the KV cache (decode = full attention)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.layers.attention import (attend, cached_attention, empty_cache, self_attention)


def _reference(q, k, v, allowed):
    """float64 attention; `allowed[b, t, s]` bool; keys/values repeated per query group."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(allowed[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def _qkv(seed, B, T, H, K, D, dtype=jnp.float32, S=None):
    rng = np.random.default_rng(seed)
    S = T if S is None else S
    return (jnp.asarray(rng.standard_normal((B, T, H, D)), dtype),
            jnp.asarray(rng.standard_normal((B, S, K, D)), dtype),
            jnp.asarray(rng.standard_normal((B, S, K, D)), dtype))


@pytest.mark.parametrize("H,K", [(4, 4), (4, 2), (6, 1)])
def test_causal_grouped_query_attention_matches_float64(H, K):
    q, k, v = _qkv(0, 2, 9, H, K, 16)
    out = self_attention(q, k, v, precision="highest")
    allowed = np.broadcast_to(np.tril(np.ones((9, 9), bool)), (2, 9, 9))
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, allowed), rtol=1e-5,
                               atol=1e-6)


def test_packed_documents_attend_only_inside_their_segment():
    q, k, v = _qkv(1, 2, 10, 4, 2, 8)
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [3] * 10])
    out = np.asarray(self_attention(q, k, v, precision="highest", segment_ids_BT=seg))
    s = np.asarray(seg)
    allowed = (s[:, :, None] == s[:, None, :]) & np.tril(np.ones((10, 10), bool))
    np.testing.assert_allclose(out, _reference(q, k, v, allowed), rtol=1e-5, atol=1e-6)
    # the first document of row 0 alone gives the same outputs as inside the pack
    alone = np.asarray(self_attention(q[:1, :3], k[:1, :3], v[:1, :3], precision="highest"))
    np.testing.assert_allclose(out[:1, :3], alone, rtol=1e-6, atol=1e-7)
    # and the second document does not see the first
    second = np.asarray(self_attention(q[:1, 3:7], k[:1, 3:7], v[:1, 3:7], precision="highest"))
    np.testing.assert_allclose(out[:1, 3:7], second, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_inputs_get_float32_logits_and_softmax(dtype, jaxpr_eqns):
    """XLA's attention (CPU, and TPU off splash) takes float32 logits and softmax; the values
    are then checked on this host's own path (on a GPU: cuDNN's fused kernel)."""
    q, k, v = _qkv(2, 1, 64, 4, 2, 32, dtype)
    jaxpr = jax.make_jaxpr(lambda *a: self_attention(*a, precision="default",
                                                     platform="cpu"))(q, k, v).jaxpr
    exps, maxes, sums = jaxpr_eqns(jaxpr, "exp"), jaxpr_eqns(jaxpr, "reduce_max"), jaxpr_eqns(jaxpr, "reduce_sum")
    assert exps and maxes and sums
    for eqn in exps + maxes + sums:
        assert eqn.invars[0].aval.dtype == jnp.float32, eqn
    first_dot = jaxpr_eqns(jaxpr, "dot_general")[0]
    assert first_dot.outvars[0].aval.dtype == jnp.float32     # q k^T accumulated in float32
    out = self_attention(q, k, v, precision="default")
    assert out.dtype == dtype
    allowed = np.broadcast_to(np.tril(np.ones((64, 64), bool)), (1, 64, 64))
    ref = _reference(np.asarray(q, np.float32), np.asarray(k, np.float32),
                     np.asarray(v, np.float32), allowed)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2)


def test_float32_precision_reaches_the_products(jaxpr_eqns):
    q, k, v = _qkv(3, 1, 4, 2, 2, 8)
    jaxpr = jax.make_jaxpr(lambda *a: self_attention(*a, precision="highest"))(q, k, v).jaxpr
    dots = jaxpr_eqns(jaxpr, "dot_general")
    assert len(dots) == 2
    for eqn in dots:
        assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, eqn.params


def test_cache_prefill_then_decode_equals_full_attention():
    B, T, H, K, D = 2, 12, 4, 2, 8
    q, k, v = _qkv(4, B, T, H, K, D)
    full = np.asarray(self_attention(q, k, v, precision="highest"))
    cache = empty_cache(B, 16, K, D, jnp.float32)
    out, cache = cached_attention(q[:, :5], k[:, :5], v[:, :5], cache, precision="highest")
    outs = [np.asarray(out)]
    for t in range(5, T):
        out, cache = cached_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache,
                                      precision="highest")
        outs.append(np.asarray(out))
    np.testing.assert_array_equal(np.asarray(cache.length), [T, T])
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-5, atol=1e-6)


def test_cache_rows_at_different_lengths():
    """Row 1 starts two positions later than row 0: each row's decode step sees its own
    history only."""
    B, H, K, D = 2, 2, 1, 8
    q, k, v = _qkv(5, B, 6, H, K, D)
    cache = empty_cache(B, 8, K, D, jnp.float32)
    cache = cache.__class__(cache.k.at[1, :2].set(99.0), cache.v.at[1, :2].set(99.0),
                            jnp.asarray([0, 2], jnp.int32))
    # row 1 already holds two entries (value 99): its queries sit at positions 2..7
    out, cache = cached_attention(q, k, v, cache, precision="highest")
    np.testing.assert_array_equal(np.asarray(cache.length), [6, 8])
    row0 = np.asarray(self_attention(q[:1], k[:1], v[:1], precision="highest"))
    np.testing.assert_allclose(np.asarray(out[:1]), row0, rtol=1e-5, atol=1e-6)
    hist_k = np.concatenate([np.full((1, 2, K, D), 99.0), np.asarray(k[1:])], 1)
    hist_v = np.concatenate([np.full((1, 2, K, D), 99.0), np.asarray(v[1:])], 1)
    allowed = (np.arange(8)[None, :] <= np.arange(2, 8)[:, None])[None]
    np.testing.assert_allclose(np.asarray(out[1:]), _reference(q[1:], hist_k, hist_v, allowed),
                               rtol=1e-5, atol=1e-6)


def test_head_count_mismatch_is_one_line():
    q, k, v = _qkv(6, 1, 3, 3, 2, 4)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        attend(q, k, v, precision="highest")
