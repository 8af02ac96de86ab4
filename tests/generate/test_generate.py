"""Generation: RNN path == full forward, batching of unequal prompts, sampling, on-device decode
blocks (any block length gives the same result), donation safety, one compile."""
from __future__ import annotations

import argparse
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.cli.args import add_generate_args
from lwm_jax.generate import engine
from lwm_jax.generate.engine import TRACES
from lwm_jax.generate import (Generator, SamplingParams, apply_penalties,
                              filter_logits, generate_main, load_state, sample, save_state)
from lwm_jax.interop.native import save_native
from generate_common import CFG, GREEDY, rel


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


def test_block_compiles_once_across_tokens_and_settings(model):
    g = Generator(model, prefill_chunk=8)
    before = TRACES["block"]
    hot = SamplingParams(temperature=0.9, top_p=0.8, top_k=40, repetition_penalty=1.3,
                         presence_penalty=0.4, frequency_penalty=0.2)
    two = [[5, 6, 7], [1, 2, 3, 4]]                  # batch size 2: used by no other test
    a = g.generate(two, max_new_tokens=20, sampling=hot, seed=1)
    assert TRACES["block"] == before + 1 and len(a.tokens[0]) == 20
    b = g.generate(two, max_new_tokens=20, sampling=hot, seed=1)
    c = g.generate(two, max_new_tokens=20, sampling=hot, seed=2, stop_tokens=[1, 2, 3])
    d = Generator(model).generate([[9] * 5, [8] * 7], max_new_tokens=33,
                                  sampling=SamplingParams(top_k=1), stop_tokens=[0])
    greedy = g.generate([[9] * 5, [8] * 7], max_new_tokens=33, sampling=GREEDY, stop_tokens=[0])
    assert TRACES["block"] == before + 1     # same for new settings, stops and a new Generator
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert d.tokens == greedy.tokens                   # top_k = 1 is greedy whatever the seed


@pytest.fixture(scope="module")
def by_block(model):
    """Ragged prompts (3 of them shorter than one prefill chunk), stop tokens that end two rows
    mid-way, temperature > 0 with penalties: results for decode blocks 1, 16 and 64 (> 30)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, n).tolist() for n in (3, 11, 6, 19)]
    hot = SamplingParams(temperature=1.2, top_p=0.95, repetition_penalty=1.2,
                         frequency_penalty=0.3)
    out = {}
    for block in (1, 16, 64):
        g = Generator(model, prefill_chunk=8, decode_block=block)
        events = []
        res = g.generate(prompts, max_new_tokens=30, sampling=hot, seed=7, return_logits=True,
                         stop_tokens=[17, 42, 99, 200, 231],
                         on_token=lambda r, t: events.append((r, t)))
        out[block] = (res, events)
    return prompts, out


def test_decode_block_length_changes_nothing(by_block):
    _, by_block = by_block
    ref, ref_events = by_block[1]
    # the setting exercises both finish reasons, early stops, forced tokens and full blocks
    assert "stop" in ref.finish_reasons and "length" in ref.finish_reasons
    assert min(map(len, ref.tokens)) < 16 and max(map(len, ref.tokens)) == 30
    assert len(ref_events) == sum(map(len, ref.tokens))
    for block in (16, 64):
        res, events = by_block[block]
        assert res.tokens == ref.tokens and res.finish_reasons == ref.finish_reasons
        assert events == ref_events                     # same streaming order (step, then row)
        for a, b in zip(res.logits, ref.logits):
            assert a.shape == b.shape and (a.size == 0 or rel(a, b) < 1e-6)
        for field in ("tmix_shift", "cmix_shift", "wkv"):
            assert rel(getattr(res.state, field), getattr(ref.state, field)) < 1e-6


def test_final_state_skips_stop_token(model, by_block):
    prompts, by_block = by_block
    res, _ = by_block[16]
    i = res.finish_reasons.index("stop")             # not consumed: state = prompt + returned
    _, want = model(jnp.asarray([prompts[i] + res.tokens[i]]), return_state=True)
    assert rel(res.state.wkv[:, i], want.wkv[:, 0]) < 1e-5
    assert rel(res.state.cmix_shift[:, i], want.cmix_shift[:, 0]) < 1e-5


def test_initial_state_survives_donation(gen, prompts):
    own = gen.prefill_state([[7, 3, 9], [2, 8, 8], [1, 5, 4]])     # 3 rows = batch size below
    copy = jax.tree.map(np.array, own)
    short = [p[:5] for p in prompts]                 # < prefill_chunk: no prefill before decode
    a = gen.generate(short, max_new_tokens=5, sampling=GREEDY, initial_state=own)
    b = gen.generate(short, max_new_tokens=5, sampling=GREEDY, initial_state=own)
    assert not any(x.is_deleted() for x in jax.tree.leaves(own))
    for x, y in zip(jax.tree.leaves(own), jax.tree.leaves(copy)):
        np.testing.assert_array_equal(np.asarray(x), y)
    assert a.tokens == b.tokens and rel(a.state.wkv, b.state.wkv) == 0.0
    # the block really donates its carry (that is why the copy is needed)
    B, V = 3, CFG.vocab_size
    carry = (jax.tree.map(jnp.array, own), jnp.zeros((B, V), jnp.int32), jax.random.key(0),
             jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32),
             jnp.zeros((B, V), jnp.float32), jnp.zeros(B, bool))
    K = gen.decode_block
    new, _ = engine._block(gen._step_graph, False, gen._params, gen._rest, carry,
                           jnp.zeros((K, B), jnp.int32), jnp.zeros((K, B), bool),
                           jnp.zeros(V, bool), jnp.int32(5), GREEDY.as_arrays())
    assert carry[0].wkv.is_deleted() and carry[1].is_deleted() and carry[6].is_deleted()
    assert not new[0].wkv.is_deleted()


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
    plain = SamplingParams(temperature=1.0).as_arrays()           # no top-k / top-p: no filter
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, plain)[0])(keys))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, [0.4, 0.3, 0.2, 0.1],
                               atol=0.03)
    hot = jnp.array([[0.1, 3.0, -1.0], [2.0, 0.5, 1.9]])
    assert np.asarray(sample(hot, keys[0], GREEDY.as_arrays())).tolist() == [1, 0]


def test_saved_prompt_state_continues_exactly(gen, tmp_path):
    head, tail = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 7, 9]
    pre = gen.generate([head], max_new_tokens=0)
    assert rel(pre.state.wkv, gen.prefill_state([head]).wkv) == 0.0
    save_state(tmp_path / "s.safetensors", pre.state, CFG, n_tokens=[len(head)],
               logits=pre.last_logits)
    loaded = load_state(tmp_path / "s.safetensors", CFG)
    resumed = gen.generate([tail], max_new_tokens=6, sampling=GREEDY, initial_state=loaded,
                           return_logits=True)
    whole = gen.generate([head + tail], max_new_tokens=6, sampling=GREEDY, return_logits=True)
    assert resumed.tokens == whole.tokens
    assert rel(resumed.logits[0], whole.logits[0]) < 1e-5
    other = ModelConfig(vocab_size=256, n_layer=3, n_embd=64, head_size=32)
    with pytest.raises(ValueError, match="n_layer=2, but this model has n_layer=3"):
        load_state(tmp_path / "s.safetensors", other)


def test_bad_inputs_are_one_line_errors(model, gen):
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
        gen.generate([[1], []])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        gen.generate([[1, 300]])
    with pytest.raises(ValueError, match="sampling.top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate([[1]], max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"stop_tokens: ids must be integers in \[0, 256\)"):
        gen.generate([[1]], stop_tokens=[0, 256])
    for bad in (0, -3, 2.0, True, "16"):
        with pytest.raises(ValueError, match="decode_block: must be a positive integer"):
            Generator(model, decode_block=bad)


def test_cli_generate_greedy(tree, tmp_path, gen):
    save_native(CFG, tree, tmp_path / "ckpt")
    p = add_generate_args(argparse.ArgumentParser())
    args = p.parse_args(["--checkpoint", str(tmp_path / "ckpt"), "--prompt", "Hello", "--temperature",
                         "0", "--max-new-tokens", "6", "--no-stop-at-eod",
                         "--save-state", str(tmp_path / "st.safetensors")])
    out, err = io.StringIO(), io.StringIO()
    ids = generate_main(args, out=out, err=err)
    want = gen.generate([list(b"Hello")], max_new_tokens=6, sampling=GREEDY)
    assert ids == want.tokens[0]
    # the prompt is echoed before the continuation; the speed summary goes to `err`
    assert out.getvalue() == "Hello" + bytes(ids).decode("utf-8", errors="replace") + "\n"
    assert "prompt 5 tokens, 6 new tokens" in err.getvalue() and "tokens/s" in err.getvalue()
    st = load_state(tmp_path / "st.safetensors", CFG)
    assert rel(st.wkv, want.state.wkv) < 1e-6


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", float("nan")), ("frequency_penalty", float("inf")),
    ("repetition_penalty", float("inf")), ("temperature", float("nan")),
    ("top_k", 2**40), ("top_p", float("nan")),
])
def test_non_finite_or_out_of_range_sampling_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"sampling.{field}: must be") as err:
        SamplingParams(**{field: value})
    assert "\n" not in str(err.value)


def test_a_seed_beyond_int64_is_one_line(tmp_path):
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "lwm_jax.cli", "generate", "--checkpoint",
                          str(tmp_path), "--prompt", "x", "--seed", str(2**64)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--seed: must be an integer in [0, 2**63)" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_the_summary_rate_leaves_out_the_first_token_and_its_compilation():
    """The rate once divided by the whole call, compilation included (12 tokens/s reported
    where decoding ran at ~400), and the line ended in a stray `]`."""
    from lwm_jax.generate.cli import _summary
    line = _summary(5, 101, elapsed=10.25, to_first=10.0, reason="length")
    assert line == ("[generate] prompt 5 tokens, 101 new tokens in 10.25 s: first token after "
                    "10.00 s (prefill + compilation), then 400.0 tokens/s; stopped by length")
    assert _summary(5, 0, 0.5, None, "stop token").endswith("in 0.50 s; stopped by stop token")
