"""Every WKV7 path at the edge of its exponent range: every log-decay at RWKV-7's bound
(w = -exp(-0.5), the strongest decay the model can produce) and the path's longest chunk,
outputs, final state and gradients against the float64 recurrence; and the kernels refuse a
chunk beyond their range in one line. The strategies are listed in `contract.py`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.ops.wkv7.chunked import wkv7_chunked
from lwm_jax.ops.wkv7.contract import GPU_MAX_CHUNK, TPU_MAX_CHUNK, W_MIN
from lwm_jax.ops.wkv7.pallas_gpu.op import wkv7_gpu
from lwm_jax.ops.wkv7.pallas_tpu.op import wkv7_tpu
from lwm_jax.ops.wkv7.testing import rel_err, wkv7_reference_vjp_f64

NAMES = ("r", "w", "k", "v", "a", "b")
PATHS = {  # name: (op(r, w, k, v, a, b, s0) -> (o, sT), longest chunk)
    "chunked": (lambda *x, C: wkv7_chunked(*x, None, C, jnp.float32, "highest"), 256),
    "pallas_gpu": (lambda *x, C: wkv7_gpu(*x, None, C, jnp.float32, precision="highest",
                                          interpret=True), GPU_MAX_CHUNK),
    "pallas_tpu": (lambda *x, C: wkv7_tpu(*x, None, C, jnp.float32, interpret=True),
                   TPU_MAX_CHUNK),
}


def _inputs_at_the_decay_bound(T, K, seed=0):
    rng = np.random.default_rng(seed)
    shape = (1, T, 1, K)
    kk = rng.standard_normal(shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    xs = {"r": rng.standard_normal(shape), "w": np.full(shape, W_MIN),
          "k": 0.5 * rng.standard_normal(shape), "v": rng.standard_normal(shape),
          "a": -kk, "b": kk / (1 + np.exp(-rng.standard_normal(shape)))}
    s0 = 0.5 * rng.standard_normal((1, 1, K, K))
    return tuple(jnp.asarray(xs[n], jnp.float32) for n in NAMES), jnp.asarray(s0, jnp.float32)


@pytest.mark.parametrize("path", list(PATHS))
def test_longest_chunk_at_the_strongest_decay_matches_float64(path):
    op, C = PATHS[path]
    T, K = 2 * C, 16
    xs, s0 = _inputs_at_the_decay_bound(T, K)
    do = jax.random.normal(jax.random.PRNGKey(1), (1, T, 1, K), jnp.float32)
    dsT = jax.random.normal(jax.random.PRNGKey(2), (1, 1, K, K), jnp.float32)
    (o, sT), vjp = jax.vjp(lambda xs, s0: op(*xs, s0, C=C), xs, s0)
    gxs, gs0 = vjp((do, dsT))
    ref_o, ref_s, ref_g = wkv7_reference_vjp_f64(xs, s0, None, np.asarray(do, np.float64), dsT)
    errs = {"o": rel_err(o, ref_o), "sT": rel_err(sT, ref_s),
            "ds0": rel_err(gs0, ref_g["initial_state"])}
    errs.update({f"d{n}": rel_err(g, ref_g[n]) for n, g in zip(NAMES, gxs)})
    assert all(np.isfinite(v) for v in errs.values()), errs
    assert max(errs.values()) < 1e-4, errs


def test_the_kernels_refuse_a_chunk_beyond_their_exponent_range():
    xs, s0 = _inputs_at_the_decay_bound(512, 16)
    with pytest.raises(ValueError, match=rf"^chunk_size must be a power of two in \[16, "
                                         rf"{GPU_MAX_CHUNK}\].*got {2 * GPU_MAX_CHUNK}$"):
        wkv7_gpu(*xs, s0, None, 2 * GPU_MAX_CHUNK, interpret=True)
    with pytest.raises(ValueError, match=rf"in \[16, {TPU_MAX_CHUNK}\].*got {2 * TPU_MAX_CHUNK}$"):
        wkv7_tpu(*xs, s0, None, 2 * TPU_MAX_CHUNK, interpret=True)
