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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_float64_and_keep_no_float32_copy(dtype):
    """The hand-written backward against float64 autodiff; the forward keeps x in its own dtype
    and one float32 number per row, no float32 `[..., C]` copy of a 16-bit x."""
    import jax
    rng = np.random.default_rng(2)
    x = np.asarray(jnp.asarray(2 + 3 * rng.standard_normal((3, 9, 64)), dtype), np.float32)
    w = (1 + 0.2 * rng.standard_normal(64)).astype(np.float32)
    dy = np.asarray(jnp.asarray(rng.standard_normal(x.shape), dtype), np.float32)
    out, pullback = jax.vjp(lambda x, w: rms_norm(x, w, eps=1e-5, out_dtype=jnp.float32),
                            jnp.asarray(x, dtype), jnp.asarray(w))
    dx, dw = pullback(jnp.asarray(dy))
    assert dx.dtype == dtype and dw.dtype == jnp.float32
    with jax.enable_x64(True):
        ref_fn = lambda x, w: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w  # noqa
        _, ref_pullback = jax.vjp(ref_fn, np.float64(x), np.float64(w))
        ref_dx, ref_dw = map(np.asarray, ref_pullback(np.float64(dy)))
    rel = lambda a, r: np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r)  # noqa
    assert rel(jnp.asarray(dx, jnp.float32), ref_dx) < (2e-6 if dtype == jnp.float32 else 4e-3)
    assert rel(dw, ref_dw) < 2e-6
    kept = [(str(a.dtype), a.shape) for a in jax.tree.leaves(pullback)]
    if dtype == jnp.bfloat16:   # (a float32 x is itself float32)
        assert not [k for k in kept if k[0] == "float32" and np.prod(k[1]) >= x.size], kept
