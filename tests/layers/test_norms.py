"""LayerNorm / GroupNorm: values and gradients against float64 autodiff.

A hand-written backward keeping only x and two float32 numbers per group (not float32 copies
of x) was tried on 2026-11-24: XLA's plan of the 0.1B step on a CPU shrank, but on an H100 the
peak memory was unchanged (30.27 vs 30.26 GiB: the GPU compiler already recomputes those copies
inside its fusions) and the step 1.8 ms slower, so autodiff stays (benchmarks/RESULTS.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.ops.group_norm import group_norm
from lwm_jax.ops.layer_norm import layer_norm


def _ref_f64(x, weight, bias, groups, eps):
    """The norm in float64 NumPy-style jnp (autodiff'd under enable_x64)."""
    xg = x.reshape(*x.shape[:-1], groups, -1)
    mean = xg.mean(-1, keepdims=True)
    var = jnp.square(xg - mean).mean(-1, keepdims=True)
    return ((xg - mean) / jnp.sqrt(var + eps)).reshape(x.shape) * weight + bias


def _call(groups, eps, out_dtype):
    if groups == 1:
        return lambda x, w, b: layer_norm(x, w, b, eps=eps, out_dtype=out_dtype)
    return lambda x, w, b: group_norm(x, w, b, n_groups=groups, eps=eps, out_dtype=out_dtype)


@pytest.mark.parametrize("groups,eps", [(1, 1e-5), (4, 64e-5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_float64(groups, eps, dtype):
    rng = np.random.default_rng(groups)
    shape = (3, 17, 64)
    # an offset mean and an uneven spread: the centred values are what the backward recomputes
    x = (5.0 + rng.standard_normal(shape) * rng.uniform(0.5, 3.0, shape[-1])).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))       # values dtype can hold
    w = (1 + 0.3 * rng.standard_normal(64)).astype(np.float32)
    b = (0.1 * rng.standard_normal(64)).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    dy = np.asarray(jnp.asarray(dy, dtype).astype(jnp.float32))

    fn = _call(groups, eps, jnp.float32)
    out, vjp = jax.vjp(fn, jnp.asarray(x, dtype), jnp.asarray(w), jnp.asarray(b))
    dx, dw, db = vjp(jnp.asarray(dy))
    assert dx.dtype == dtype and dw.dtype == jnp.float32 and db.dtype == jnp.float32
    with jax.enable_x64(True):
        f64 = [np.asarray(a, np.float64) for a in (x, w, b, dy)]
        ref_out, ref_vjp = jax.vjp(lambda *a: _ref_f64(*a, groups, eps), *f64[:3])
        refs = [np.asarray(ref_out), *map(np.asarray, ref_vjp(f64[3]))]
    # bf16 only rounds dx on the way out (2^-9); the rest is float32 arithmetic
    tol = {jnp.float32: 2e-6, jnp.bfloat16: 4e-3}[dtype]
    for name, got, ref in zip(("out", "dx", "dw", "db"), (out, dx, dw, db), refs):
        got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < (2e-6 if name in ("out", "dw", "db") else tol), (name, err)
