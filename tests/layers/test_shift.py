"""`token_shift_mixes`: the forward of one `param_mul` per mix bit for bit, a backward that is
at least as exact against float64, and one reduction for all the mixes' gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.layers.shift import token_shift, token_shift_mixes
from lwm_jax.precision import param_mul

B, T, C, M = 2, 40, 16, 6


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
    prev = jnp.asarray(rng.normal(size=(B, C)), dtype)
    mus = [jnp.asarray(rng.uniform(size=(C,)), jnp.float32) for _ in range(M)]
    gs = tuple(jnp.asarray(rng.normal(size=(B, T, C)), dtype) for _ in range(M))
    seg = jnp.asarray(np.repeat([[0] * 17 + [1] * (T - 17)], B, axis=0))
    return x, prev, mus, gs, seg


def _per_mix(x, prev, mus, seg):
    xx = token_shift(x, prev, seg) - x
    return tuple(x + param_mul(xx, mu) for mu in mus)


def _rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_forward_is_param_mul_per_mix_bit_for_bit(dtype):
    x, prev, mus, _, seg = _inputs(dtype)
    for got, want in zip(token_shift_mixes(x, prev, mus, seg), _per_mix(x, prev, mus, seg)):
        assert got.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gradients_against_float64(dtype):
    """Every gradient (x, the carried token, each mix) against the float64 gradient of the same
    function (mixes rounded to x's dtype, as the forward uses them); never less exact than
    one `param_mul` per mix, and the mixes' sums float32-exact."""
    x, prev, mus, gs, seg = _inputs(dtype, seed=1)
    with jax.enable_x64(True):
        f64 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), t)  # noqa: E731
        used = [mu.astype(dtype) for mu in mus]
        ref = jax.vjp(lambda *a: _per_mix(*a, seg), *f64((x, prev, used)))[1](f64(gs))
        new = jax.vjp(lambda *a: token_shift_mixes(*a, seg), x, prev, mus)[1](gs)
        old = jax.vjp(lambda *a: _per_mix(*a, seg), x, prev, mus)[1](gs)
    rounding = 4e-3 if dtype == jnp.bfloat16 else 1e-6
    for got, was, want in zip(new[:2], old[:2], ref[:2]):        # d x, d prev
        assert _rel(got, want) <= max(_rel(was, want), rounding)
    # d mu: the float64 sums of the same rounded numbers (xx as the forward rounds it)
    xx = np.asarray(token_shift(x, prev, seg) - x, np.float64)
    for got, mu, g in zip(new[2], mus, gs):
        assert got.dtype == mu.dtype
        assert _rel(got, np.sum(np.asarray(g, np.float64) * xx, axis=(0, 1))) < 1e-6


def test_one_reduction_for_all_mixes():
    """The backward sums every mix's gradient in one float32 reduction over (B, T) of the
    stacked products (one kernel on a GPU, instead of one per mix)."""
    x, prev, mus, gs, seg = _inputs(jnp.bfloat16)
    pull = jax.vjp(lambda x, m: token_shift_mixes(x, prev, m, seg), x, mus)[1]
    sums = [e for e in jax.make_jaxpr(pull)(gs).jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert len(sums) == 1 and sums[0].params["axes"] == (1, 2)
    assert sums[0].invars[0].aval.shape == (M, B, T, C)
    assert sums[0].invars[0].aval.dtype == jnp.float32


def test_bad_mix_shape_is_one_line():
    x, prev, mus, _, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="token_shift_mixes: parameter shape"):
        token_shift_mixes(x, prev, [jnp.ones((C + 1,))])
    with pytest.raises(ValueError, match="at least one"):
        token_shift_mixes(x, prev, [])
    with pytest.raises(ValueError, match="different shapes"):
        token_shift_mixes(x, prev, [jnp.ones((C,)), jnp.ones((T, C))])
