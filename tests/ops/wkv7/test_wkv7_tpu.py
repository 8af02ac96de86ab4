"""WKV7 TPU Pallas kernels (`lwm_jax.ops.wkv7.pallas_tpu.op`), run in interpret mode on CPU.

Every numeric test compares against the float64 token-by-token recurrence
(`lwm_jax.ops.wkv7.testing.wkv7_reference_vjp_f64`) on fresh RWKV-7-like random inputs. One test lowers
the kernels for the TPU platform (Mosaic) without running them, to catch constructs the TPU
lowering rejects.
"""
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from lwm_jax.ops.wkv7.pallas_tpu.op import wkv7_tpu
from lwm_jax.ops.wkv7.pallas_tpu import tiles
from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
from lwm_jax.ops.wkv7.reference import wkv7_reference_np

NAMES = ("r", "w", "k", "v", "a", "b")


def _run(xs, h0, seg, C, output_dtype=None, interpret=True):
    """Kernel outputs and the gradients of <o, d_out> + <S_T, d_state> (fixed random cotangents)."""
    fn = lambda xs, h0: wkv7_tpu(*xs, h0, seg, C, output_dtype, interpret=interpret)
    (o, s_T), vjp = jax.vjp(fn, xs, h0)
    rng = np.random.default_rng(7)
    d_out = jnp.asarray(rng.standard_normal(o.shape), o.dtype)
    d_state = jnp.asarray(rng.standard_normal(s_T.shape), jnp.float32)
    d_xs, d_h0 = vjp((d_out, d_state))
    return o, s_T, dict(zip(NAMES, d_xs), initial_state=d_h0), d_out, d_state


def _check_against_f64(xs, h0, seg, C, out_tol, grad_tol, output_dtype=None, interpret=True):
    o, s_T, grads, d_out, d_state = _run(xs, h0, seg, C, output_dtype, interpret)
    ref_o, ref_s, ref_grads = wkv7_reference_vjp_f64(xs, h0, seg, d_out, d_state)
    assert o.dtype == jnp.dtype(output_dtype or xs[3].dtype)
    assert s_T.dtype == jnp.float32 and s_T.shape == ref_s.shape
    errs = {"o": rel_err(o, ref_o), "state": rel_err(s_T, ref_s)}
    assert errs["o"] <= out_tol and errs["state"] <= out_tol, errs
    for name, ref in ref_grads.items():
        got = grads[name]
        primal = h0 if name == "initial_state" else dict(zip(NAMES, xs))[name]
        assert got.dtype == primal.dtype, (name, got.dtype)
        errs[name] = rel_err(got, ref)
        assert errs[name] <= grad_tol, (name, errs)
    return errs


@pytest.mark.parametrize("B,T,K,V,with_h0", [
    (1, 64, 32, 32, False),   # T a multiple of the chunk, zero initial state
    (2, 40, 16, 32, True),    # T not a multiple of the chunk (padded), K != V, initial state
])
def test_fp32_outputs_state_and_grads_match_f64(B, T, K, V, with_h0):
    xs = random_wkv7_inputs(B * 100 + T, B, T, 2, K, V, jnp.float32)
    h0 = (jax.random.normal(jax.random.PRNGKey(T), (B, 2, K, V), jnp.float32)
          if with_h0 else None)
    _check_against_f64(xs, h0, None, 16, out_tol=1e-5, grad_tol=1e-4)


def test_segment_ids_reset_the_state():
    """Resets mid-chunk, at a chunk boundary, on a reused id, and at the last position."""
    B, T, H, K = 2, 40, 2, 16
    xs = random_wkv7_inputs(3, B, T, H, K, K, jnp.float32)
    h0 = jax.random.normal(jax.random.PRNGKey(4), (B, H, K, K), jnp.float32)
    # row 0: resets at 5, 16 (a chunk boundary), 32 (id 0 again) and 39 (a one-token document
    # at the last real position, in the chunk that is padded from 40 to 48)
    row0 = [0] * 5 + [1] * 11 + [2] * 16 + [0] * 7 + [5]
    row1 = [3] * 20 + [4] * 20
    seg = jnp.asarray([row0, row1], jnp.int32)
    # TPU interpret mode: simulated VMEM filled with NaN until written, grid order checked
    _check_against_f64(xs, h0, seg, 16, out_tol=1e-5, grad_tol=1e-4,
                       interpret=pltpu.InterpretParams())


def test_chunk_64_long_sequence():
    """Default chunk length: the (I - A)^{-1} squaring and the decay factoring at C = 64."""
    xs = random_wkv7_inputs(5, 1, 192, 2, 64, 64, jnp.float32)
    _check_against_f64(xs, None, None, 64, out_tol=1e-5, grad_tol=1e-4)


@pytest.mark.parametrize("dtype,T", [(jnp.bfloat16, 48), (jnp.float16, 16)])  # f16: one chunk
def test_half_precision_inputs(dtype, T):
    """bf16/f16 r/k/v/a/b with fp32 w: fp32 inside, so the error vs f64 on the same (rounded)
    inputs stays at fp32 level for an fp32 output and at half rounding for a half output."""
    B, H, K = 1, 2, 32
    r, _, k, v, a, b = random_wkv7_inputs(6, B, T, H, K, K, dtype)
    w = random_wkv7_inputs(6, B, T, H, K, K, jnp.float32)[1]
    xs = (r, w, k, v, a, b)
    # fp32 output: exact inputs, fp32 math; gradients are rounded to half (r/k/v/a/b) on the way out
    _check_against_f64(xs, None, None, 16, out_tol=1e-5, grad_tol=4e-3, output_dtype=jnp.float32)
    o, _ = wkv7_tpu(*xs, None, None, 16, None, interpret=True)
    assert o.dtype == dtype
    assert rel_err(o, wkv7_reference_np(*xs)[0]) <= 4e-3   # bf16 output rounding alone ~1.1e-3


def test_chunk_backward_matches_autodiff_of_chunk_forward():
    """The hand-written per-chunk backward equals JAX autodiff of the per-chunk forward."""
    C, K, V = 16, 8, 12
    r, w, k, v, a, b = (x[0, :, 0] for x in random_wkv7_inputs(8, 1, C, 1, K, V))
    keys = jax.random.split(jax.random.PRNGKey(9), 3)
    ST0 = jax.random.normal(keys[0], (V, K))
    dO, dST = jax.random.normal(keys[1], (C, V)), jax.random.normal(keys[2], (V, K))
    counters = jnp.asarray([0] * 3 + [1] * 9 + [2] * 4, jnp.int32)
    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def both(counters):
        masks = (tiles.chunk_masks(C) if counters is None
                 else tiles.chunk_masks(C, counters[:, None], counters[None, :]))
        fwd = lambda *args: tiles.chunk_forward(*args, masks, hi)
        _, vjp = jax.vjp(fwd, r, w, k, v, a, b, ST0)
        return tiles.chunk_backward(r, w, k, v, a, b, ST0, dO, dST, masks, hi), vjp((dO, dST))

    for seg in (None, counters):
        got, expected = both(seg)
        for g, e in zip(got, expected):
            assert float(jnp.linalg.norm(g - e)) <= 1e-5 * (float(jnp.linalg.norm(e)) + 1e-30)


def test_lowers_to_mosaic_for_tpu():
    """Forward + backward lower for the TPU platform (jax's Mosaic lowering rules, TPU block-shape
    rules) at the production shape K = V = 64, C = 64, bf16 inputs, with segment ids."""
    B, T, H, K = 1, 128, 2, 64
    spec = lambda dt, shape=(B, T, H, K): jax.ShapeDtypeStruct(shape, dt)
    xs = [spec(jnp.bfloat16), spec(jnp.float32)] + [spec(jnp.bfloat16)] * 4

    def loss(xs, h0, seg):
        o, s_T = wkv7_tpu(*xs, h0, seg, 64, jnp.float32)
        return jnp.sum(o ** 2) + jnp.sum(s_T ** 2)

    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=("tpu",))(
        xs, spec(jnp.float32, (B, H, K, K)), spec(jnp.int32, (B, T)))
    assert exported.platforms == ("tpu",)
    assert exported.mlir_module().count("tpu_custom_call") == 2   # forward and backward kernels


@pytest.mark.parametrize("change,error", [
    (dict(k=jnp.zeros((1, 16, 2, 16), jnp.bfloat16)), TypeError),
    (dict(w=jnp.zeros((1, 16, 2, 8), jnp.float32)), ValueError),
    (dict(chunk_size=24), ValueError),
    (dict(segment_ids=jnp.zeros((1, 16), jnp.float32)), TypeError),
    (dict(initial_state=jnp.zeros((1, 2, 16, 8), jnp.float32)), ValueError),
    (dict(precision="tf32"), ValueError),
])
def test_bad_input_raises_one_clear_error(change, error):
    xs = dict(zip(NAMES, random_wkv7_inputs(0, 1, 16, 2, 16, 16)))
    kwargs = dict(initial_state=None, segment_ids=None, chunk_size=16, interpret=True)
    for name in list(change):
        (xs if name in NAMES else kwargs)[name] = change[name]
    with pytest.raises(error):
        wkv7_tpu(*(xs[n] for n in NAMES), **kwargs)
