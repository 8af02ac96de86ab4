"""The fused, chunked loss (`train.loss.fused_lm_loss`): same value and gradients as the plain
cross-entropy + L2Wrap on full logits, without ever holding `[B, T, V]` logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax import ModelConfig
from lwm_jax.models.rwkv7 import RWKV7, head_fn
from lwm_jax.precision import parse_policy
from lwm_jax.ops.xent import max_argmax_logsumexp
from lwm_jax.train.loss import chunked_cross_entropy, cross_entropy, fused_lm_loss, lm_loss
from lwm_jax.train.step import model_loss


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("precision,use_l2wrap,chunk", [("fp32", True, 16),
                                                         ("bf16-mixed", False, 24)])
def test_fused_equals_plain_loss_value_and_every_gradient(precision, use_l2wrap, chunk):
    cfg = ModelConfig(vocab_size=96, n_layer=1, n_embd=64, head_size=32)
    model = RWKV7(cfg, precision, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    # a head that is not ~0 at init, so the logits (and L2Wrap's argmax term) matter
    params["head"][...] = 3 * jax.random.normal(jax.random.PRNGKey(2), params["head"].shape)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 38), 0, 96)   # T = 37: ragged chunks

    def loss(params, fused):
        m = nnx.merge(graphdef, params)
        return 1024.0 * model_loss(m, tokens[:, :-1], tokens[:, 1:], use_l2wrap=use_l2wrap,
                                   loss_chunk=chunk if fused else 0)   # 1024: a loss scale

    plain, g_plain = jax.jit(jax.value_and_grad(lambda p: loss(p, False)))(params)
    fused, g_fused = jax.jit(jax.value_and_grad(lambda p: loss(p, True)))(params)
    assert rel(fused, plain) < 1e-6
    flat_p, flat_f = nnx.to_flat_state(g_plain), nnx.to_flat_state(g_fused)
    for (path, gp), (_, gf) in zip(flat_p, flat_f):
        gp, gf = gp.get_value(), gf.get_value()
        assert gf.dtype == gp.dtype, path
        if np.linalg.norm(np.asarray(gp, np.float64)) > 0:
            assert rel(gf, gp) < (2e-5 if precision == "fp32" else 2e-2), path
        else:
            np.testing.assert_array_equal(gf, gp)


def test_l2wrap_term_reaches_the_head_through_the_fused_loss():
    """With and without L2Wrap the fused gradients differ exactly as the plain ones do."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 9, 8)), jnp.float32)
    hp = (jnp.ones(8), jnp.zeros(8), jnp.asarray(rng.normal(size=(8, 11)) * 4, jnp.float32))
    tgt = jnp.asarray(rng.integers(0, 11, (2, 9)))
    fn = head_fn(parse_policy("fp32"))

    def grads(use, fused):
        if fused:
            f = lambda x, hp: fused_lm_loss(fn, x, hp, tgt, chunk_tokens=6, use_l2wrap=use)  # noqa
        else:
            f = lambda x, hp: lm_loss(fn(x, hp), tgt, use_l2wrap=use)  # noqa
        return jax.grad(f, argnums=(0, 1))(x, hp)

    for fused in (False, True):
        d_on, d_off = grads(True, fused), grads(False, fused)
        if not fused:
            ref = jax.tree.map(lambda a, b: a - b, d_on, d_off)
        else:
            got = jax.tree.map(lambda a, b: a - b, d_on, d_off)
    # differences of two float32 gradients: compare against a tolerance far below the term
    atol = 2e-7
    assert float(jnp.abs(ref[1][2]).max()) > 100 * atol
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=atol)


def test_eval_chunks_equal_full_cross_entropy():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 23, 8)), jnp.float32)
    hp = (jnp.ones(8), jnp.zeros(8), jnp.asarray(rng.normal(size=(8, 13)), jnp.float32))
    tgt = jnp.asarray(rng.integers(0, 13, (3, 23)))
    fn = head_fn(parse_policy("fp32"))
    full = cross_entropy(fn(x, hp), tgt)
    for chunk in (3, 7, 69, 1000):
        assert rel(chunked_cross_entropy(fn, x, hp, tgt, chunk_tokens=chunk), full) < 1e-6


def test_fused_loss_never_holds_the_full_logits():
    """XLA's buffer assignment: the fused step's temporaries stay far below one [B, T, V] f32
    logits array, while the plain loss needs several of them."""
    B, T, C, V = 4, 2048, 64, 32768
    fn = head_fn(parse_policy("bf16-mixed"))
    x = jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16)
    hp = (jax.ShapeDtypeStruct((C,), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((C, V),
                                                                                jnp.float32),)
    tgt = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def temp_bytes(f):
        g = jax.jit(jax.grad(f, argnums=(0, 1)))
        return g.lower(x, hp, tgt).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = B * T * V * 4
    plain = temp_bytes(lambda x, hp, t: lm_loss(fn(x, hp), t, use_l2wrap=True))
    fused = temp_bytes(lambda x, hp, t: fused_lm_loss(fn, x, hp, t, chunk_tokens=1024,
                                                      use_l2wrap=True))
    assert plain >= 2 * logits_bytes
    assert fused <= logits_bytes / 2, (fused / 2**20, logits_bytes / 2**20)


@pytest.mark.parametrize("V", [4096, 4099])     # blocks of 64; 65 blocks, the last one padded
def test_one_pass_max_argmax_logsumexp_matches_the_separate_reductions(V):
    """The fused loss's single reduction: argmax (first index on ties), max and log-sum-exp
    against `jnp.argmax`, `jnp.max` and a float64 log-sum-exp (to float32 rounding: a
    one-level fold of the vocabulary on a CPU is 5x off), on fresh random logits with planted
    ties; a NaN logit makes that row's log-sum-exp NaN (the loss must not hide it)."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 5, V)) * 6
    logits[0, 0, [7, 900, 4000]] = 60.0                    # a three-way tie for the max
    logits[1, 2, [0, V - 1]] = 55.0                        # tie at both ends
    logits = logits.astype(np.float32)
    idx, top, lse = jax.jit(max_argmax_logsumexp)(jnp.asarray(logits))
    np.testing.assert_array_equal(idx, np.argmax(logits, axis=-1))
    assert idx[0, 0] == 7 and idx[1, 2] == 0
    np.testing.assert_array_equal(top, logits.max(axis=-1))
    x64 = logits.astype(np.float64)
    m = x64.max(axis=-1, keepdims=True)
    ref = m[..., 0] + np.log(np.exp(x64 - m).sum(axis=-1))
    assert rel(lse, ref) < 1e-7
    with_nan = logits.copy()
    with_nan[2, 1, 123] = np.nan
    lse_nan = np.asarray(jax.jit(max_argmax_logsumexp)(jnp.asarray(with_nan))[2])
    assert np.isnan(lse_nan[2, 1]) and np.isfinite(np.delete(lse_nan.ravel(), 2 * 5 + 1)).all()


GROUPED_DRIVER = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from lwm_jax.mesh_axes import activation_spec
from lwm_jax.train.loss import _DeviceGroups, fused_lm_loss
from lwm_jax.train.sharding import make_mesh

B, T, C, V = 4, 32, 16, 40
rng = np.random.default_rng(0)
x = rng.standard_normal((B, T, C)).astype(np.float32)
w = rng.standard_normal((C, V)).astype(np.float32)
tgt = rng.integers(0, V, (B, T)).astype(np.int32)
head = lambda x, p: jnp.einsum("bnc,cv->bnv", x, p["w"], precision="highest")
out = {}
for name, sizes in {"data2_fsdp2": dict(data=2, fsdp=2, tensor=1, sequence=1),
                    "fsdp2_seq2": dict(data=1, fsdp=2, tensor=1, sequence=2)}.items():
    mesh = make_mesh(sizes)
    assert _DeviceGroups(mesh, B, 8, 0).active         # n = 32 // 4 = 8 positions per chunk
    xs = jax.device_put(x, NamedSharding(mesh, activation_spec(3)))
    ps = {"w": jax.device_put(w, NamedSharding(mesh, P("fsdp", None)))}
    ts = jax.device_put(tgt, NamedSharding(mesh, activation_spec()))
    for m, key in ((mesh, name), (None, name + "_plain")):
        f = lambda x, p, m=m: fused_lm_loss(head, x, p, ts, chunk_tokens=32, use_l2wrap=True,
                                            mesh=m)
        val, (gx, gp) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(xs, ps)
        out[key] = [float(val), np.asarray(gx).tolist(), np.asarray(gp["w"]).tolist()]
logits = np.einsum("btc,cv->btv", x.astype(np.float64), w.astype(np.float64))
lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
out["ref"] = float(np.mean(lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]))
print(json.dumps(out))
"""


def test_fused_loss_grouped_by_device_equals_ungrouped(subprocess_env):
    """On 4 CPU devices (data x fsdp, fsdp x sequence) the per-device accumulators of the
    fused loss give the value and gradients of the one-accumulator loop (float32 summation
    order apart), and the value of a float64 reference."""
    import json
    import subprocess
    import sys
    env = subprocess_env(4, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", GROUPED_DRIVER], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("data2_fsdp2", "fsdp2_seq2"):
        grouped, plain = out[name], out[name + "_plain"]
        assert rel(grouped[0], out["ref"]) < 1e-6
        assert rel(grouped[0], plain[0]) < 1e-6
        assert rel(grouped[1], plain[1]) < 1e-6          # d x
        assert rel(grouped[2], plain[2]) < 1e-6          # d head
