"""RWKV-7 / attention hybrids (`arch: rwkv7-hybrid`): the model, its config, and training."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax import ModelConfig
from lwm_jax.models.hybrid import HybridConfig, RWKVHybrid
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.models.rwkv7 import init
from lwm_jax.models.rwkv7.testing import param_dict, randomize_params
from lwm_jax.runtime import Runtime

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
SMALL = dict(vocab_size=61, n_layer=4, n_embd=32, head_size=16)
RT = Runtime(wkv_impl="chunked", chunk_size=8)


def _tokens(seed, B, T, V=61):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)))


def _hybrid(layers=(2,), kv=1, runtime=RT, policy="fp32", seed=0):
    cfg = HybridConfig(**SMALL, attention_layers=layers, attn_kv_heads=kv)
    return randomize_params(RWKVHybrid(cfg, policy, runtime=runtime, rngs=nnx.Rngs(seed)),
                            seed=seed + 1)


def test_without_attention_layers_it_is_rwkv7():
    """Same seed, no attention layers: the same parameters and the same logits as RWKV7."""
    cfg = HybridConfig(**SMALL)
    hyb = RWKVHybrid(cfg, "fp32", runtime=RT, rngs=nnx.Rngs(3))
    ref = RWKV7(ModelConfig(**SMALL), "fp32", runtime=RT, rngs=nnx.Rngs(3))
    jax.tree.map(np.testing.assert_array_equal, param_dict(hyb), param_dict(ref))
    ref = randomize_params(ref, seed=4)
    nnx.update(hyb, nnx.state(ref, nnx.Param))
    tok = _tokens(0, 2, 19)
    np.testing.assert_array_equal(np.asarray(hyb(tok)), np.asarray(ref(tok)))


def test_parameters_count_and_depth_init():
    """Attention parameters exist for the chosen layers only; counts agree with the config;
    each RWKV layer carries the official init of its real depth in the L-layer stack."""
    cfg = HybridConfig(**SMALL, attention_layers=(1, 3), attn_kv_heads=1)
    model = RWKVHybrid(cfg, "fp32", rngs=nnx.Rngs(0))
    p = param_dict(model)
    C, N = 32, 16
    assert p["blocks"]["att"]["receptance"].shape == (2, C, C)            # layers 0 and 2
    assert p["attn_blocks"]["attn"]["q"].shape == (2, C, C)
    assert p["attn_blocks"]["attn"]["k"].shape == (2, C, N)              # one kv head
    assert p["attn_blocks"]["ffn"]["key"].shape == (2, C, 4 * C)
    assert model.param_count() == cfg.param_count()
    for i, depth in enumerate((0, 2)):
        want = init.time_mix_vectors(depth, 4, C, N)
        np.testing.assert_allclose(p["blocks"]["att"]["w0"][i], want["w0"], rtol=1e-6)
        np.testing.assert_allclose(p["blocks"]["att"]["ln_x"]["weight"][i], want["ln_x_weight"],
                                   rtol=1e-6)
    for i, depth in enumerate((1, 3)):
        np.testing.assert_allclose(p["attn_blocks"]["ffn"]["x_k"][i],
                                   init.channel_mix_vectors(depth, 4, C)["x_k"], rtol=1e-6)


def test_causal_and_the_attention_layer_matters():
    """Changing token t leaves the logits before t unchanged (causal) and changes later ones;
    changing the attention layer's value projection changes the logits (it is on the path)."""
    model = _hybrid()
    tok = _tokens(1, 1, 24)
    base = np.asarray(model(tok))
    moved = np.asarray(model(tok.at[0, 10].set((tok[0, 10] + 1) % 61)))
    np.testing.assert_array_equal(moved[:, :10], base[:, :10])
    assert np.abs(moved[:, 10:] - base[:, 10:]).max() > 1e-4
    model.attn_blocks.attn.v[...] = model.attn_blocks.attn.v[...] * 2.0
    assert np.abs(np.asarray(model(tok)) - base).max() > 1e-4


def test_packed_documents_equal_separate_runs():
    """With segment ids, each document's logits equal the document run alone: RWKV state,
    attention and RoPE positions all restart at the boundary."""
    model = _hybrid()
    a, b = _tokens(2, 1, 11), _tokens(3, 1, 13)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.asarray([[0] * 11 + [1] * 13])
    out = np.asarray(model(packed, segment_ids=seg))
    np.testing.assert_allclose(out[:, :11], np.asarray(model(a)), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out[:, 11:], np.asarray(model(b)), rtol=2e-5, atol=2e-5)
    assert np.abs(out[:, 11:] - np.asarray(model(packed))[:, 11:]).max() > 1e-4


def test_remat_gives_the_same_loss_and_gradients():
    tok = _tokens(4, 2, 17)

    def loss_and_grads(runtime):
        model = _hybrid(layers=(1, 3), runtime=runtime)
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p):
            logits = nnx.merge(graphdef, p)(tok[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, 1:, None], -1))
        return jax.value_and_grad(loss)(params)

    (l0, g0), (l1, g1) = loss_and_grads(RT), loss_and_grads(Runtime(wkv_impl="chunked",
                                                                      chunk_size=8, remat=True))
    assert float(l0) == pytest.approx(float(l1), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(g0["attn_blocks"]["attn"]["q"][...]).max()) > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(attention_layers=(0,)), r"model.attention_layers: \[0\] must lie in \[1, 3\]"),
    (dict(attention_layers=(4,)), r"must lie in \[1, 3\]"),
    (dict(attention_layers=(2, 1)), "must be increasing with no repeats"),
    (dict(attention_layers=(2,), attn_kv_heads=3), "model.attn_kv_heads: 3 must be 0 or a "
                                                   "divisor of the 2 query heads"),
])
def test_config_errors_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        HybridConfig(**SMALL, **kwargs)
    assert "\n" not in str(err.value)


def test_state_and_generation_are_refused_in_one_line():
    model = _hybrid()
    for call in (lambda: model.init_state(1),
                 lambda: model(_tokens(0, 1, 4), return_state=True)):
        with pytest.raises(ValueError, match="no recurrent state support yet") as err:
            call()
        assert "\n" not in str(err.value)


@pytest.fixture()
def compile_cache(tmp_path_factory):
    """The three runs below compile the same programs: share them through JAX's disk cache."""
    from lwm_jax.train.compile_cache import enable_compilation_cache
    return enable_compilation_cache(str(tmp_path_factory.getbasetemp() / "jax-compile-hybrid"))


@pytest.mark.slow
def test_hybrid_config_trains_and_resumes(tmp_path, compile_cache):
    """`configs/rwkv7-hybrid-tiny.yaml` through the trainer: the loss falls, a split run
    resumes to the same losses, and the checkpoint loads back as a hybrid."""
    from lwm_jax.interop import load_pretrained
    from lwm_jax.train.config import load_config
    from lwm_jax.train.metrics import read_metrics
    from lwm_jax.train.trainer import train

    path = os.path.join(REPO, "configs", "rwkv7-hybrid-tiny.yaml")
    common = ["model.n_layer=3", "model.attention_layers=[1]", "model.n_embd=64",
              "model.head_size=32", "train.ctx_len=32", "train.batch_size=4",
              "train.steps=6", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=0",
              "checkpoint.every=3", "checkpoint.async=false", "runtime.wkv_impl=chunked"]
    full = train(load_config(path, [*common, f"run_dir={tmp_path / 'full'}"]), progress=False)
    split_cfg = load_config(path, [*common, f"run_dir={tmp_path / 'split'}"])
    assert train(split_cfg, progress=False, stop_after=3).step == 3
    second = train(split_cfg, progress=False)
    losses = [r["loss"] for r in read_metrics(os.path.join(full.run_dir, "metrics.jsonl"))[0]]
    split = [r["loss"] for r in read_metrics(os.path.join(second.run_dir, "metrics.jsonl"))[0]]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    np.testing.assert_allclose(split, losses, rtol=1e-6)
    model, cfg = load_pretrained(second.run_dir)
    assert isinstance(model, RWKVHybrid) and cfg.attention_layers == (1,)
