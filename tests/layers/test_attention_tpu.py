"""Splash attention (`lwm_jax.layers.attention_tpu`), run on CPU in Pallas' interpreter: equal
to the XLA `self_attention` (outputs and gradients, causal and packed documents, grouped heads),
block-size choice, and the TPU dispatch in `lwm_jax.layers.attention`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.layers.attention import cached_attention, empty_cache, self_attention
from lwm_jax.layers.attention_tpu import block_size, splash_self_attention, splash_supported

pytestmark = pytest.mark.usefixtures("on_cpu")   # the interpreter at CPU tolerances on any host

T = 384   # three 128-blocks: the kernel's cross-block softmax and causal block skipping run


def _qkv(seed, B, T, H, K, D, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((B, T, H, D)), dtype),
            jnp.asarray(rng.standard_normal((B, T, K, D)), dtype),
            jnp.asarray(rng.standard_normal((B, T, K, D)), dtype))


def _packed(B, T):
    """Row 0: documents of 37, 150 and 197 tokens (boundaries inside blocks); row 1: one."""
    row0 = np.repeat([0, 1, 2], [37, 150, T - 187])
    return jnp.asarray(np.stack([row0, np.full(T, 5)])[:B], jnp.int32)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(x - ref).max() / np.abs(ref).max())


def _splash(q, k, v, seg=None):
    return splash_self_attention(q, k, v, segment_ids_BT=seg, interpret=True)


def _xla(q, k, v, seg=None):
    return self_attention(q, k, v, precision="highest", segment_ids_BT=seg, platform="cpu")


@pytest.mark.parametrize("H,K", [(4, 2), (4, 4)])
@pytest.mark.parametrize("packed", [False, True])
def test_float32_output_equals_xla(H, K, packed):
    q, k, v = _qkv(0, 2, T, H, K, 64)
    seg = _packed(2, T) if packed else None
    out = _splash(q, k, v, seg)
    assert out.shape == q.shape and out.dtype == jnp.float32
    assert _rel(out, _xla(q, k, v, seg)) < 1e-5


def test_packed_documents_do_not_see_each_other():
    """The second document (156 tokens) alone, through XLA at its own length, gives the same
    outputs as inside the pack: nothing crosses the boundary at 100 (inside one block)."""
    q, k, v = _qkv(1, 1, 256, 4, 2, 64)
    seg = jnp.asarray(np.repeat([0, 1], [100, 156])[None], jnp.int32)
    out = np.asarray(_splash(q, k, v, seg))
    alone = np.asarray(_xla(q[:, 100:], k[:, 100:], v[:, 100:]))
    np.testing.assert_allclose(out[:, 100:], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_gradients_equal_xla(packed):
    q, k, v = _qkv(2, 1, T, 4, 2, 64)
    w = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
    seg = _packed(1, T) if packed else None

    def grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg) * w), (0, 1, 2))(q, k, v)
    for name, g, ref in zip("qkv", grads(_splash), grads(_xla)):
        assert g.shape == ref.shape, name
        assert _rel(g, ref) < 1e-5, name


def test_bfloat16_within_bf16_rounding_of_xla():
    """bf16 eps = 2^-7 at unit scale (the scale of v): the query scale 1/sqrt(128), the
    probabilities and the output are rounded once each, differently in the two forms."""
    q, k, v = _qkv(4, 2, T, 4, 2, 128, jnp.bfloat16)
    out = _splash(q, k, v)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float32)
    xla = np.asarray(self_attention(q, k, v, precision="default"), np.float32)
    exact = np.asarray(_xla(*(a.astype(jnp.float32) for a in (q, k, v))))
    assert np.all(np.abs(out - exact) <= 2.0 ** -7 * (np.abs(exact) + 1))
    assert np.all(np.abs(out - xla) <= 2.0 ** -7 * (np.abs(xla) + 1))


def test_block_size_divides_t():
    assert [block_size(t) for t in (128, 256, 384, 768, 1024, 32768)] == [128, 256, 128, 256,
                                                                           512, 512]
    assert not splash_supported(100) and not splash_supported(0) and splash_supported(640)
    with pytest.raises(ValueError, match="100 is not a multiple of 128"):
        block_size(100)


def test_direct_call_rejects_bad_shapes_in_one_line():
    q, k, v = _qkv(5, 1, 128, 3, 2, 64)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        _splash(q, k, v)
    q, k, v = _qkv(5, 1, 128, 4, 2, 64)
    with pytest.raises(ValueError, match="segment_ids_BT has shape"):
        _splash(q, k, v, jnp.zeros((1, 64), jnp.int32))


def test_tpu_dispatch_selects_splash_only_where_it_applies(jaxpr_eqns):
    def _kernels(fn, *args):
        """Pallas calls in `fn`'s jaxpr (a fresh lambda: jax caches traces per function, and
        the patched backend is not part of the cache key)."""
        return len(jaxpr_eqns(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr, "pallas_call"))

    q, k, v = _qkv(6, 2, 256, 4, 2, 64, jnp.bfloat16)
    seg = _packed(2, 256)

    def run(q, k, v, seg=None, precision="default", platform="tpu"):
        return self_attention(q, k, v, precision=precision, segment_ids_BT=seg, interpret=True,
                              platform=platform)
    assert _kernels(lambda *a: run(*a, platform="cpu"), q, k, v) == 0  # CPU: unchanged (XLA)
    assert _kernels(run, q, k, v) == 1                      # compiled for TPU, bf16: splash
    assert _kernels(run, q, k, v, seg) == 1                 # packed documents too
    out = run(q, k, v, seg)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(_splash(q, k, v, seg), np.float32))
    # XLA on a TPU: float32 (precision is the policy's), float16, T not a multiple of 128
    q32, k32, v32 = (a.astype(jnp.float32) for a in (q, k, v))
    assert _kernels(lambda *a: run(*a, precision="highest"), q32, k32, v32) == 0
    assert _kernels(run, *(a.astype(jnp.float16) for a in (q, k, v))) == 0
    assert _kernels(run, q[:, :200], k[:, :200], v[:, :200]) == 0
    # and decoding with a cache
    cache = empty_cache(2, 256, 2, 64, jnp.bfloat16)
    assert _kernels(lambda q, k, v: cached_attention(q, k, v, cache, precision="default")[0],
                    q, k, v) == 0
