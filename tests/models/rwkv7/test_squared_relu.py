"""ChannelMix's `relu(x)²`: autodiff's gradient bit for bit, from one kept array."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7.channel_mix import squared_relu


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equals_autodiff_bitwise_and_keeps_one_array(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 16, 96)) * 3, dtype).at[0, 0, :5].set(0.0)
    dy = jnp.asarray(rng.standard_normal(x.shape), dtype)
    out, pullback = jax.vjp(squared_relu, x)
    ref, ref_pullback = jax.vjp(lambda x: jnp.square(jax.nn.relu(x)), x)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    np.testing.assert_array_equal(np.asarray(pullback(dy)[0], np.float32),
                                  np.asarray(ref_pullback(dy)[0], np.float32))
    kept = jax.tree.leaves(pullback)
    assert [(a.dtype, a.shape) for a in kept] == [(jnp.dtype(dtype), x.shape)]
