"""The harness core (`HarnessModel`, `PairScorer`, the text conventions) without lm-eval:
log-likelihoods equal `Scorer`'s single pass over the same tokens (shared prefixes and
carried state included), rolling log-likelihoods equal the perplexity code's, generation stops
at `until` strings, and a missing lm_eval is a one-line install hint."""
from __future__ import annotations

import sys

import jax
import numpy as np
import pytest
from flax import nnx

from lwm_jax.eval import Scorer, evaluate_stream
from lwm_jax.eval import batched
from lwm_jax.eval.batched import PairScorer
from lwm_jax.eval.harness import HarnessModel
from lwm_jax.generate import Generator, SamplingParams
from lwm_jax.eval.requests import (cut_at_stop, encode_pair, prefix_ids_for, rolling_head,
                                   rolling_pairs)
from lwm_jax.interop.params import model_from_params
from lwm_jax.interop.testing import random_params
from lwm_jax.models.llama import Llama, LlamaConfig
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.runtime import Runtime
from lwm_jax.tokenizers import ByteTokenizer

CFG = ModelConfig(vocab_size=256, n_layer=2, n_embd=64, head_size=32, decay_lora=16, a_lora=16,
                  v_lora=16, gate_lora=32).resolved()
LLAMA = LlamaConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=96,
                    max_seq_len=48)
TOK = ByteTokenizer()
WIDTH, ROWS = 128, 12     # reference passes are padded to this shape (one compilation)
LONG = "The quick brown fox jumps over the lazy dog, then it naps under the old oak tree."


@pytest.fixture(scope="module")
def rwkv():
    """The token-scan WKV: the same math as the chunked form, and quicker to compile."""
    return model_from_params(CFG, random_params(CFG, seed=4, scale=0.5), "fp32",
                             Runtime(wkv_impl="recurrent"))


@pytest.fixture(scope="module")
def llama():
    m = Llama(LLAMA, "fp32", rngs=nnx.Rngs(3))
    nnx.update(m, jax.tree.map(lambda a: a * 5, nnx.state(m, nnx.Param)))
    return m


@pytest.fixture(scope="module")
def harness(rwkv):
    """window 16, granule 8: long contexts run through several windows and prefix steps."""
    return HarnessModel(rwkv, TOK, batch_size=4, window=16, granule=8)


def reference(model, seqs, n_conts, width=WIDTH):
    """`(log p, greedy)` of each sequence's last `n_cont` tokens from ONE Scorer pass of the
    whole sequence (rows right-padded to `width`)."""
    inputs = np.zeros((ROWS, width), np.int32)
    targets = np.zeros((ROWS, width), np.int32)
    for i, s in enumerate(seqs):
        inputs[i, : len(s) - 1], targets[i, : len(s) - 1] = s[:-1], s[1:]
    nll, hit, _ = Scorer(model).score(inputs, targets)
    out = []
    for i, (s, k) in enumerate(zip(seqs, n_conts)):
        span = slice(len(s) - 1 - k, len(s) - 1)
        out.append((-float(nll[i, span].astype(np.float64).sum()), bool(hit[i, span].all())))
    return out


def test_loglikelihood_equals_scorer_with_shared_prefixes(harness, rwkv, monkeypatch):
    contexts = [LONG, "Q: is it?  ", ""]              # long / trailing spaces / empty
    answers = [" yes", " no", " not at all, thanks."]
    requests = [(c, a) for c in contexts for a in answers] + [("Alone", " here")]
    steps = []                                         # shared-prefix steps actually run
    advance = batched._advance
    monkeypatch.setattr(batched, "_advance", lambda *a: steps.append(1) or advance(*a))
    got = harness.loglikelihood(requests)
    seqs, n_conts = [], []
    for c, a in requests:
        c, a = c.rstrip(), c[len(c.rstrip()):] + a     # trailing spaces join the answer
        seqs.append([0] + list(c.encode()) + list(a.encode()))
        n_conts.append(len(a.encode()))
    want = reference(rwkv, seqs, n_conts)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want):
        assert lp == pytest.approx(ref_lp, rel=2e-6, abs=1e-5) and greedy == ref_greedy
    assert len({round(lp, 3) for lp, _ in got}) == len(got)     # scores differ: rows not mixed
    # batch 1 (LONG x3, Q x1): LONG's 80 shared tokens in 10 steps of 8, Q's 8 alongside;
    # batch 2 (Q x2, "" x2): Q's 8 again; batch 3 shares nothing
    assert len(LONG) == 81 and len(steps) == 10 + 1
    assert harness.n_truncated == 0


def test_greedy_flag_and_state_carried_over_windows(rwkv):
    """A continuation of argmax tokens is greedy; changing its last token makes it not."""
    ctx = [0] + list(LONG.encode())                    # 82 tokens: 10 prefix steps of 8
    cont = Generator(rwkv).generate([ctx] * 4, 5, SamplingParams(temperature=0.0)).tokens[0]
    seq = ctx + cont
    wrong = cont[:-1] + [(cont[-1] + 1) % 256]
    scorer = PairScorer(rwkv, batch_size=4, window=16, granule=8)
    (lp, greedy), (lp2, greedy2), (lp3, _) = scorer.score([(ctx, cont), (ctx, wrong),
                                                          (ctx, cont[:2])])
    (ref, ref_greedy), = reference(rwkv, [seq], [5])
    assert greedy and ref_greedy and not greedy2
    assert lp == pytest.approx(ref, rel=2e-6, abs=1e-5) and lp2 < lp and lp3 > lp


def test_llama_pairs_one_window_and_left_truncation(llama):
    hm = HarnessModel(llama, TOK, batch_size=4)
    requests = [("short", " one"), ("short", " two"), (LONG, " and more words")]
    got = hm.loglikelihood(requests)
    seqs = [[0] + list(c.encode()) + list(a.encode()) for c, a in requests]
    seqs[2] = seqs[2][-(LLAMA.max_seq_len + 1):]       # longer than max_seq_len + 1: cut left
    want = reference(llama, seqs, [len(a.encode()) for _, a in requests], LLAMA.max_seq_len)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want):
        assert lp == pytest.approx(ref_lp, rel=2e-6, abs=1e-5) and greedy == ref_greedy
    assert hm.n_truncated == 1
    with pytest.raises(ValueError, match="max_seq_len=48"):
        hm.loglikelihood([("a", "x" * 60)])


def test_rolling_equals_perplexity_code(harness, rwkv, llama):
    texts = [LONG + " " + LONG, "Short text.", ""]
    got = harness.loglikelihood_rolling(texts)
    scorer = Scorer(rwkv)
    for text, lp in zip(texts[:2], got):
        res = evaluate_stream(scorer, TOK.encode(text), TOK, ctx_len=16)   # prepends EOD 0
        assert lp == pytest.approx(-res.nats, rel=2e-6)
    assert got[2] == 0.0
    # a bounded-context model: disjoint pieces, each with as much context as fits
    hm = HarnessModel(llama, TOK, batch_size=4)
    text = LONG[:70]
    lp, = hm.loglikelihood_rolling([text])
    full = [0] + list(text.encode())
    L = LLAMA.max_seq_len
    seqs = [full[: L + 1], full[len(full) - 1 - L:]]   # predicts 1..L, then the last 70 - L
    want = reference(llama, seqs, [L, len(full) - 1 - L], L)
    assert lp == pytest.approx(want[0][0] + want[1][0], rel=2e-6)


def test_rolling_pairs_predict_every_token_once_with_most_context():
    head, tokens = [0], list(range(1, 12))
    pairs = rolling_pairs(head, tokens, max_len=4)
    assert [c for _, c in pairs] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    assert [ctx for ctx, _ in pairs] == [[0], [4], [7, 8]]
    for ctx, cont in pairs:                            # inputs = ctx + cont[:-1] fill the window
        assert len(ctx) + len(cont) - 1 == 4
    lm_utils = pytest.importorskip("lm_eval.utils")   # the same windows as lm-eval's
    theirs = [lm_utils.make_disjoint_window(w) for w in
              lm_utils.get_rolling_token_windows(tokens, 0, 4, 1)]
    assert [(list(a), list(b)) for a, b in theirs] == pairs


def test_text_conventions():
    class Merging(ByteTokenizer):       # "ab" is one token (id 300): a token across the seam
        def encode(self, text):
            out, i = [], 0
            while i < len(text):
                if text.startswith("ab", i):
                    out.append(300)
                    i += 2
                else:
                    out.append(ord(text[i]))
                    i += 1
            return out
    tok = Merging()
    assert encode_pair(tok, "xa", "b", (0,)) == ([0, ord("x"), ord("a")], [ord("b")])  # fallback
    assert encode_pair(tok, "x ", "ab", ()) == ([ord("x")], [ord(" "), 300])   # space moves
    assert encode_pair(tok, "", "q", ()) == ([0], [ord("q")])      # empty context: EOD
    assert encode_pair(tok, "", "q", (7,)) == ([7], [ord("q")])
    assert prefix_ids_for("newline", TOK) == (10,) and prefix_ids_for("none", TOK) == ()
    assert rolling_head(TOK, ()) == [0]
    with pytest.raises(ValueError, match="prefix: 'bos' is not one of eod, newline, none"):
        prefix_ids_for("bos", TOK)
    assert cut_at_stop("abc\n\ndef", ["\n\n", "c"]) == ("ab", True)
    assert cut_at_stop("abc", ["x", ""]) == ("abc", False)


def test_generate_until_cuts_at_the_first_until_string(harness):
    greedy = {"max_gen_toks": 24}
    prompts = ["Hello", "Once upon a time"]
    full = harness.generate_until([(p, greedy) for p in prompts])
    again = harness.generate_until([(p, greedy) for p in prompts])
    assert full == again and all(0 < len(t) <= 24 for t in full)     # <= 1 character a byte
    requests, want = [], []
    for p, text in zip(prompts, full):
        clean = [ch for ch in text[3:] if ch != "\ufffd"]
        stop = clean[0]                               # a character the model does produce
        requests.append((p, {"until": [stop, "never-produced"], "max_gen_toks": 24}))
        want.append(text[: text.find(stop)])
    assert harness.generate_until(requests) == want
    with pytest.raises(ValueError, match="'num_beams', which is not supported"):
        harness.generate_until([("x", {"num_beams": 2})])


def test_missing_lm_eval_is_a_one_line_install_hint(rwkv, tmp_path, monkeypatch, capsys):
    from lwm_jax.cli import main
    from lwm_jax.interop.native import save_native
    from lwm_jax.interop.params import params_from_model
    save_native(CFG, params_from_model(rwkv), tmp_path / "ckpt")
    monkeypatch.setitem(sys.modules, "lm_eval", None)          # import lm_eval -> ImportError
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
    monkeypatch.delitem(sys.modules, "lwm_jax.eval.lm_eval_adapter", raising=False)
    status = main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--tasks", "piqa"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "pip install 'lwm_jax[eval]'" in err[0]
