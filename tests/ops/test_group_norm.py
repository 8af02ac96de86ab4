"""`ln_x`'s GroupNorm backward as one Pallas kernel (`lwm_jax.ops.group_norm`, wired to the
forward by its `group_norm_fused`): the forward is bit for bit `group_norm`, the
gradients match a float64 reference as closely as autodiff of the forward does (interpreted
everywhere, compiled on a GPU), and TimeMix picks it as `Runtime.ln_x_impl` says."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from lwm_jax.ops.group_norm import (group_norm, group_norm_bwd_pallas, group_norm_fused,
                                    kernel_applies, rows_per_program)
from lwm_jax.mesh_axes import MESH_AXES
from lwm_jax.runtime import Runtime


def _ln_x(impl, mesh, x, weight, bias, **kw):
    """`ln_x` as TimeMix calls it: `impl` = `runtime.ln_x_impl`, `mesh` the model's."""
    return group_norm(x, weight, bias, impl=impl, mesh=mesh, **kw)


def _inputs(seed, shape, C, dtype, N=16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*shape, C)) * 3 + rng.standard_normal(C)    # per-channel offsets
    x.reshape(-1, C)[0, :N] = 5.0                                        # a constant group
    dy = rng.standard_normal((*shape, C))
    w, b = rng.standard_normal(C) + 1, rng.standard_normal(C)
    return (jnp.asarray(x, dtype), jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32),
            jnp.asarray(dy, dtype))


def _float64_grads(x, w, b, dy, H, eps):
    """Gradients of `sum(group_norm(x) * dy)` in float64 numpy (x as given, upcast)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    C = x.shape[-1]
    xg = x.reshape(-1, H, C // H)
    dyg = dy.reshape(-1, H, C // H)
    centred = xg - xg.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt((centred ** 2).mean(-1, keepdims=True) + eps)
    xhat = centred * rstd
    g = dyg * w.reshape(H, -1)
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx.reshape(x.shape), (dyg * xhat).sum(0).reshape(C), dyg.sum(0).reshape(C)


def _rel(a, ref):
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_gradients_match_float64(pallas_mode, dtype):
    H, N = 4, 64
    x, w, b, dy = _inputs(0, (2, 40), H * N, dtype, N)
    eps = N * 1e-5
    ref = _float64_grads(x, w, b, dy, H, eps)
    out_dtype = jnp.dtype(dtype)
    y, vjp = jax.vjp(lambda *a: group_norm_fused(*a, H, eps, out_dtype, pallas_mode), x, w, b)
    assert jnp.array_equal(y, group_norm(x, w, b, n_groups=H, eps=eps, out_dtype=out_dtype))
    got = vjp(dy)
    _, xla_vjp = jax.vjp(lambda *a: group_norm(*a, n_groups=H, eps=eps, out_dtype=out_dtype),
                         x, w, b)
    xla = xla_vjp(dy)
    for name, g, a, r in zip(("dx", "dweight", "dbias"), got, xla, ref):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        # as close to float64 as autodiff of the forward (dx is rounded to x's dtype in both)
        bound = 2e-6 if dtype == jnp.float32 or name != "dx" else 4e-3
        assert _rel(g, r) < bound and _rel(a, r) < bound, (name, _rel(g, r), _rel(a, r))


def test_partial_sums_need_every_row_block(pallas_mode):
    """Several row blocks (80 rows at 16 per program): their partial sums are all added."""
    H, N = 2, 16
    x, w, b, dy = _inputs(1, (80,), H * N, jnp.float32)
    eps = N * 1e-5
    dx, dw, db = group_norm_bwd_pallas(x.reshape(80, H, N), dy.reshape(80, H, N),
                                       w.reshape(H, N), eps=eps, interpret=pallas_mode)
    ref = _float64_grads(x, w, b, dy, H, eps)
    assert rows_per_program(80, N) == 16
    for g, r in zip((dx.reshape(x.shape), dw.reshape(-1), db.reshape(-1)), ref):
        assert _rel(g, r) < 2e-6


def test_shapes_the_kernel_takes():
    assert rows_per_program(8192, 64) == 64 and rows_per_program(40, 64) == 8
    assert rows_per_program(8192, 16) == 256 and rows_per_program(8192, 256) == 16
    assert rows_per_program(8192, 2048) == 8           # wide groups: 8 rows, never fewer
    assert rows_per_program(12, 64) is None              # fewer than 8 rows per block
    assert rows_per_program(64, 48) is None              # head size not a power of two
    assert kernel_applies((2, 4096, 2048), 32) and kernel_applies((8, 4096, 768), 12)
    assert not kernel_applies((1, 7, 128), 2)


def test_time_mix_chooses_the_backward_as_runtime_says(jaxpr_eqns):
    x, w, b, dy = _inputs(2, (1, 8), 128, jnp.float32)
    kw = dict(n_groups=2, eps=64e-5, out_dtype=jnp.float32)
    sharded = AbstractMesh((1, 1, 2, 1), MESH_AXES)      # a tensor axis: tokens not split only

    def kernels(impl, mesh=None):
        fn = lambda *a: jax.vjp(lambda *a: _ln_x(impl, mesh, *a, **kw), *a)[1](dy)  # noqa
        return len([e for e in jaxpr_eqns(jax.make_jaxpr(fn)(x, w, b).jaxpr, "pallas_call")
                    if e.params.get("name") == "group_norm_bwd"])
    assert kernels("xla") == 0 and kernels("interpret") == 1
    assert kernels("auto", sharded) == 0                          # a tensor-split model: XLA's
    f = lambda impl: jax.vjp(lambda *a: _ln_x(impl, None, *a, **kw), x, w, b)[1](dy)  # noqa
    for g, a in zip(f("interpret"), f("xla")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(a), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="runtime.ln_x_impl='pallas': .*set runtime.ln_x_impl"):
        _ln_x("pallas", None, x[:, :3], w, b, **kw)               # 3 tokens: no row block
    with pytest.raises(ValueError, match="runs per device only on a mesh that splits"):
        _ln_x("pallas", sharded, x, w, b, **kw)                   # a tensor-split model
    with pytest.raises(ValueError, match="runtime.ln_x_impl: 'triton' is not one of"):
        Runtime(ln_x_impl="triton")
