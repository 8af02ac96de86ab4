"""Generation with a LLaMA-style model on its KV cache: decode logits equal the full forward at
every position (unequal prompts, prefill chunks, any decode block), cache sizing, the CLI."""
from __future__ import annotations

import argparse
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax.cli.args import add_generate_args
from lwm_jax.generate import Generator, SamplingParams, generate_main
from lwm_jax.interop.native import save_native
from lwm_jax.interop.params import params_from_model
from lwm_jax.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=96,
                  max_seq_len=96)
GREEDY = SamplingParams(temperature=0.0)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model():
    """Random weights 5x the init scale, so that the logits (and greedy choices) vary."""
    m = Llama(CFG, "fp32", rngs=nnx.Rngs(3))
    nnx.update(m, jax.tree.map(lambda a: a * 5, nnx.state(m, nnx.Param)))
    return m


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, prefill_chunk=8)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, n).tolist() for n in (21, 13, 30)]


def _full_logits(model, seqs):
    width = max(map(len, seqs))
    batch = np.zeros((len(seqs), width), np.int32)   # right padding: earlier positions unaffected
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    graph, params = nnx.split(model)
    return np.asarray(jax.jit(lambda p, t: nnx.merge(graph, p)(t))(params, jnp.asarray(batch)))


def test_cached_decode_logits_equal_full_forward(model, gen, prompts):
    res = gen.generate(prompts, max_new_tokens=12, sampling=GREEDY, return_logits=True)
    assert res.finish_reasons == ["length"] * 3 and [len(t) for t in res.tokens] == [12] * 3
    seqs = [p + t for p, t in zip(prompts, res.tokens)]
    full = _full_logits(model, seqs)
    for i, (p, t) in enumerate(zip(prompts, res.tokens)):
        want = full[i, len(p) - 1: len(p) - 1 + len(t)]
        assert rel(res.logits[i], want) < 1e-5
        assert want.argmax(-1).tolist() == t                 # greedy = argmax of full forward
    assert len(set(map(tuple, res.tokens))) == 3             # the rows really differ
    # the returned cache holds prompt + every returned token but the last, per row
    cache = res.state
    np.testing.assert_array_equal(np.asarray(cache.length[0]), [len(s) for s in seqs])
    assert cache.k.shape[2] == 64                             # 30 + 12 positions -> 64


def test_any_decode_block_and_no_prefill_give_the_same_tokens(model, gen, prompts):
    base = gen.generate(prompts, max_new_tokens=7, sampling=GREEDY).tokens
    for kwargs in ({"decode_block": 1}, {"decode_block": 5, "prefill_chunk": 64}):
        assert Generator(model, **kwargs).generate(prompts, max_new_tokens=7,
                                                   sampling=GREEDY).tokens == base


def test_stop_tokens_and_sampling(gen, prompts):
    first = gen.generate(prompts, max_new_tokens=8, sampling=GREEDY)
    row0 = first.tokens[0]
    cut = next(j for j in range(1, 8) if row0[j] not in row0[:j])
    res = gen.generate(prompts, max_new_tokens=8, sampling=GREEDY, stop_tokens=[row0[cut]])
    assert res.tokens[0] == row0[:cut] and res.finish_reasons[0] == "stop"
    hot = SamplingParams(temperature=1.0, top_p=0.9)
    assert gen.generate(prompts, 6, hot, seed=4).tokens == gen.generate(prompts, 6, hot,
                                                                       seed=4).tokens


def test_cache_limits_are_one_line_errors(gen, prompts):
    with pytest.raises(ValueError, match=r"max_new_tokens: the longest prompt plus "
                                         r"max_new_tokens is 130 tokens, more than the "
                                         r"model's max_seq_len=96"):
        gen.generate(prompts, max_new_tokens=100)
    with pytest.raises(ValueError, match="initial_state: not supported for KV-cache"):
        gen.generate(prompts, max_new_tokens=2, initial_state=object())


def test_cli_generate_from_a_converted_llama(model, gen, tmp_path):
    save_native(CFG, params_from_model(model), tmp_path / "ckpt")
    p = add_generate_args(argparse.ArgumentParser())
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "Hello", "--temperature", "0",
            "--max-new-tokens", "6", "--no-stop-at-eod"]
    out, err = io.StringIO(), io.StringIO()
    ids = generate_main(p.parse_args(argv), out=out, err=err)
    assert ids == gen.generate([list(b"Hello")], max_new_tokens=6, sampling=GREEDY).tokens[0]
    assert out.getvalue().startswith("Hello") and "6 new tokens" in err.getvalue()
    with pytest.raises(ValueError, match="--save-state: only RWKV-7 models have a state file"):
        generate_main(p.parse_args(argv + ["--save-state", str(tmp_path / "s.safetensors")]),
                      out=io.StringIO(), err=io.StringIO())
