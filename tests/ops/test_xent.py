"""The one-kernel cross-entropy statistics and logits gradient (`lwm_jax.ops.xent`): the
Pallas kernel equals the plain-JAX form (interpreted everywhere, compiled on a GPU), and the
fused loss gives the same value and gradients through either."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7 import head_fn
from lwm_jax.ops.xent import kernel_runs, vocab_block, xent, xent_pallas, xent_reference
from lwm_jax.precision import parse_policy
from lwm_jax.train.loss import fused_lm_loss


def _rows(seed, N, V):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, V)) * 4
    x[1, V - 2] = x[1, 7] = 60.0          # a tie for the top: the smaller index wins
    x[2, :] = -3.0                         # a flat row
    targets = rng.integers(0, V, N)
    targets[0] = V - 1
    scale = np.ones(N)
    scale[3] = 0.0                         # a padded position
    return (jnp.asarray(x, jnp.float32), jnp.asarray(targets, jnp.int32),
            jnp.asarray(scale, jnp.float32))


@pytest.mark.parametrize("l2wrap,grad_dtype", [(1e-4, jnp.bfloat16), (None, jnp.float32)])
def test_kernel_equals_reference(pallas_mode, l2wrap, grad_dtype):
    x, t, s = _rows(0, 5, 3 * 4096)                    # three vocabulary blocks per row
    got = xent_pallas(x, t, s, l2wrap=l2wrap, grad_dtype=grad_dtype, interpret=pallas_mode)
    ref = xent_reference(x, t, s, l2wrap=l2wrap, grad_dtype=grad_dtype)
    names = ("lse", "target", "top", "top_idx", "d_logits")
    for name, a, b in zip(names, got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=2e-6, atol=1e-7 if name != "d_logits" else 1e-9,
                                   err_msg=name)
    assert int(got[3][1]) == 7 and float(jnp.abs(got[4][3].astype(jnp.float32)).max()) == 0.0
    # the gradient rows are a softmax minus a one-hot: each sums to ~0 (plus L2Wrap's term)
    sums = np.asarray(jnp.sum(got[4].astype(jnp.float32), axis=1))
    extra = 0.0 if l2wrap is None else l2wrap * np.asarray(got[2])
    np.testing.assert_allclose(sums, extra * np.asarray(s), atol=2e-2)


def test_nan_logit_and_bad_target_give_nan(pallas_mode):
    x, t, s = _rows(3, 5, 2048)
    x = x.at[0, 11].set(jnp.nan)
    t = t.at[4].set(2048)
    lse, target, *_ = xent_pallas(x, t, s, l2wrap=1e-4, grad_dtype=jnp.float32,
                                  interpret=pallas_mode)
    ref_lse, ref_target, *_ = xent_reference(x, t, s, l2wrap=1e-4, grad_dtype=jnp.float32)
    assert np.isnan(lse[0]) and np.isnan(ref_lse[0]) and np.all(np.isfinite(lse[1:]))
    assert np.isnan(target[4]) and np.isnan(ref_target[4]) and np.all(np.isfinite(target[:4]))


def test_vocab_block_and_refusal():
    assert vocab_block(65536) == 4096 and vocab_block(6144) == 2048
    assert vocab_block(32000) is None and vocab_block(50257) is None
    x, t, s = _rows(1, 5, 1024)
    with pytest.raises(ValueError, match="vocabulary size 1024"):
        xent_pallas(x, t, s, l2wrap=None, grad_dtype=jnp.float32, interpret=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_fused_loss_same_through_kernel(precision):
    """`fused_lm_loss` through the kernel (interpreted) = through XLA: the loss to float32
    rounding, dx and the head gradients bit-equal or to float32 rounding."""
    rng = np.random.default_rng(2)
    policy = parse_policy(precision)
    C, V = 16, 2048
    x = jnp.asarray(rng.normal(size=(2, 13, C)), policy.compute_dtype)
    hp = (jnp.ones(C), jnp.zeros(C), jnp.asarray(rng.normal(size=(C, V)) * 3, jnp.float32))
    tgt = jnp.asarray(rng.integers(0, V, (2, 13)))
    fn = head_fn(policy)

    def run(impl):
        f = lambda x, hp: fused_lm_loss(fn, x, hp, tgt, chunk_tokens=10,  # noqa: E731
                                        use_l2wrap=True, xent_impl=impl)
        return jax.value_and_grad(f, argnums=(0, 1))(x, hp)

    (l_k, g_k), (l_x, g_x) = run("interpret"), run("xla")
    assert abs(float(l_k) - float(l_x)) <= 2e-6 * abs(float(l_x))
    for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(g_x)):
        assert a.dtype == b.dtype
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a64 - b64) <= 1e-5 * np.linalg.norm(b64)
    with pytest.raises(ValueError, match="xent_impl"):
        fused_lm_loss(fn, x, hp, tgt, chunk_tokens=10, use_l2wrap=True, xent_impl="cuda")


def test_op_choice_rule_and_leading_axes():
    """`xent(impl=)`: "auto" runs the kernel only on one GPU with a vocabulary that tiles,
    "pallas" / "interpret" run it on a device mesh too; through the kernel, leading axes are
    kept and `d_logits` comes in `grad_dtype`, through XLA's form in float32."""
    assert kernel_runs("auto", 65536, platform="gpu", one_device=True)
    assert not kernel_runs("auto", 32000, platform="gpu", one_device=True)
    assert not kernel_runs("auto", 65536, platform="gpu", one_device=False)
    assert not kernel_runs("auto", 65536, platform="cpu", one_device=True)
    assert kernel_runs("pallas", 65536, platform="cpu", one_device=False)
    assert not kernel_runs("xla", 65536, platform="gpu", one_device=True)
    with pytest.raises(ValueError, match="xent_impl"):
        kernel_runs("cuda", 65536, platform="gpu", one_device=True)
    x, t, s = _rows(4, 6, 2048)
    x_BnV, t_Bn, s_Bn = x.reshape(2, 3, 2048), t.reshape(2, 3), s.reshape(2, 3)
    got = xent(x_BnV, t_Bn, s_Bn, l2wrap=1e-4, grad_dtype=jnp.bfloat16, impl="interpret",
               one_device=False)
    ref = xent(x_BnV, t_Bn, s_Bn, l2wrap=1e-4, grad_dtype=jnp.bfloat16, impl="auto",
               platform="cpu")
    assert got[4].dtype == jnp.bfloat16 and ref[4].dtype == jnp.float32
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=2e-6, atol=4e-3)
