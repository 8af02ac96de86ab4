"""ChannelMix's squared-ReLU GEMMs with the activation in the epilogue
(`lwm_jax.ops.squared_relu_mlp`, wired by its `squared_relu_mlp_fused`): each kernel against
float64 and at least as close as XLA's two-pass form (interpreted everywhere, compiled on a
GPU), the wired MLP's output and gradients likewise, and the RWKV-7 model choosing it as
`Runtime.ffn_impl` says."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7.testing import kernel_count, run_impls, tiny_model
from lwm_jax.ops.squared_relu_mlp import (kernel_applies, relu2_matmul_grad_pallas,
                                          relu2_matmul_pallas, squared_relu,
                                          squared_relu_mlp_fused)
from lwm_jax.precision import parse_policy
from lwm_jax.runtime import Runtime

M, C, F = 256, 128, 512           # two row tiles, two K steps, two column tiles
BF16 = jnp.bfloat16


def _rel(a, ref):
    a = np.asarray(a, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, C))
    key = rng.standard_normal((C, F)) / np.sqrt(C)
    value = rng.standard_normal((F, C)) / np.sqrt(F)
    ct = rng.standard_normal((M, C))
    return (jnp.asarray(x, BF16), jnp.asarray(key, jnp.float32), jnp.asarray(value, jnp.float32),
            jnp.asarray(ct, jnp.float32))


def _f64(*arrays):
    return [np.asarray(a, np.float64) for a in arrays]


def test_kernels_match_float64(pallas_mode):
    x, key, value, ct = _inputs(0)
    x64, k64 = _f64(x, key.astype(BF16))
    h = relu2_matmul_pallas(x.T, key.astype(BF16), interpret=pallas_mode)
    assert h.dtype == BF16 and h.shape == (M, F)
    ref = np.square(np.maximum(x64 @ k64, 0))
    xla = jnp.square(jax.nn.relu(jnp.einsum("mc,cf->mf", x, key.astype(BF16),
                                            preferred_element_type=jnp.float32).astype(BF16)))
    assert _rel(h, ref) < 2.5e-3                 # one bf16 rounding of the float32 result
    assert _rel(h, ref) <= _rel(xla, ref)        # XLA's form rounds twice

    dy, v_c = ct.astype(BF16), value.astype(BF16)
    d_pre = relu2_matmul_grad_pallas(dy.T, v_c, h, interpret=pallas_mode)
    dy64, v64, h64 = _f64(dy, v_c, h)
    ref = (dy64 @ v64.T) * 2 * np.sqrt(h64)
    assert d_pre.dtype == BF16 and _rel(d_pre, ref) < 2.5e-3


def test_fused_mlp_output_and_gradients_match_float64(pallas_mode):
    """`squared_relu_mlp_fused` against float64, and at least as close as the XLA form that
    ChannelMix runs otherwise (`Policy.einsum` + `squared_relu`), for the output and the
    gradients of the input (bf16) and both weights (float32, returned in float32)."""
    x, key, value, ct = _inputs(1)
    policy = parse_policy("bf16-mixed")

    def fused(x, key, value):
        return squared_relu_mlp_fused(x, key, value, jnp.dtype(BF16), policy.lax_precision,
                                      pallas_mode).astype(BF16)

    def xla(x, key, value):
        return policy.einsum("mf,fc->mc", squared_relu(policy.einsum("mc,cf->mf", x, key)),
                             value)

    x64, k64, v64, ct64 = _f64(x, key, value, ct)
    pre = x64 @ k64
    d_pre = (ct64 @ v64.T) * 2 * np.maximum(pre, 0)
    refs = (np.square(np.maximum(pre, 0)) @ v64, d_pre @ k64.T, x64.T @ d_pre,
            np.square(np.maximum(pre, 0)).T @ ct64)
    results = {}
    for name, f in (("fused", fused), ("xla", xla)):
        out, vjp = jax.vjp(f, x, key, value)
        results[name] = (out, *vjp(ct.astype(out.dtype)))
    for i, what in enumerate(("out", "dx", "dkey", "dvalue")):
        got, other = results["fused"][i], results["xla"][i]
        assert got.dtype == other.dtype, what
        assert _rel(got, refs[i]) < 6e-3, what
        assert _rel(got, refs[i]) <= _rel(other, refs[i]), what


def test_shapes_the_kernels_take():
    assert kernel_applies(8192, 2048, 8192) and kernel_applies(32768, 768, 3072)
    assert not kernel_applies(100, 2048, 8192)           # tokens not a multiple of 128
    assert not kernel_applies(8192, 96, 8192)            # channels not a multiple of 64
    assert not kernel_applies(8192, 2048, 200)           # hidden not a multiple of 256
    x = jnp.zeros((C, 100), BF16)
    with pytest.raises(ValueError, match="does not tile"):
        relu2_matmul_pallas(x, jnp.zeros((C, F), BF16), interpret=True)


def _tiny_model(ffn_impl, **runtime):
    return tiny_model(64, 16, ffn_impl=ffn_impl, **runtime)                 # F = 256


def test_model_runs_the_kernels_as_runtime_says(jaxpr_eqns):
    """One sequence of 128 tokens (one row tile): `ffn_impl="interpret"` puts both kernels in
    every layer and gives the XLA form's loss and gradients to bf16 noise, also under remat and
    a layer scan; `auto` on a CPU keeps the XLA form; a shape the kernels cannot tile is a
    one-line error."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (1, 128)), jnp.int32)
    runs = run_impls({"interpret": _tiny_model("interpret"), "xla": _tiny_model("xla"),
                      "interpret, remat + scan": _tiny_model("interpret", remat=True,
                                                             scan_layers=True)},
                     tokens, "relu2_matmul", jaxpr_eqns)
    assert runs["interpret"][2] == 2 * 2 and runs["xla"][2] == 0       # fwd + bwd, 2 layers
    losses = {impl: r[0] for impl, r in runs.items()}
    grads = {impl: r[1] for impl, r in runs.items()}
    assert abs(float(losses["interpret"] - losses["xla"])) < 1e-2 * abs(float(losses["xla"]))
    ffn = lambda g: g["blocks"]["ffn"]                                        # noqa: E731
    for name in ("key", "value", "x_k"):
        a, b = ffn(grads["interpret"])[name][...], ffn(grads["xla"])[name][...]
        assert _rel(a, np.asarray(b, np.float64)) < 3e-2, name
    # inside jax.checkpoint + lax.scan (the long-context runtime) it gives the same again
    loss, g = runs["interpret, remat + scan"][:2]
    assert abs(float(loss - losses["interpret"])) < 1e-3 * abs(float(losses["xla"]))
    a, b = ffn(g)["key"][...], ffn(grads["xla"])["key"][...]
    assert _rel(a, np.asarray(b, np.float64)) < 3e-2
    if jax.default_backend() == "cpu":
        assert kernel_count(_tiny_model("auto"), tokens, "relu2_matmul", jaxpr_eqns) == 0
    with pytest.raises(ValueError, match="ffn_impl='interpret': .*set runtime.ffn_impl=xla"):
        _tiny_model("interpret")(tokens[:, :100])            # 100 tokens: no row tile
    with pytest.raises(ValueError, match="runtime.ffn_impl: 'triton' is not one of"):
        Runtime(ffn_impl="triton")
