"""Contracts stated with chex: the WKV op under jit and eagerly for each implementation
(`chex.variants`), the shapes and dtypes of the op and the model (`assert_shape`/`assert_type`),
and no silent retracing of the decode step (`chex.assert_max_traces`; the train step's is in
tests/test_survivors.py).
"""
from __future__ import annotations

import functools
import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

from lwm_jax.runtime import Runtime
from lwm_jax import PRESETS, ModelConfig
from lwm_jax.generate.sampling import SamplingParams
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.models.rwkv7.testing import randomize_params
from lwm_jax.ops.wkv7 import wkv7, wkv7_reference_np
from lwm_jax.ops.wkv7.testing import random_wkv7_inputs

engine = importlib.import_module("lwm_jax.generate.engine")

B, T, H, K, V = 2, 24, 2, 16, 16
CHUNK = 16
CFG = ModelConfig(vocab_size=64, n_layer=2, n_embd=64, head_size=32)
RT = Runtime(chunk_size=16)


def _wkv_problem(dtype):
    xs = random_wkv7_inputs(3, B, T, H, K, V, dtype)
    s0 = 0.5 * jax.random.normal(jax.random.PRNGKey(4), (B, H, K, V), jnp.float32)
    seg = jnp.asarray([[0] * 5 + [1] * (T - 5), [2] * (T - 9) + [3] * 9], jnp.int32)
    return xs, s0, seg


class WKV7VariantsTest(chex.TestCase):
    """Each implementation, jitted and not, against the float64 recurrence (packed documents,
    initial state, T not a multiple of the chunk). fp32: 2e-6 relative per element (the fp32
    forms measure ~3e-7, tests/ops/wkv7/test_wkv7_ops.py); bf16 inputs: output within 1e-2."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("recurrent_f32", "recurrent", jnp.float32), ("chunked_f32", "chunked", jnp.float32),
        ("pallas_interpret_f32", "pallas", jnp.float32),
        ("recurrent_bf16", "recurrent", jnp.bfloat16), ("chunked_bf16", "chunked", jnp.bfloat16))
    def test_matches_float64_reference(self, impl, dtype):
        xs, s0, seg = _wkv_problem(dtype)
        run = self.variant(functools.partial(wkv7, impl=impl, chunk_size=CHUNK,
                                             return_state=True))
        o, state = run(*xs, initial_state=s0, segment_ids=seg)
        chex.assert_shape(o, (B, T, H, V))
        chex.assert_shape(state, (B, H, K, V))
        chex.assert_type([o, state], [dtype, jnp.float32])
        ref_o, ref_s = wkv7_reference_np(*xs, initial_state=s0, segment_ids=seg)
        scale = lambda ref: float(np.max(np.abs(ref)))  # noqa: E731
        if dtype == jnp.float32:
            chex.assert_trees_all_close(np.asarray(o, np.float64), ref_o, rtol=2e-6,
                                        atol=2e-6 * scale(ref_o))
            chex.assert_trees_all_close(np.asarray(state, np.float64), ref_s, rtol=2e-6,
                                        atol=2e-6 * scale(ref_s))
        else:
            chex.assert_trees_all_close(np.asarray(o, np.float64), ref_o, rtol=1e-2,
                                        atol=1e-2 * scale(ref_o))
            chex.assert_trees_all_close(np.asarray(state, np.float64), ref_s, rtol=1e-2,
                                        atol=1e-2 * scale(ref_s))


@pytest.mark.parametrize("dtype,output_dtype", [(jnp.float32, None), (jnp.bfloat16, None),
                                                (jnp.float16, None),
                                                (jnp.bfloat16, jnp.float32)])
@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_wkv7_op_contract(impl, dtype, output_dtype):
    """Design contract: o `[B, T, H, V]` in `output_dtype` (default v's dtype), state
    `[B, H, K, V]` float32 whatever the inputs; `return_state=False` gives `o` alone. w may stay
    float32 under low-precision inputs."""
    r, w, k, v, a, b = random_wkv7_inputs(0, B, T, H, K, V, dtype)
    w = w.astype(jnp.float32)
    o, state = jax.eval_shape(functools.partial(
        wkv7, impl=impl, return_state=True, output_dtype=output_dtype), r, w, k, v, a, b)
    chex.assert_shape([o, state], [(B, T, H, V), (B, H, K, V)])
    chex.assert_type([o, state], [output_dtype or dtype, jnp.float32])
    only_o = jax.eval_shape(functools.partial(wkv7, impl=impl), r, w, k, v, a, b)
    chex.assert_shape(only_o, (B, T, H, V))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_model_contract(preset):
    """`model(tokens, return_state=True)`: float32 logits `[B, T, V]` and an `RWKV7State` of
    float32 `[L, B, C]`, `[L, B, C]`, `[L, B, H, N, N]` under every preset; parameters in the
    policy's param dtype. (Shapes only: traced, not run.)"""
    model = RWKV7(CFG, preset, runtime=RT, rngs=nnx.Rngs(0))
    L, C, Hh, N = CFG.n_layer, CFG.n_embd, CFG.n_head, CFG.head_size
    tokens = jnp.zeros((3, 5), jnp.int32)
    graphdef, params = nnx.split(model)
    logits, state = jax.eval_shape(
        lambda p, t: nnx.merge(graphdef, p)(t, return_state=True), params, tokens)
    chex.assert_shape(logits, (3, 5, CFG.vocab_size))
    chex.assert_type(logits, jnp.float32)
    chex.assert_shape([state.tmix_shift, state.cmix_shift, state.wkv],
                      [(L, 3, C), (L, 3, C), (L, 3, Hh, N, N)])
    chex.assert_type([state.tmix_shift, state.cmix_shift, state.wkv], jnp.float32)
    chex.assert_type(jax.tree.leaves(nnx.state(model, nnx.Param)),
                     PRESETS[preset].param_dtype)


def test_decode_compiles_once_per_batch_size(monkeypatch):
    """The decode block and the prefill are traced once for a batch size, whatever the prompts,
    their lengths, max_new_tokens, the sampling settings or the number of blocks (forced
    prompt tokens, then free sampling): each is wrapped in chex.assert_max_traces(n=1)."""
    chex.clear_trace_counter()
    monkeypatch.setattr(engine, "_block", jax.jit(chex.assert_max_traces(engine._block_fn, n=1),
                                                  static_argnums=(0, 1), donate_argnums=4))
    monkeypatch.setattr(engine, "_prefill", jax.jit(
        chex.assert_max_traces(engine._prefill_fn, n=1), static_argnums=0))
    model = randomize_params(RWKV7(CFG, "fp32", runtime=RT, rngs=nnx.Rngs(0)), seed=1)
    gen = engine.Generator(model, prefill_chunk=4, decode_block=4)
    first = gen.generate([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15]],
                         max_new_tokens=9, sampling=SamplingParams(temperature=0.0))
    again = gen.generate([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8]], max_new_tokens=6, seed=1,
                         sampling=SamplingParams(temperature=0.8, top_p=0.9))
    assert [len(t) for t in first.tokens] == [9, 9] and [len(t) for t in again.tokens] == [6, 6]
    chex.assert_shape(first.state.wkv, (CFG.n_layer, 2, CFG.n_head, CFG.head_size,
                                        CFG.head_size))
