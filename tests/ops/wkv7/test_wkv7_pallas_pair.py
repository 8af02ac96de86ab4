"""Sequence parallelism's two per-device passes in one custom_vjp (`pallas_gpu/pair.py`), in the
Pallas interpreter: the same values and gradients as the two separate kernel calls, from one
intra-chunk launch instead of two."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.ops.wkv7.pallas_gpu.op import wkv7_gpu
from lwm_jax.ops.wkv7.pallas_gpu.pair import wkv7_gpu_pair
from lwm_jax.ops.wkv7.testing import random_wkv7_inputs

B, T, H, K = 2, 24, 2, 16          # T = 24: padded to two whole chunks of 16
KW = dict(chunk_size=16, interpret=True, precision="highest", output_dtype=jnp.float32)


def _setup(V, with_segments):
    xs = random_wkv7_inputs(3, B, T, H, K, V)
    s0 = jax.random.normal(jax.random.key(1), (B, H, K, V))
    eye = jnp.broadcast_to(jnp.eye(K), (B, H, K, K))
    seg = None
    if with_segments:   # row 0 one document (its M_end is not zero); row 1 resets on a chunk
        seg = np.zeros((B, T), np.int32)     # edge (16) and inside a chunk (20)
        seg[1, 16:], seg[1, 20:] = 1, 2
        seg = jnp.asarray(seg)
    else:   # row 1's slice starts a new document: its identity pass starts from zeros
        eye = eye * jnp.array([1.0, 0.0])[:, None, None, None]
    rng = np.random.default_rng(0)
    cts = [jnp.asarray(rng.normal(size=s), jnp.float32)
           for s in ((B, T, H, V), (B, H, K, V), (B, T, H, K), (B, H, K, K))]
    return xs, s0, eye, seg, cts


def _pair(xs, s0, eye, seg):
    return wkv7_gpu_pair(*xs, s0, eye, seg, **KW)


def _two_calls(xs, s0, eye, seg):
    r, w, k, v, a, b = xs
    o, s = wkv7_gpu(*xs, s0, seg, **KW)
    q, m = wkv7_gpu(r, w, k, jnp.zeros((B, T, H, K), v.dtype), a, b, eye, seg, **KW)
    return o, s, q, m


def _grads(op, xs, s0, eye, seg, cts):
    def loss(xs, s0, eye):
        outs = op(xs, s0, eye, seg)
        return sum(jnp.sum(x * c) for x, c in zip(outs, cts)), outs
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(xs, s0, eye)


@pytest.mark.parametrize("V,with_segments", [(16, True), (32, False)])
def test_pair_equals_the_two_kernel_calls(V, with_segments):
    xs, s0, eye, seg, cts = _setup(V, with_segments)
    (_, outs), (g_xs, g_s0, g_eye) = _grads(_pair, xs, s0, eye, seg, cts)
    (_, ref_outs), (r_xs, r_s0, r_eye) = _grads(_two_calls, xs, s0, eye, seg, cts)
    names = ("o", "final_state", "q", "M_end", "dr", "dw", "dk", "dv", "da", "db",
             "d_initial_state", "d_identity_state")
    for name, x, y in zip(names, (*outs, *g_xs, g_s0, g_eye), (*ref_outs, *r_xs, r_s0, r_eye)):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert float(jnp.max(jnp.abs(y))) > 0, name        # nothing compared on zeros only
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6,
                                   err_msg=name)


def _launches(fn, *args):
    text = str(jax.make_jaxpr(fn)(*args))
    return {name: text.count(f"name={name}") for name in
            ("wkv7_intra_fwd", "wkv7_seq_fwd", "wkv7_seq_bwd", "wkv7_intra_bwd")}


def test_pair_runs_one_intra_chunk_launch_per_forward():
    xs, s0, eye, seg, cts = _setup(16, False)
    fwd = lambda xs, s0, eye: _pair(xs, s0, eye, seg)                   # noqa: E731
    fwd2 = lambda xs, s0, eye: _two_calls(xs, s0, eye, seg)             # noqa: E731
    assert _launches(fwd, xs, s0, eye)["wkv7_intra_fwd"] == 1
    assert _launches(fwd2, xs, s0, eye)["wkv7_intra_fwd"] == 2
    step = lambda xs, s0, eye: _grads(_pair, xs, s0, eye, seg, cts)      # noqa: E731
    assert _launches(step, xs, s0, eye) == {"wkv7_intra_fwd": 1, "wkv7_seq_fwd": 2,
                                            "wkv7_seq_bwd": 2, "wkv7_intra_bwd": 2}


def test_pair_errors_are_one_line():
    xs, s0, eye, seg, _ = _setup(16, False)
    with pytest.raises(ValueError, match="identity_state shape"):
        wkv7_gpu_pair(*xs, s0, eye[:, :1], seg, **KW)
    r, w, k, v, a, b = random_wkv7_inputs(0, B, T, H, K, 128)
    with pytest.raises(ValueError, match="V = 128 exceeds 64"):
        wkv7_gpu_pair(r, w, k, v, a, b, None, eye, None, **KW)


def test_pair_saves_the_chunk_factors_once():
    """What the pair keeps for its backward: the inputs, M, Q and the triangular inverse once,
    and each pass's chunk-start states; two kernel calls keep M, Q and the inverse twice."""
    from lwm_jax.ops.wkv7.pallas_gpu import op, pair
    V = 32
    xs, s0, eye, seg, _ = _setup(V, True)
    padded, s0p, n, cfg = op.prepare(*xs, s0, seg, KW["chunk_size"], KW["output_dtype"],
                                     KW["precision"], True, None)
    cfg_q = cfg._replace(out_dtype=jnp.dtype(jnp.float32))
    _, res = pair._pair_fwd(*padded, s0p, eye, n, cfg, cfg_q)
    derived = res[7:]                                # after r, w, k, v, a, b, n
    BH, NT, C = B * H, padded[0].shape[1] // cfg.C, cfg.C
    assert [tuple(x.shape) for x in derived] == [
        (BH, NT, K, K), (BH, NT, C, K), (BH, NT, C, C),     # M, Q, inverse: once
        (BH, NT, K, V), (BH, NT, K, K)]                      # start states of each pass
    _, res_one = op._core_fwd(*padded, s0p, n, cfg)
    assert [tuple(x.shape) for x in res_one[7:]] == [
        (BH, NT, K, K), (BH, NT, C, K), (BH, NT, C, C), (BH, NT, K, V)]
