"""FP8 GEMMs with delayed scaling (`lwm_jax.precision.fp8`) and the `fp8-mixed` policy.

XLA:CPU emulates the float8 types, so these tests see the same roundings a Hopper GPU's FP8
GEMM makes (its accumulation order aside). Every accuracy check compares against a float64
product of the same inputs, fresh random draws, and bounds the error from both sides: an
FP8 GEMM is far less exact than a bf16 one, so a GEMM that silently ran in bf16 fails too.
"""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.precision import fp8, parse_policy

E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)    # 448
E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)      # 57344


def _draw(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _run(x, w, meta, g, impl="xla"):
    """(y, dx, dw, returned meta) of `fp8_einsum("btc,cd->btd")` with output cotangent g."""
    f = lambda x, w, m: fp8.fp8_einsum("btc,cd->btd", x, w, m, out_dtype=jnp.float32,  # noqa
                                       impl=impl)
    y, vjp = jax.vjp(f, x, w, meta)
    dx, dw, new_meta = vjp(g)
    return y, dx, dw, new_meta


@pytest.mark.parametrize("impl", ["xla", "xla-dq", "flax"])
def test_forward_and_gradients_round_like_fp8(impl):
    """Output error at e4m3's level (3 mantissa bits) and gradient errors at e5m2's (2 bits),
    each above what a bf16 GEMM would show (8 bits); every form of the GEMM."""
    x, w = _draw(0, (4, 32, 256)), _draw(1, (256, 128), 0.05)
    g = _draw(2, (4, 32, 128))
    meta = fp8.init_meta(16)
    # two steps, so the second quantizes with scales from the first's recorded maxima
    _, _, _, meta = _run(x, w, meta, g, impl)
    y, dx, dw, _ = _run(x, w, meta, g, impl)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    err_y = _rel(y, np.einsum("btc,cd->btd", x64, w64))
    err_dx = _rel(dx, np.einsum("btd,cd->btc", g64, w64))
    err_dw = _rel(dw, np.einsum("btc,btd->cd", x64, g64))
    assert 5e-3 < err_y < 5e-2, err_y
    assert 1e-2 < err_dx < 1.2e-1, err_dx
    assert 1e-2 < err_dw < 1.2e-1, err_dw
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


def test_the_two_xla_forms_agree():
    """Dots of float8 operands scaled after (`xla`) and dots of dequantized operands
    (`xla-dq`) are the same products: power-of-two scales make both scalings exact, so the
    results differ at most by float32 summation order. On a GPU the float8 dots run on the FP8
    tensor cores, whose accumulation keeps fewer bits than a float32 dot (an H200 measured
    differences of ~1e-4 relative in most elements): there the two agree in norm to 2^-9, while
    a wrong scale would be off by a factor of two."""
    x, w, g = _draw(23, (2, 16, 128)), _draw(24, (128, 64), 0.1), _draw(25, (2, 16, 64), 1e-2)
    meta = _run(x, w, fp8.init_meta(4), g)[3]
    a, b = _run(x, w, meta, g, "xla"), _run(x, w, meta, g, "xla-dq")
    for u, v in zip(a, b):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        if jax.default_backend() == "gpu":
            assert np.linalg.norm(u - v) <= 2.0**-9 * np.linalg.norm(v)
        else:
            np.testing.assert_allclose(u, v, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="impl must be"):
        fp8.fp8_einsum("btc,cd->btd", x, w, meta, impl="int8")


def test_gradients_come_back_in_each_operands_dtype():
    """bf16 activations get a bf16 gradient, a float32 weight a float32 one (not rounded
    through bf16: it is the float32 dequantized product)."""
    x, w, g = _draw(20, (2, 8, 64)).astype(jnp.bfloat16), _draw(21, (64, 32)), _draw(22, (2, 8, 32))
    _, dx, dw, _ = _run(x, w, fp8.init_meta(4), g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert not np.array_equal(np.asarray(dw), np.asarray(dw.astype(jnp.bfloat16), np.float32))


def test_delayed_scaling_records_then_uses_each_maximum():
    """Step 1 quantizes at scale 1 and records max|x|, max|w|, max|g| as the newest amax; step 2
    quantizes with scale = the power of two at or above amax / format max (e4m3 forward, e5m2
    gradient), from the history before its own maximum; the history rotates by one each step."""
    x, w, g = _draw(3, (2, 8, 64), 3.0), _draw(4, (64, 32), 0.2), _draw(5, (2, 8, 32), 1e-3)
    meta = fp8.init_meta(4)
    _, _, _, m1 = _run(x, w, meta, g)
    # x is quantized from the compute dtype (bf16), the float32 weight from float32; the
    # output gradient arrives as the float32 accumulator's cotangent
    amax = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.bfloat16).astype(jnp.float32))))  # noqa
    amax_w, amax_g = float(jnp.max(jnp.abs(w))), float(jnp.max(jnp.abs(g)))
    np.testing.assert_allclose(np.asarray(m1[:, 0]), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(np.asarray(fp8.current_amax(m1)), [amax(x), amax_w, amax_g],
                               rtol=1e-6)
    x2 = 2.0 * x
    _, _, _, m2 = _run(x2, w, m1, g)
    pow2 = lambda r: 2.0 ** np.ceil(np.log2(r))  # noqa: E731
    np.testing.assert_array_equal(
        np.asarray(m2[:, 0]),
        [pow2(amax(x) / E4M3_MAX), pow2(amax_w / E4M3_MAX), pow2(amax_g / E5M2_MAX)])
    np.testing.assert_allclose(np.asarray(m2[:, 1]), [amax(x2), amax_w, amax_g], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m2[:, -1]), np.asarray(m1[:, 1]))   # rotated
    np.testing.assert_array_equal(np.asarray(m2[:, 2:-1]), 0.0)


def test_scaling_keeps_small_gradients():
    """Output gradients of size 1e-6 survive: at scale 1 most would flush to zero in e5m2
    (its smallest subnormal is ~1.5e-5), with the delayed scale they round at e5m2's level."""
    x, w, g = _draw(6, (2, 16, 64)), _draw(7, (64, 32), 0.1), _draw(8, (2, 16, 32), 1e-6)
    _, dx_first, _, m1 = _run(x, w, fp8.init_meta(8), g)
    _, dx, _, _ = _run(x, w, m1, g)
    ref = np.einsum("btd,cd->btc", np.asarray(g, np.float64), np.asarray(w, np.float64))
    assert _rel(dx_first, ref) > 0.5          # unscaled: the gradient is mostly lost
    assert _rel(dx, ref) < 1.2e-1


def test_the_gemms_take_float8_operands():
    """In the differentiated program all three products (forward, both gradients) are
    dot_generals of float8 operands: e4m3 x e4m3 forward, e5m2 with e4m3 backward."""
    x, w, g = _draw(9, (2, 8, 64)), _draw(10, (64, 32)), _draw(11, (2, 8, 32))
    jaxpr = jax.make_jaxpr(lambda x, w, m: _run(x, w, m, g))(x, w, fp8.init_meta(4))
    dots = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(tuple(sorted(str(v.aval.dtype) for v in eqn.invars)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(jaxpr.jaxpr)
    assert sorted(dots) == [("float8_e4m3fn", "float8_e4m3fn"),
                            ("float8_e4m3fn", "float8_e5m2"),
                            ("float8_e4m3fn", "float8_e5m2")], dots


def test_overwrite_and_micro_batch_combination():
    """A skipped step keeps the old metas; two micro-batches' metas combine to their maximum,
    which is what one micro-batch holding both would have recorded."""
    old = fp8.init_meta(4)
    x, w, g = _draw(12, (2, 8, 64)), _draw(13, (64, 32)), _draw(14, (2, 8, 32))
    _, _, _, a = _run(x[:1], w, old, g[:1])
    _, _, _, b = _run(x[1:], w, old, g[1:])
    _, _, _, both = _run(x, w, old, g)
    np.testing.assert_array_equal(np.asarray(fp8.combine_accumulated(a, b)), np.asarray(both))
    kept = fp8.overwrite({"s": old}, {"s": both}, jnp.asarray(False))
    np.testing.assert_array_equal(np.asarray(kept["s"]), np.asarray(old))
    new = fp8.overwrite({"s": old}, {"s": both}, jnp.asarray(True))
    np.testing.assert_array_equal(np.asarray(new["s"]), np.asarray(both))


def test_meta_shape_is_checked():
    with pytest.raises(ValueError, match=r"fp8_einsum: meta: expected a float32 \[3, 1 \+ history\]"):
        fp8.fp8_einsum("tc,cd->td", jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="amax history must be >= 1"):
        fp8.init_meta(0)


def test_policy_fp8_mixed():
    """The preset and the string form; g=fp8 only with a bf16 compute dtype and no loss scale;
    `Policy.einsum` runs FP8 only under an FP8 policy and only where given a meta."""
    p = parse_policy("fp8-mixed")
    assert p.fp8 and p.gemm == "fp8" and p.compute_dtype == jnp.bfloat16
    assert parse_policy("p=f32,c=bf16,g=fp8").fp8
    assert not parse_policy("bf16-mixed").fp8
    for bad in ("p=f32,c=f16,g=fp8", "p=f32,c=f32,g=fp8", "p=f32,c=bf16,g=int8"):
        with pytest.raises(ValueError, match="precision policy"):
            parse_policy(bad)
    x, w, meta = _draw(15, (2, 8, 64)), _draw(16, (64, 32)), fp8.init_meta(4)
    bf16 = parse_policy("bf16-mixed")
    plain = bf16.einsum("btc,cd->btd", x, w, out_dtype=jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(bf16.einsum("btc,cd->btd", x, w, out_dtype=jnp.float32, fp8_meta=meta)),
        np.asarray(plain))
    np.testing.assert_array_equal(
        np.asarray(p.einsum("btc,cd->btd", x, w, out_dtype=jnp.float32)), np.asarray(plain))
    quantized = p.einsum("btc,cd->btd", x, w, out_dtype=jnp.float32, fp8_meta=meta)
    assert 5e-3 < _rel(quantized, plain) < 5e-2


def test_finiteness_and_the_largest_amax_are_reported():
    """`all_finite` sees an inf anywhere in the metas; `largest_amax` names the site, layer
    and row of the largest newest amax."""
    metas = {"att": {"fp8_key": fp8.init_meta(4, stack=(2,))},
             "ffn": {"fp8_value": fp8.init_meta(4, stack=(2,))}}
    assert bool(fp8.all_finite(metas))
    metas["ffn"]["fp8_value"] = metas["ffn"]["fp8_value"].at[1, 2, 1].set(7.5)
    metas["att"]["fp8_key"] = metas["att"]["fp8_key"].at[0, 0, 1].set(3.0)
    assert fp8.largest_amax(jax.device_get(metas)) == \
        "largest FP8 amax 7.5: ffn/fp8_value layer 1 output_grad"
    metas["att"]["fp8_key"] = metas["att"]["fp8_key"].at[1, 1, 3].set(jnp.inf)
    assert not bool(fp8.all_finite(metas))
