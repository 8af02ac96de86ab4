"""Generation: RNN path == full forward, batching of unequal prompts, sampling, one compile."""
from __future__ import annotations

import argparse
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.config import ModelConfig
from lwm_jax.generate.engine import TRACES
from lwm_jax.generate import (Generator, SamplingParams, add_generate_args, apply_penalties,
                              filter_logits, generate_main, load_state, sample, save_state)
from lwm_jax.interop.native import save_native
from lwm_jax.interop.params import model_from_params
from lwm_jax.interop.testing import random_params

CFG = ModelConfig(vocab_size=256, n_layer=2, n_embd=64, head_size=32, decay_lora=16, a_lora=16,
                  v_lora=16, gate_lora=32).resolved()
GREEDY = SamplingParams(temperature=0.0)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=2)


@pytest.fixture(scope="module")
def model(tree):
    return model_from_params(CFG, tree)


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, prefill_chunk=8)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, n).tolist() for n in (21, 13, 30)]


def test_rnn_logits_equal_full_forward_for_unequal_prompts(model, gen, prompts):
    res = gen.generate(prompts, max_new_tokens=12, sampling=GREEDY, return_logits=True)
    assert res.finish_reasons == ["length"] * 3 and [len(t) for t in res.tokens] == [12] * 3
    seqs = [p + t for p, t in zip(prompts, res.tokens)]
    width = max(map(len, seqs))
    batch = np.zeros((3, width), np.int32)           # right padding: earlier positions unaffected
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    full = np.asarray(model(jnp.asarray(batch)))
    for i, (p, t) in enumerate(zip(prompts, res.tokens)):
        want = full[i, len(p) - 1: len(p) - 1 + len(t)]
        assert rel(res.logits[i], want) < 1e-5
        assert want.argmax(-1).tolist() == t                 # greedy = argmax of full forward
    # the returned state has consumed prompt + every returned token
    _, state = model(jnp.asarray([seqs[2]]), return_state=True)
    assert rel(res.state.wkv[:, 2], state.wkv[:, 0]) < 1e-5
    assert rel(res.state.tmix_shift[:, 2], state.tmix_shift[:, 0]) < 1e-5


def test_greedy_deterministic_stop_tokens_and_streaming(gen, prompts):
    first = gen.generate(prompts, max_new_tokens=8, sampling=GREEDY)
    assert gen.generate(prompts, max_new_tokens=8, sampling=GREEDY).tokens == first.tokens
    row0 = first.tokens[0]
    cut = next(j for j in range(1, 8) if row0[j] not in row0[:j])
    res = gen.generate(prompts, max_new_tokens=8, sampling=GREEDY, stop_tokens=[row0[cut]])
    assert res.tokens[0] == row0[:cut] and res.finish_reasons[0] == "stop"
    events = list(gen.stream(prompts, max_new_tokens=8, sampling=GREEDY))
    for i in range(3):
        assert [t for r, t in events if r == i] == first.tokens[i]
    seen = []
    gen.generate(prompts, max_new_tokens=8, sampling=GREEDY, on_token=lambda r, t: seen.append((r, t)))
    assert seen == events


def test_step_compiles_once_across_tokens_and_settings(model):
    g = Generator(model, prefill_chunk=8)
    before = TRACES["step"]
    hot = SamplingParams(temperature=0.9, top_p=0.8, top_k=40, repetition_penalty=1.3,
                         presence_penalty=0.4, frequency_penalty=0.2)
    two = [[5, 6, 7], [1, 2, 3, 4]]                  # batch size 2: used by no other test
    a = g.generate(two, max_new_tokens=20, sampling=hot, seed=1)
    assert TRACES["step"] == before + 1 and len(a.tokens[0]) == 20
    b = g.generate(two, max_new_tokens=20, sampling=hot, seed=1)
    c = g.generate(two, max_new_tokens=20, sampling=hot, seed=2)
    d = Generator(model).generate([[9] * 5, [8] * 7], max_new_tokens=20, sampling=SamplingParams(top_k=1))
    greedy = g.generate([[9] * 5, [8] * 7], max_new_tokens=20, sampling=GREEDY)
    assert TRACES["step"] == before + 1                # same for new settings and a new Generator
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert d.tokens == greedy.tokens                   # top_k = 1 is greedy whatever the seed


def test_filter_and_penalties_numbers():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    keep = lambda k, p: np.isfinite(np.asarray(filter_logits(logits, jnp.int32(k), jnp.float32(p))))[0]  # noqa: E731
    assert keep(2, 1.0).tolist() == [True, True, False, False]
    assert keep(0, 0.5).tolist() == [True, True, False, False]     # 0.4 < 0.5 needs the 2nd
    assert keep(0, 0.4).tolist() == [True, False, False, False]
    assert keep(0, 1e-6).tolist() == [True, False, False, False]
    # top-p acts on the top-k-renormalised probabilities (.44, .33, .22): .44 + .33 >= .75
    assert keep(3, 0.75).tolist() == [True, True, False, False]
    assert keep(3, 0.8).tolist() == [True, True, True, False]
    sp = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25).as_arrays()
    out = apply_penalties(jnp.array([[2.0, -2.0, 1.0]]), jnp.array([[1, 2, 0]]), sp)
    np.testing.assert_allclose(np.asarray(out), [[2.0 / 2 - 0.5 - 0.25, -2.0 * 2 - 0.5 - 0.5, 1.0]])
    # sampling frequencies follow the filtered distribution
    keys = jax.random.split(jax.random.key(0), 4000)
    sp1 = SamplingParams(temperature=1.0, top_p=0.5).as_arrays()
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, sp1)[0])(keys))
    assert set(np.unique(draws)) == {0, 1}
    assert abs(np.mean(draws == 0) - 0.4 / 0.7) < 0.03


def test_saved_prompt_state_continues_exactly(gen, tmp_path):
    head, tail = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 7, 9]
    save_state(tmp_path / "s.safetensors", gen.prefill_state([head]), CFG, n_tokens=[len(head)])
    loaded = load_state(tmp_path / "s.safetensors", CFG)
    resumed = gen.generate([tail], max_new_tokens=6, sampling=GREEDY, initial_state=loaded,
                           return_logits=True)
    whole = gen.generate([head + tail], max_new_tokens=6, sampling=GREEDY, return_logits=True)
    assert resumed.tokens == whole.tokens
    assert rel(resumed.logits[0], whole.logits[0]) < 1e-5
    other = ModelConfig(vocab_size=256, n_layer=3, n_embd=64, head_size=32)
    with pytest.raises(ValueError, match="n_layer=2, but this model has n_layer=3"):
        load_state(tmp_path / "s.safetensors", other)


def test_bad_inputs_are_one_line_errors(gen):
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
        gen.generate([[1], []])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        gen.generate([[1, 300]])
    with pytest.raises(ValueError, match="sampling.top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([[1]], max_new_tokens=-1)


def test_cli_generate_greedy(tree, tmp_path, gen):
    save_native(CFG, tree, tmp_path / "ckpt")
    p = add_generate_args(argparse.ArgumentParser())
    args = p.parse_args(["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "Hello", "--temperature",
                         "0", "--max-new-tokens", "6", "--no-stop-at-eod",
                         "--save-state", str(tmp_path / "st.safetensors")])
    out = io.StringIO()
    ids = generate_main(args, out=out)
    want = gen.generate([list(b"Hello")], max_new_tokens=6, sampling=GREEDY)
    assert ids == want.tokens[0]
    assert out.getvalue() == bytes(ids).decode("utf-8", errors="replace") + "\n"
    st = load_state(tmp_path / "st.safetensors", CFG)
    assert rel(st.wkv, want.state.wkv) < 1e-6
