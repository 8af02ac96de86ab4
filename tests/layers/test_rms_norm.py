"""RMSNorm: float32 statistics and weight whatever the input dtype, one cast at the end."""
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.layers.rms_norm import RMSNorm, rms_norm


def _reference(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(w, np.float64)


def test_float32_matches_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * 7
    w = rng.standard_normal(64).astype(np.float32)
    out = rms_norm(jnp.asarray(x), jnp.asarray(w), eps=1e-6)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _reference(x, w, 1e-6), rtol=2e-6, atol=1e-6)


def test_bf16_input_is_normalised_in_float32_and_cast_once():
    """300 + small noise: bf16 statistics would be off by far more than one output rounding."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(300 + rng.standard_normal((4, 2048)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(2048), jnp.bfloat16)
    out = rms_norm(x, w, eps=1e-5)
    assert out.dtype == jnp.bfloat16
    ref = _reference(np.asarray(x, np.float32), np.asarray(w, np.float32), 1e-5)
    # the float32 result rounded once to bf16: within half a bf16 ulp (2^-8 relative)
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - ref),
                                 2.0**-8 * np.abs(ref) + 1e-6)
    out32 = rms_norm(x, w, eps=1e-5, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(out32), ref, rtol=1e-5)


def test_module_holds_stacked_weights():
    norm = RMSNorm(8, stack=(3,))
    assert norm.weight.shape == (3, 8)
    assert norm.weight.get_metadata()["logical_axes"] == ("layers", "embed")
    with pytest.raises(ValueError, match="stacked weights"):
        norm(jnp.ones((2, 8)))
    np.testing.assert_allclose(np.asarray(RMSNorm(8)(jnp.full((1, 8), 3.0))), 1.0, rtol=1e-6)
