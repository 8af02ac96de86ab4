"""Scoring: perplexity / bits-per-byte and LAMBADA accuracy against direct computations."""
from __future__ import annotations

import argparse
import io
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.data.binidx import write_binidx
from lwm_jax.cli.args import add_eval_args
from lwm_jax.eval import (PairScorer, Scorer, eval_main, evaluate_stream,
                          last_word_accuracy, load_stream, read_jsonl, split_last_word)
from lwm_jax.interop.native import save_native
from lwm_jax.interop.params import model_from_params
from lwm_jax.interop.testing import random_params
from lwm_jax.tokenizers import ByteTokenizer

CFG = ModelConfig(vocab_size=256, n_layer=2, n_embd=64, head_size=32, decay_lora=16, a_lora=16,
                  v_lora=16, gate_lora=32).resolved()
TEXT = "Grüße aus Köln — RWKV-7 liest Bytes, nicht Wörter. 東京 tokens!\n" * 2   # 2-/3-byte chars


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=4, scale=0.5)


@pytest.fixture(scope="module")
def model(tree):
    return model_from_params(CFG, tree)


@pytest.fixture(scope="module")
def scorer(model):
    return Scorer(model)


def direct_nll(model, seq):
    """float64 -log p(seq[t+1] | seq[:t+1]) from one full forward pass (float64 log-softmax)."""
    logits = np.asarray(model(jnp.asarray([seq])), np.float64)[0, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -logp[np.arange(len(seq) - 1), np.asarray(seq[1:])]


def test_text_perplexity_and_bits_per_byte(model, scorer, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(TEXT, encoding="utf-8")
    tok = ByteTokenizer()
    res = evaluate_stream(scorer, load_stream(path, tok), tok, ctx_len=16)   # 9 windows, state carried
    nll = direct_nll(model, [0] + list(TEXT.encode("utf-8")))
    assert res.n_tokens == len(nll) and res.n_bytes == path.stat().st_size
    assert abs(res.nats - nll.sum()) / nll.sum() < 1e-5
    assert res.bits_per_byte == pytest.approx(res.nats / math.log(2) / path.stat().st_size, rel=1e-12)
    assert res.perplexity == pytest.approx(math.exp(res.nats / res.n_tokens), rel=1e-12)
    assert res.bits_per_byte > 1.0            # a random model is far from compressing text


def test_binidx_stream_counts_document_bytes(model, scorer, tmp_path):
    docs = [list("ab c".encode()), list("Ünï".encode()), list(b"xyz" * 5)]
    write_binidx(tmp_path / "d", docs, dtype=np.uint16, append_eod=True)
    stream = load_stream(tmp_path / "d.bin")
    assert stream.tolist() == docs[0] + [0] + docs[1] + [0] + docs[2] + [0]
    res = evaluate_stream(scorer, stream, ByteTokenizer(), ctx_len=16, max_tokens=len(stream) - 3)
    nll = direct_nll(model, [0] + stream.tolist()[:-3])
    assert res.n_tokens == len(stream) - 3
    assert res.n_bytes == len(docs[0]) + len(docs[1]) + len(docs[2]) - 2     # EODs are 0 bytes
    assert abs(res.nats - nll.sum()) / nll.sum() < 1e-5


def padded_logp(model, seqs, width=32):
    """float64 log-probs `[n, width, V]` of right-padded rows (one compile for every call)."""
    batch = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    logits = np.asarray(model(jnp.asarray(batch)), np.float64)
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_lambada_accuracy_and_perplexity_match_direct_greedy(model, scorer):
    rng = np.random.default_rng(1)
    contexts = [rng.integers(1, 256, n).tolist() for n in (9, 14, 20, 6)]
    t1 = [int(lp[len(c) - 1].argmax()) for lp, c in zip(padded_logp(model, contexts), contexts)]
    longer = [c + [a] for c, a in zip(contexts, t1)]
    t2 = [int(lp[len(c) - 1].argmax()) for lp, c in zip(padded_logp(model, longer), longer)]
    targets = [[t1[0], t2[0]], [t1[1], (t2[1] + 1) % 256], [(t1[2] + 1) % 256], [t1[3]]]
    examples = list(zip(contexts, targets))
    res = last_word_accuracy(PairScorer(model, batch_size=3), examples)
    assert res.n == 4 and res.n_correct == 2 and res.n_truncated == 0       # rows 0 and 3: every target token is greedy
    seqs = [c + t for c, t in examples]
    direct = [-sum(lp[len(c) - 1 + j, tok] for j, tok in enumerate(t))
              for lp, (c, t) in zip(padded_logp(model, seqs), examples)]
    np.testing.assert_allclose(res.target_nats, direct, rtol=1e-5)
    assert res.perplexity == pytest.approx(math.exp(np.mean(direct)), rel=1e-5)


def test_jsonl_parsing_and_last_word_split(tmp_path):
    assert split_last_word("the cat sat  ") == ("the cat", " sat")
    with pytest.raises(ValueError, match="no 'context last-word' split"):
        split_last_word("single")
    path = tmp_path / "l.jsonl"
    path.write_text('{"text": "a b c"}\n\n{"text": "d e"}\n')
    assert read_jsonl(path) == ["a b c", "d e"]
    path.write_text('{"text": "a b"}\n{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"l.jsonl:2: expected an object with a string 'text'"):
        read_jsonl(path)


def test_eval_cli_end_to_end(tree, model, scorer, tmp_path):
    save_native(CFG, tree, tmp_path / "ckpt")
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    lines = [{"text": "Grüße aus Köln"}, {"text": "RWKV-7 liest Bytes"}]
    (tmp_path / "l.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    args = add_eval_args(argparse.ArgumentParser()).parse_args(
        ["--checkpoint", str(tmp_path / "ckpt"), "--data", str(tmp_path / "t.txt"), "--ctx-len",
         "16", "--lambada", str(tmp_path / "l.jsonl"), "--output", str(tmp_path / "r.json")])
    out = io.StringIO()
    results = eval_main(args, out=out)
    tok = ByteTokenizer()
    want = evaluate_stream(scorer, load_stream(tmp_path / "t.txt", tok), tok, ctx_len=16)
    assert results["perplexity"]["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-6)
    assert results["perplexity"]["window"] == 16 and results["perplexity"]["state_carried"]
    examples = [(list(b"Gr\xc3\xbc\xc3\x9fe aus"), list(b" K\xc3\xb6ln")),
                (list(b"RWKV-7 liest"), list(b" Bytes"))]
    lam = last_word_accuracy(PairScorer(model), examples)
    assert results["lambada"]["perplexity"] == pytest.approx(lam.perplexity, rel=1e-6)
    printed = json.loads(out.getvalue())           # one object, the same as the --output file
    assert printed == json.loads((tmp_path / "r.json").read_text()) == results
    assert printed["lambada"]["n"] == 2 and set(printed) == {"perplexity", "lambada"}
    with pytest.raises(ValueError, match="give --data"):
        eval_main(add_eval_args(argparse.ArgumentParser()).parse_args(
            ["--checkpoint", str(tmp_path / "ckpt")]))


@pytest.mark.parametrize("flag,value", [("--max-examples", "-1"), ("--max-examples", "0"),
                                        ("--max-tokens", "0"), ("--batch-size", "0"),
                                        ("--ctx-len", "-5")])
def test_count_options_below_their_least_value_are_refused(tmp_path, flag, value):
    """`--max-examples -1` once scored one example; every count is checked before anything
    is loaded, for --data and --lambada as for --tasks."""
    p = argparse.ArgumentParser()
    add_eval_args(p)
    (tmp_path / "l.jsonl").write_text('{"text": "a b"}\n')
    args = p.parse_args(["--checkpoint", str(tmp_path / "none"), "--lambada",
                         str(tmp_path / "l.jsonl"), flag, value])
    with pytest.raises(ValueError, match=rf"{flag}: must be >= \d, got {value}"):
        eval_main(args, out=io.StringIO())
