"""The LLaMA model: float64 reference parity, packed documents, runtime knobs, config rules."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax.models.llama import Llama, LlamaConfig, RopeScaling, head_fn
from lwm_jax.models.llama.reference import forward
from lwm_jax.runtime import Runtime
from lwm_jax.train.sharding import LOGICAL_RULES

CFG = LlamaConfig(vocab_size=97, n_layer=2, n_embd=48, n_head=4, n_kv_head=2, ffn_hidden=80,
                  max_seq_len=64)


@functools.lru_cache(maxsize=None)
def _base(cfg, policy, seed):
    model = Llama(cfg, policy, rngs=nnx.Rngs(seed))
    # random norm weights, so that a weight applied wrongly shows
    for norm in (model.blocks.attn_norm, model.blocks.mlp_norm, model.norm):
        key = jax.random.key(seed + norm.weight.shape[-1] + norm.weight.ndim)
        norm.weight[...] = 1 + 0.3 * jax.random.normal(key, norm.weight.shape)
    return nnx.state(model, nnx.Param)


def _model(cfg=CFG, policy="fp32", seed=0, **runtime):
    """A model with the (cached) random weights of (cfg, policy, seed), run with `runtime`."""
    model = nnx.eval_shape(lambda: Llama(cfg, policy, runtime=Runtime(**runtime),
                                         rngs=nnx.Rngs(seed)))
    nnx.update(model, _base(cfg, policy, seed))
    return model


def _run(model, tokens, **kwargs):
    """`model(tokens, **kwargs)` jitted (eager dispatch of every op is slower on CPU)."""
    graph, params = nnx.split(model)
    return jax.jit(lambda p, t, kw: nnx.merge(graph, p)(t, **kw))(params, tokens, kwargs)


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _tokens(B, T, V=97, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


@pytest.mark.parametrize("cfg", [
    CFG,
    dataclasses.replace(CFG, tie_embeddings=True, n_kv_head=1, rope_theta=500000.0,
                        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
    dataclasses.replace(CFG, n_kv_head=4, head_dim=16, rope_scaling=RopeScaling("linear", 2.0)),
])
def test_logits_match_the_float64_reference(cfg):
    model = _model(cfg)
    tokens = _tokens(2, 11)
    logits = _run(model, tokens)
    assert logits.dtype == jnp.float32 and logits.shape == (2, 11, 97)
    ref = forward(model.cfg, _params(model), tokens)
    err = np.linalg.norm(np.asarray(logits) - ref) / np.linalg.norm(ref)
    assert err < 1e-5, err


def test_packed_documents_equal_separate_runs():
    model = _model()
    tokens = _tokens(1, 12, seed=1)
    seg = jnp.asarray([[4, 4, 4, 4, 4, 9, 9, 9, 1, 1, 1, 1]])
    packed = np.asarray(_run(model, tokens, segment_ids=seg))
    for lo, hi in ((0, 5), (5, 8), (8, 12)):
        alone = np.asarray(_run(model, tokens[:, lo:hi]))
        np.testing.assert_allclose(packed[:, lo:hi], alone, rtol=2e-5, atol=2e-5)
    ref = forward(model.cfg, _params(model), tokens, seg)
    np.testing.assert_allclose(packed, ref, rtol=1e-4, atol=1e-4)
    # without the segment ids the later documents would see the earlier ones
    assert np.abs(np.asarray(_run(model, tokens))[:, 5:] - packed[:, 5:]).max() > 1e-3


def test_runtime_knobs_change_nothing():
    tokens = _tokens(2, 8, seed=2)
    base = np.asarray(_run(_model(), tokens))
    for rt in ({"scan_layers": True}, {"remat": True},
               {"remat": True, "scan_layers": True, "remat_policy": "save_dots"},
               {"remat": True, "scan_layers": True, "remat_layers": 1}):
        np.testing.assert_allclose(np.asarray(_run(_model(**rt), tokens)), base, rtol=1e-6,
                                   atol=1e-6, err_msg=str(rt))


def test_gradients_flow_and_match_under_scan_and_remat():
    tokens = _tokens(2, 8, seed=3)

    def grads(**rt):
        model = _model(**rt)
        graph, params = nnx.split(model, nnx.Param)

        def loss(p):
            return jnp.mean(nnx.merge(graph, p)(tokens) ** 2)
        return jax.jit(jax.grad(loss))(params)
    g0 = grads()
    for rt in ({"scan_layers": True, "remat": True},
               {"scan_layers": True, "remat": True, "remat_layers": 1},
               {"remat": True, "remat_layers": 1}):
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(grads(**rt))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8,
                                       err_msg=str(rt))
    assert all(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g0))


def test_bf16_mixed_keeps_float32_params_and_logits():
    model = _model(policy="bf16-mixed")
    tokens = _tokens(1, 6, seed=4)
    logits = _run(model, tokens)
    assert logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(_params(model)))
    assert jax.eval_shape(model.features, tokens).dtype == jnp.bfloat16
    ref = forward(model.cfg, _params(model), tokens)
    assert np.linalg.norm(np.asarray(logits) - ref) / np.linalg.norm(ref) < 3e-2


def test_features_and_head_fn_give_the_logits():
    model = _model(dataclasses.replace(CFG, tie_embeddings=True))
    tokens = _tokens(2, 5, seed=5)
    graph, params = nnx.split(model)

    def both(p, t):
        m = nnx.merge(graph, p)
        return head_fn(m.policy, m.cfg.rms_eps)(m.features(t), m.head_params()), m(t)
    via_head, logits = jax.jit(both)(params, tokens)
    np.testing.assert_array_equal(np.asarray(via_head), np.asarray(logits))


def test_param_tree_axes_and_count():
    for cfg in (CFG, dataclasses.replace(CFG, tie_embeddings=True)):
        model = _model(cfg)
        assert model.param_count() == cfg.param_count()
        params = _params(model)
        assert ("head" in params) is not cfg.tie_embeddings
        for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            axes = var.get_metadata()["logical_axes"]
            assert len(axes) == var.get_value().ndim and set(axes) <= set(LOGICAL_RULES)
    assert _params(_model())["blocks"]["attn"]["k"].shape == (2, 48, 2 * 12)


def test_config_errors_are_one_line():
    cases = [({"n_kv_head": 3}, "model.n_kv_head: 3 does not divide model.n_head=4"),
             ({"n_embd": 50}, "model.n_embd: 50 is not a multiple of model.n_head=4"),
             ({"head_dim": 7}, "model.head_dim: 7 must be even"),
             ({"rms_eps": 0.0}, "model.rms_eps: must be a number > 0"),
             ({"n_layer": 0}, "model.n_layer: must be a positive integer")]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(CFG, **change)
    with pytest.raises(ValueError, match=r"model.rope_scaling.kind: 'yarn' is not one of"):
        LlamaConfig.from_dict({"rope_scaling": {"kind": "yarn"}})
    with pytest.raises(ValueError, match=r"model.rope_scaling.beta: unknown key"):
        LlamaConfig.from_dict({"rope_scaling": {"beta": 1}})
    with pytest.raises(ValueError, match=r"model.n_heads: unknown key; valid keys: "):
        LlamaConfig.from_dict({"n_heads": 4})
    with pytest.raises(ValueError, match="high_freq_factor: 1.0 must be larger"):
        RopeScaling(high_freq_factor=1.0)
    cfg = LlamaConfig.from_dict(CFG.to_dict())
    assert cfg == CFG and LlamaConfig.from_dict(
        dataclasses.replace(CFG, rope_scaling=RopeScaling()).to_dict()).rope_scaling == \
        RopeScaling()


def test_bad_calls_are_one_line():
    model = _model()
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        model(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="segment_ids cannot be combined with a KV cache"):
        model(_tokens(1, 3), state=model.init_state(1, 8), segment_ids=jnp.zeros((1, 3), int))
    with pytest.raises(ValueError, match=r"state.k has shape"):
        model(_tokens(2, 3), state=model.init_state(1, 8))
