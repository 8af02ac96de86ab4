"""Tests of lwm_jax.ops: the WKV7 op, its recurrent and chunked forms, and the float64 reference.

Tolerances (relative Frobenius error against float64 on fresh RWKV-7-like inputs):
  * fp32 forward and gradients: 2e-6. fp32 rounding is 6e-8 per operation; both fp32 forms
    measure 1e-7 .. 3e-7 here (T <= 200), so 2e-6 leaves ~7x headroom and still catches any
    algebra slip (a wrong decay exponent or mask costs >= 1e-3).
  * bf16 output: at most 1.5x the error of rounding the float64 answer itself to bf16 (~1.1e-3),
    and below 1e-2.
"""
from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from lwm_jax.ops.segments import segment_ids_from_cu_seqlens
from lwm_jax.ops.wkv7 import dispatch as wkv7_op
from lwm_jax.ops.wkv7 import wkv7, wkv7_reference_np
from lwm_jax.ops.wkv7.testing import (LOG_DECAY_LOWER, random_segment_ids, random_wkv7_inputs,
                                 rel_err, wkv7_reference_vjp_f64)

TOL_F32 = 2e-6
B, H, K, V = 2, 2, 16, 16


def _state(seed, b=B, h=H, k=K, v=V):
    return jax.random.normal(jax.random.PRNGKey(seed), (b, h, k, v), jnp.float32)


def test_random_inputs_follow_rwkv7_distribution():
    r, w, k, v, a, b = random_wkv7_inputs(0, 2, 64, 4, 32, 16)
    assert r.shape == w.shape == k.shape == a.shape == b.shape == (2, 64, 4, 32)
    assert v.shape == (2, 64, 4, 16) and r.dtype == jnp.float32
    w = np.asarray(w)
    assert w.max() < 0 and w.min() > LOG_DECAY_LOWER
    np.testing.assert_allclose(np.linalg.norm(np.asarray(a), axis=-1), 1.0, rtol=1e-5)
    icl = np.asarray(b) / -np.asarray(a)  # b = kk * a_icl with a = -kk
    assert icl.min() > 0 and icl.max() < 1
    assert abs(float(np.std(np.asarray(k))) - 0.5) < 0.02
    assert random_wkv7_inputs(0, 1, 4, 1, 8, 8, jnp.bfloat16)[0].dtype == jnp.bfloat16


# (T, chunk_size, with initial_state, with segment_ids); T covers 1, non-multiples and C = 17.
FORWARD_CASES = [(1, 16, False, False), (1, 16, True, False), (17, 16, True, True), (64, 64, True, False),
                 (100, 32, False, True), (200, 64, True, True), (200, 16, False, False),
                 (37, 17, True, True)]


@pytest.mark.parametrize("T,chunk,use_state,use_seg", FORWARD_CASES)
def test_forward_matches_float64_reference(T, chunk, use_state, use_seg):
    xs = random_wkv7_inputs(T, B, T, H, K, V)
    s0 = _state(T) if use_state else None
    seg = jnp.asarray(random_segment_ids(T, B, T)) if use_seg else None
    ref_o, ref_s = wkv7_reference_np(*xs, initial_state=s0, segment_ids=seg)
    for impl in ("chunked", "recurrent"):
        o, s = wkv7(*xs, initial_state=s0, segment_ids=seg, chunk_size=chunk, impl=impl,
                    return_state=True)
        assert o.shape == (B, T, H, V) and o.dtype == jnp.float32 and s.dtype == jnp.float32
        assert rel_err(o, ref_o) <= TOL_F32, impl
        assert rel_err(s, ref_s) <= TOL_F32, impl


def test_strong_and_absent_decay_stay_exact():
    """w far below RWKV-7's range (-6 per step, chunk-wide sum -390) and w = 0 (no decay)."""
    xs = list(random_wkv7_inputs(1, 1, 128, 2, 32, 32))
    for scale in (10.0, 0.0):
        ys = list(xs)
        ys[1] = xs[1] * scale
        ref_o, ref_s = wkv7_reference_np(*ys)
        o, s = wkv7(*ys, chunk_size=64, impl="chunked", return_state=True)
        assert np.isfinite(np.asarray(o)).all()
        assert rel_err(o, ref_o) <= TOL_F32 and rel_err(s, ref_s) <= TOL_F32


def test_packed_documents_equal_separate_calls():
    """Packed rows against each document run alone (float64 reference without segment ids)."""
    T, chunk = 100, 16
    cu = [0, 16, 17, 50, 100]  # resets on a chunk boundary, a 1-token document, mid-chunk resets
    seg = segment_ids_from_cu_seqlens(cu, T)
    xs = random_wkv7_inputs(3, 1, T, H, K, V)
    s0 = _state(3, b=1)
    for impl in ("chunked", "recurrent"):
        o, s = wkv7(*xs, initial_state=s0, segment_ids=seg, chunk_size=chunk, impl=impl,
                    return_state=True)
        for n in range(len(cu) - 1):
            lo, hi = cu[n], cu[n + 1]
            o_n, s_n = wkv7_reference_np(*[x[:, lo:hi] for x in xs],
                                         initial_state=s0 if n == 0 else None)
            assert rel_err(o[:, lo:hi], o_n) <= TOL_F32, (impl, n)
        assert rel_err(s, s_n) <= TOL_F32, impl


def test_split_sequence_carrying_state_equals_one_call():
    T, split = 100, 37
    xs = random_wkv7_inputs(4, B, T, H, K, V)
    seg = random_segment_ids(4, B, T)
    seg[:, split] = seg[:, split - 1]  # no reset exactly at the split (a new call never resets)
    seg[:, split + 1:] = np.maximum(seg[:, split + 1:], seg[:, split:split + 1])
    s0 = _state(4)
    o, s = wkv7(*xs, initial_state=s0, segment_ids=seg, chunk_size=32, return_state=True)
    o1, s1 = wkv7(*[x[:, :split] for x in xs], initial_state=s0, segment_ids=seg[:, :split],
                  chunk_size=32, return_state=True)
    o2, s2 = wkv7(*[x[:, split:] for x in xs], initial_state=s1, segment_ids=seg[:, split:],
                  chunk_size=32, return_state=True)
    assert rel_err(jnp.concatenate([o1, o2], axis=1), o) <= TOL_F32
    assert rel_err(s2, s) <= TOL_F32


def test_float64_gradient_reference_against_finite_differences():
    """Anchors the autodiff reference on the NumPy recurrence: central differences in float64."""
    xs = [np.asarray(x, np.float64) for x in random_wkv7_inputs(5, 1, 8, 1, 4, 4)]
    s0 = np.asarray(_state(5, 1, 1, 4, 4), np.float64)
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1]], np.int32)
    rng = np.random.default_rng(5)
    d_out, d_state = rng.normal(size=(1, 8, 1, 4)), rng.normal(size=(1, 1, 4, 4))
    o, s, grads = wkv7_reference_vjp_f64(xs, s0, seg, d_out, d_state)
    ref_o, ref_s = wkv7_reference_np(*xs, initial_state=s0, segment_ids=seg)
    assert rel_err(o, ref_o) < 1e-13 and rel_err(s, ref_s) < 1e-13
    dirs = [rng.normal(size=x.shape) for x in xs] + [rng.normal(size=s0.shape)]

    def objective(eps):
        moved = [x + eps * d for x, d in zip(xs, dirs)]
        o_e, s_e = wkv7_reference_np(*moved, initial_state=s0 + eps * dirs[-1], segment_ids=seg)
        return np.sum(o_e * d_out) + np.sum(s_e * d_state)

    eps = 1e-5
    numeric = (objective(eps) - objective(-eps)) / (2 * eps)
    names = ["r", "w", "k", "v", "a", "b", "initial_state"]
    analytic = sum(np.sum(grads[n] * d) for n, d in zip(names, dirs))
    assert abs(numeric - analytic) <= 1e-7 * abs(analytic)


@pytest.mark.parametrize("impl,T,chunk,use_state,use_seg", [
    ("chunked", 100, 32, True, True), ("recurrent", 100, 32, True, True),
    ("chunked", 45, 16, False, False)])
def test_gradients_match_float64(impl, T, chunk, use_state, use_seg):
    xs = random_wkv7_inputs(6 + T, B, T, H, K, V)
    s0 = _state(6) if use_state else None
    seg = jnp.asarray(random_segment_ids(6, B, T)) if use_seg else None
    rng = np.random.default_rng(T)
    d_out = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
    d_state = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)

    def loss(xs, s0):
        o, s = wkv7(*xs, initial_state=s0, segment_ids=seg, chunk_size=chunk, impl=impl,
                    return_state=True)
        return jnp.sum(o * d_out) + jnp.sum(s * d_state)

    g_xs, g_s0 = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, s0)
    _, _, ref = wkv7_reference_vjp_f64(xs, s0, seg, d_out, d_state)
    got = dict(zip(["r", "w", "k", "v", "a", "b"], g_xs))
    if use_state:
        got["initial_state"] = g_s0
    assert set(got) == set(ref)
    for name, g in got.items():
        assert rel_err(g, ref[name]) <= TOL_F32, name


@pytest.mark.parametrize("T,budget_chunks", [(96, 2), (112, 2), (96, 4)])
def test_chunk_groups_give_the_same_values_and_gradients(monkeypatch, T, budget_chunks):
    """The chunked form computes its chunk terms over groups of chunks (`lax.map`, each group
    checkpointed) to bound memory; with a tiny budget (groups of 2 of 6 chunks, 1 of 7, 3 of 6)
    outputs, final state and every gradient still equal float64."""
    from lwm_jax.ops.wkv7 import chunked as wkv7_chunked
    chunk = 16
    per_chunk = B * H * chunk * max(16 * K, chunk)
    monkeypatch.setattr(wkv7_chunked, "GROUP_BUDGET", budget_chunks * per_chunk)
    jax.clear_caches()       # the jitted op must be traced again under the patched budget
    xs = random_wkv7_inputs(11 + T, B, T, H, K, V)
    s0, seg = _state(11), jnp.asarray(random_segment_ids(11, B, T))
    rng = np.random.default_rng(T)
    d_out = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
    d_state = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)

    def loss(xs, s0):
        o, s = wkv7(*xs, initial_state=s0, segment_ids=seg, chunk_size=chunk, impl="chunked",
                    return_state=True)
        return jnp.sum(o * d_out) + jnp.sum(s * d_state), (o, s)

    (_, (o, s)), (g_xs, g_s0) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        xs, s0)
    jax.clear_caches()
    ref_o, ref_s = wkv7_reference_np(*xs, initial_state=s0, segment_ids=seg)
    assert rel_err(o, ref_o) <= TOL_F32 and rel_err(s, ref_s) <= TOL_F32
    _, _, ref = wkv7_reference_vjp_f64(xs, s0, seg, d_out, d_state)
    for name, g in zip(["r", "w", "k", "v", "a", "b", "initial_state"], (*g_xs, g_s0)):
        assert rel_err(g, ref[name]) <= TOL_F32, name


def test_bf16_inputs_error_is_output_rounding():
    xs = random_wkv7_inputs(7, 1, 128, 2, 64, 64, jnp.bfloat16)
    ref_o, _ = wkv7_reference_np(*xs)  # float64 on the same (bf16-rounded) inputs
    rounding = rel_err(jnp.asarray(ref_o, jnp.bfloat16), ref_o)
    for impl in ("chunked", "recurrent"):
        o = wkv7(*xs, chunk_size=64, impl=impl)
        assert o.dtype == jnp.bfloat16
        err = rel_err(o, ref_o)
        assert err <= 1.5 * rounding and err <= 1e-2, (impl, err, rounding)
    o32 = wkv7(*xs, chunk_size=64, impl="chunked", output_dtype=jnp.float32)
    assert o32.dtype == jnp.float32 and rel_err(o32, ref_o) <= TOL_F32
    w32 = xs[1].astype(jnp.float32)  # f32 log-decay beside bf16 inputs is allowed
    assert wkv7(xs[0], w32, *xs[2:], chunk_size=64).dtype == jnp.bfloat16


def test_jit_and_return_state_flag():
    xs = random_wkv7_inputs(8, B, 40, H, K, V)
    o = wkv7(*xs, chunk_size=16)
    assert isinstance(o, jax.Array) and o.shape == (B, 40, H, V)
    o_jit, s_jit = jax.jit(lambda *x: wkv7(*x, chunk_size=16, return_state=True))(*xs)
    o_eager, s_eager = wkv7(*xs, chunk_size=16, return_state=True)
    assert rel_err(o_jit, o_eager) <= 1e-7 and rel_err(s_jit, s_eager) <= 1e-7
    assert rel_err(o, o_eager) == 0.0


def test_impl_dispatch(monkeypatch):
    xs = random_wkv7_inputs(9, 1, 20, 1, 8, 8)
    if jax.default_backend() == "cpu":  # auto = chunked on CPU, bit for bit
        assert np.array_equal(wkv7(*xs, chunk_size=8), wkv7(*xs, chunk_size=8, impl="chunked"))
    monkeypatch.setattr(wkv7_op, "_load_pallas", lambda: (None, "ImportError: no kernel"))
    with pytest.raises(RuntimeError, match=r"impl='pallas' needs .*no kernel.*impl='chunked'"):
        wkv7(*xs, impl="pallas")
    calls = []

    def fake_pallas(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype,
                    precision=None, platform=None):
        calls.append((initial_state, segment_ids.dtype, chunk_size, output_dtype, precision,
                      platform))
        return v * 2, jnp.zeros((1, 1, 8, 8))

    monkeypatch.setattr(wkv7_op, "_load_pallas", lambda: (fake_pallas, None))
    o = wkv7(*xs, impl="pallas", chunk_size=32, segment_ids=np.zeros((1, 20), np.int64),
             precision="high", platform="tpu")
    assert np.array_equal(o, xs[3] * 2)
    assert calls == [(None, jnp.int32, 32, jnp.dtype(jnp.float32), "high", "tpu")]
    # "auto" follows the platform it is told the program is compiled for, not the host's
    calls.clear()
    wkv7(*xs, segment_ids=np.zeros((1, 20), np.int32), platform="gpu")
    assert len(calls) == 1 and calls[0][-1] == "gpu"
    with pytest.raises(ValueError, match=r"wkv7: platform must be None or one of"):
        wkv7(*xs, platform="cuda")
    with pytest.raises(ValueError, match=r"wkv7: precision must be None or one of"):
        wkv7(*xs, precision="tf32")


def _bad(i, x):
    """Inputs of a small valid call with argument `i` replaced by `x`."""
    xs = list(random_wkv7_inputs(10, 1, 4, 1, 8, 8))
    xs[i] = x(xs[i])
    return xs


@pytest.mark.parametrize("args,kwargs,exc,msg", [
    (_bad(2, lambda x: x.astype(jnp.bfloat16)), {}, TypeError, r"k has dtype bfloat16 but r"),
    (_bad(1, lambda x: x.astype(jnp.float16)), {}, TypeError, r"w has dtype float16"),
    (_bad(0, lambda x: x.astype(jnp.int32)), {}, TypeError, r"r has dtype int32"),
    (_bad(4, lambda x: x[:, :3]), {}, ValueError, r"a has shape \(1, 3, 1, 8\) but r"),
    (_bad(3, lambda x: x[0]), {}, ValueError, r"v must be 4-D \[B, T, H, V\]"),
    (_bad(3, lambda x: x[:, :2]), {}, ValueError, r"v has shape \(1, 2, 1, 8\)"),
    (_bad(0, lambda x: x), {"impl": "triton"}, ValueError, r"impl must be one of"),
    (_bad(0, lambda x: x), {"chunk_size": 0}, ValueError, r"chunk_size must be None \(the implementation.s default\) or an int >= 1"),
    (_bad(0, lambda x: x), {"initial_state": jnp.zeros((1, 1, 8, 4))}, ValueError,
     r"initial_state must be \[B, H, K, V\] = \(1, 1, 8, 8\)"),
    (_bad(0, lambda x: x), {"segment_ids": jnp.zeros((1, 5), jnp.int32)}, ValueError,
     r"segment_ids must be \[B, T\] = \(1, 4\)"),
    (_bad(0, lambda x: x), {"segment_ids": jnp.zeros((1, 4))}, TypeError,
     r"segment_ids has dtype float32"),
    (_bad(0, lambda x: x), {"output_dtype": jnp.int8}, TypeError, r"output_dtype must be"),
])
def test_validation_errors(args, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        wkv7(*args, **kwargs)


def test_segment_ids_from_cu_seqlens():
    ids = segment_ids_from_cu_seqlens(np.array([0, 2, 3, 6]), 6)
    assert ids.dtype == jnp.int32 and ids.shape == (1, 6)
    assert ids.tolist() == [[0, 0, 1, 2, 2, 2]]
    with pytest.raises(ValueError, match="start at 0 and end at total_len=6"):
        segment_ids_from_cu_seqlens([0, 2, 5], 6)
    with pytest.raises(ValueError, match="strictly increasing"):
        segment_ids_from_cu_seqlens([0, 3, 3, 6], 6)
    with pytest.raises(TypeError, match="integers"):
        segment_ids_from_cu_seqlens([0.0, 6.0], 6)
