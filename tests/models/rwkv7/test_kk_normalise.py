"""TimeMix's `kk = normalise(k * k_k)` island: the hand-written backward against float64
autodiff, and what its forward keeps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7.time_mix import KK_EPS, normalize_heads


def _ref(x, scale):
    u = x * scale
    return u / jnp.sqrt(jnp.maximum(jnp.sum(u * u, -1, keepdims=True), KK_EPS ** 2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_float64(dtype):
    rng = np.random.default_rng(3)
    x = np.array(jnp.asarray(rng.standard_normal((2, 7, 3, 16)), dtype), np.float32)
    x[1, 2, 0] = 0.0                      # one head at the eps clamp: its own gradient rule
    scale = (1 + 0.3 * rng.standard_normal((3, 16))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    out, pullback = jax.vjp(normalize_heads, jnp.asarray(x, dtype), jnp.asarray(scale))
    dx, d_scale = pullback(jnp.asarray(dy))
    assert out.dtype == jnp.float32 and dx.dtype == dtype and d_scale.dtype == jnp.float32
    with jax.enable_x64(True):
        ref_out, ref_pullback = jax.vjp(_ref, np.float64(x), np.float64(scale))
        ref_dx, ref_ds = map(np.asarray, ref_pullback(np.float64(dy)))
    rel = lambda a, r: np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r)  # noqa
    assert rel(out, np.asarray(ref_out)) < 1e-6
    # the clamped head's dx is dy * scale / eps (~1e12): check the other heads on their scale
    live = np.ones(x.shape[:-1], bool)
    live[1, 2, 0] = False
    tol = 1e-6 if dtype == jnp.float32 else 4e-3        # bf16: dx is rounded to x's dtype
    assert rel(jnp.asarray(dx, jnp.float32)[live], ref_dx[live]) < tol
    assert rel(jnp.asarray(dx, jnp.float32)[~live], ref_dx[~live]) < tol
    assert rel(d_scale, ref_ds) < 1e-6


def test_forward_keeps_no_float32_copy_of_16_bit_keys():
    x = jnp.ones((2, 8, 4, 16), jnp.bfloat16)
    _, pullback = jax.vjp(normalize_heads, x, jnp.ones((4, 16)))
    kept = [(str(a.dtype), a.shape) for a in jax.tree.leaves(pullback)]
    assert not [k for k in kept if k[0] == "float32" and np.prod(k[1]) >= x.size], kept
