"""The block LayerNorm as Pallas kernels over transposed activations (`lwm_jax.ops.layer_norm`,
wired by its `layer_norm_fused`): forward and backward against float64 and at least as
close as XLA's `layer_norm` (interpreted everywhere, compiled on a GPU), float32 statistics that
survive a large mean, and the RWKV-7 model choosing the kernels as `Runtime.norm_impl` says."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7.testing import kernel_count, run_impls, tiny_model
from lwm_jax.ops.layer_norm import (LN_EPS, kernel_applies, layer_norm, layer_norm_fused,
                                    layer_norm_fwd_pallas)
from lwm_jax.runtime import Runtime

BF16 = jnp.bfloat16


def _rel(a, ref):
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _float64_layer_norm(x, w, b, dy):
    """(y, dx, dw, db) of LayerNorm over the last axis, in float64."""
    x, w, b, dy = (np.asarray(a, np.float64) for a in (x, w, b, dy))
    mean = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + LN_EPS)
    xhat = (x - mean) * rstd
    g = dy * w
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = lambda a: a.reshape(-1, a.shape[-1])                       # noqa: E731
    return xhat * w + b, dx, rows(dy * xhat).sum(0), rows(dy).sum(0)


def _inputs(shape, dtype, seed, mean=1.0, spread=3.0):
    rng = np.random.default_rng(seed)
    C = shape[-1]
    x = jnp.asarray(mean + spread * rng.standard_normal(shape), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(C), jnp.float32)
    b = jnp.asarray(0.1 * rng.standard_normal(C), jnp.float32)
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    return x, w, b, dy


def _vjp(fn, x, w, b, dy):
    y, pull = jax.vjp(fn, x, w, b)
    return (y, *pull(dy))


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_forward_and_gradients_match_float64(pallas_mode, dtype):
    """(2, 64) tokens x 256 channels: two token blocks, two channel tiles per pass."""
    x, w, b, dy = _inputs((2, 64, 256), dtype, seed=0)
    ref = _float64_layer_norm(x, w, b, dy)
    kern = _vjp(lambda x, w, b: layer_norm_fused(x, w, b, LN_EPS, jnp.dtype(dtype),
                                                 pallas_mode), x, w, b, dy)
    xla = _vjp(lambda x, w, b: layer_norm(x, w, b, out_dtype=dtype), x, w, b, dy)
    assert kern[0].dtype == dtype and kern[1].dtype == dtype
    assert kern[2].dtype == jnp.float32 and kern[3].dtype == jnp.float32
    for name, k, r, a in zip(("y", "dx", "dw", "db"), kern, ref, xla):
        if dtype == jnp.float32:
            assert _rel(k, r) < 1e-6, name
        else:   # the 16-bit outputs' one rounding; the float32 weight sums stay exact
            assert _rel(k, r) <= 1.05 * _rel(a, r) + 1e-7, (name, _rel(k, r), _rel(a, r))


def test_statistics_survive_a_large_mean(pallas_mode):
    """300 + 0.01 noise (the case `ops.layer_norm` names): float32 statistics merged tile by tile
    still normalise it to float32 accuracy."""
    x, w, b, dy = _inputs((1, 64, 512), jnp.float32, seed=1, mean=300.0, spread=0.01)
    y, mean, rstd = layer_norm_fwd_pallas(x.reshape(-1, 512).T, w, b, eps=LN_EPS,
                                          interpret=pallas_mode)
    ref_y = _float64_layer_norm(x, w, b, dy)[0].reshape(-1, 512).T
    x64 = np.asarray(x, np.float64).reshape(-1, 512)
    assert _rel(mean, x64.mean(-1)) < 1e-7
    assert _rel(rstd, 1 / np.sqrt(x64.var(-1) + LN_EPS)) < 1e-3
    assert _rel(y, ref_y) < 2e-3


def test_shapes_the_kernels_take():
    assert kernel_applies(8192, 2048) and kernel_applies(32768, 768)
    assert not kernel_applies(100, 2048)               # tokens not a multiple of 64
    assert not kernel_applies(8192, 96)                # channels not a multiple of 128
    with pytest.raises(ValueError, match="do not tile"):
        layer_norm_fwd_pallas(jnp.zeros((256, 100)), jnp.ones(256), jnp.zeros(256), eps=LN_EPS,
                              interpret=True)


def _tiny_model(norm_impl, **runtime):
    return tiny_model(128, 32, norm_impl=norm_impl, ffn_impl="xla", **runtime)


def test_model_runs_the_kernels_as_runtime_says(jaxpr_eqns):
    """`norm_impl="interpret"` puts both kernels on ln1 and ln2 of every layer and gives the
    XLA form's loss and LayerNorm gradients to bf16 noise (also under remat and a layer scan);
    `auto` on a CPU, or below `AUTO_MIN_CHANNELS`, keeps XLA's; a shape the kernels cannot
    tile, or a bad value, is a one-line error naming the knob."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (1, 64)), jnp.int32)
    runs = run_impls({"interpret": _tiny_model("interpret"), "xla": _tiny_model("xla"),
                      "interpret, remat + scan": _tiny_model("interpret", remat=True,
                                                             scan_layers=True)},
                     tokens, "layer_norm_", jaxpr_eqns)
    assert runs["interpret"][2] == 2 * 2 * 2 and runs["xla"][2] == 0   # fwd+bwd x ln1, ln2 x 2
    losses = {impl: r[0] for impl, r in runs.items()}
    grads = {impl: r[1] for impl, r in runs.items()}
    assert abs(float(losses["interpret"] - losses["xla"])) < 1e-2 * abs(float(losses["xla"]))
    blocks = lambda g: g["blocks"]                                          # noqa: E731
    for ln in ("ln1", "ln2"):
        for name in ("weight", "bias"):
            a = blocks(grads["interpret"])[ln][name][...]
            b = blocks(grads["xla"])[ln][name][...]
            assert _rel(a, np.asarray(b, np.float64)) < 3e-2, (ln, name)
    loss = runs["interpret, remat + scan"][0]
    assert abs(float(loss - losses["interpret"])) < 1e-3 * abs(float(losses["xla"]))
    # C = 128: narrower than AUTO_MIN_CHANNELS (and, in CI, a CPU)
    assert kernel_count(_tiny_model("auto"), tokens, "layer_norm_", jaxpr_eqns) == 0
    with pytest.raises(ValueError, match="norm_impl='interpret': .*set runtime.norm_impl=xla"):
        _tiny_model("interpret")(tokens[:, :40])            # 40 tokens: no token block
    with pytest.raises(ValueError, match="runtime.norm_impl: 'cudnn' is not one of"):
        Runtime(norm_impl="cudnn")
