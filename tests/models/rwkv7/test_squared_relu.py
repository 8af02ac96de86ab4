"""ChannelMix's `relu(x)²`: autodiff's value bit for bit; a gradient within one rounding of
autodiff's against float64, from the one array the value matmul keeps anyway (the output)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.ops.squared_relu_mlp import squared_relu

# the gradient's error against float64, in ulps of each element (a relative ulp is at most
# 2^-7 in bf16, 2^-23 in fp32): autodiff's is the output rounding of `dy * 2 relu(x)`, half an
# ulp. Ours: the square's rounding halved by the square root (a quarter ulp) plus the output
# rounding (half); in fp32 the square root and the float32 product round once more each
ULP = {jnp.float32: 2.0 ** -23, jnp.bfloat16: 2.0 ** -7}
BOUND = {jnp.float32: 1.5, jnp.bfloat16: 0.75}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_value_bitwise_gradient_within_one_rounding_one_kept_array(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 16, 96)) * 3, dtype).at[0, 0, :5].set(0.0)
    dy = jnp.asarray(rng.standard_normal(x.shape), dtype)
    out, pullback = jax.vjp(squared_relu, x)
    ref, ref_pullback = jax.vjp(lambda x: jnp.square(jax.nn.relu(x)), x)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))

    (dx,) = pullback(dy)
    assert dx.dtype == dtype
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    exact = dy64 * 2 * np.maximum(x64, 0.0)
    err = np.abs(np.asarray(dx, np.float64) - exact)
    err_autodiff = np.abs(np.asarray(ref_pullback(dy)[0], np.float64) - exact)
    scale = np.abs(exact) * ULP[dtype]
    assert np.all(err <= BOUND[dtype] * scale), float(np.max(err / np.maximum(scale, 1e-300)))
    assert np.all(err_autodiff <= 0.5 * scale)
    np.testing.assert_array_equal(np.asarray(dx)[x <= 0], 0)      # relu's zero gradient

    kept = jax.tree.leaves(pullback)
    assert [(a.dtype, a.shape) for a in kept] == [(jnp.dtype(dtype), x.shape)]
    np.testing.assert_array_equal(np.asarray(kept[0], np.float32), np.asarray(out, np.float32))
