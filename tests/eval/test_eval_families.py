"""`lwm-jax eval --data / --lambada` on the families without a carried state: a LLaMA (windows
of its max_seq_len) and the RWKV-7/attention hybrid (windows of --ctx-len). Reported numbers
are checked against plain forward passes of the loaded model (float64 log-softmax), and the
progress lines on stderr against the order of the start-up stages."""
from __future__ import annotations

import argparse
import io
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax.cli.args import add_eval_args
from lwm_jax.eval import eval_main
from lwm_jax.eval.harness import HarnessModel
from lwm_jax.eval.perplexity import stream_windows
from lwm_jax.eval.requests import rolling_pairs
from lwm_jax.interop import load_pretrained
from lwm_jax.interop.native import save_native
from lwm_jax.interop.params import params_from_model
from lwm_jax.models.hybrid.config import HybridConfig
from lwm_jax.models.hybrid.model import RWKVHybrid
from lwm_jax.models.llama import Llama, LlamaConfig
from lwm_jax.tokenizers import ByteTokenizer

LLAMA = LlamaConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=96,
                    max_seq_len=32)
HYBRID = HybridConfig(vocab_size=256, n_layer=3, n_embd=64, head_size=32, decay_lora=16,
                      a_lora=16, v_lora=16, gate_lora=32, attention_layers=(1,)).resolved()
SHORT = "A short text, one window."                              # 25 bytes < 32
LONG = "The quick brown fox jumps over the lazy dog; then it naps under an oak."   # 72 bytes
LAMBADA = ["the cat sat on the mat", "a bird in the hand",
           "Once upon a time there was a very long sentence that does not fit in thirty-two "
           "bytes of context at all"]
TOK = ByteTokenizer()


def scaled(model, factor: float):
    """Weights (every matrix) `factor` x the init, so that the logits vary between tokens."""
    nnx.update(model, jax.tree.map(lambda a: a * factor if a.ndim >= 2 else a,
                                   nnx.state(model, nnx.Param)))
    return model


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "ckpt"
    save_native(LLAMA, params_from_model(scaled(Llama(LLAMA, "fp32", rngs=nnx.Rngs(3)), 5)),
                path)
    return path


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid") / "ckpt"
    save_native(HYBRID, params_from_model(scaled(RWKVHybrid(HYBRID, "fp32",
                                                            rngs=nnx.Rngs(0)), 3)), path)
    return path


WIDTH = 48      # reference passes are right-padded to this width: one compilation per model
_FORWARD = {}


def forward_logits(model, seq) -> np.ndarray:
    """float64 logits `[len(seq), V]` of one plain forward pass of the whole `seq` (right
    padding to WIDTH: causal models, so earlier positions are unaffected)."""
    if id(model) not in _FORWARD:
        graph, params = nnx.split(model)
        _FORWARD[id(model)] = (model, jax.jit(lambda p, t: nnx.merge(graph, p)(t)), params)
    _, fn, params = _FORWARD[id(model)]
    batch = np.zeros((1, WIDTH), np.int32)
    batch[0, : len(seq)] = seq
    return np.asarray(fn(params, jnp.asarray(batch)), np.float64)[0, : len(seq)]


def forward_nll(model, seq) -> np.ndarray:
    """float64 -log p(seq[t+1] | seq[:t+1]) from one plain forward pass of the whole `seq`."""
    logits = forward_logits(model, seq)[:-1]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -logp[np.arange(len(seq) - 1), np.asarray(seq[1:])]


def windowed_nats(model, seq, window: int) -> float:
    """Every token of `seq[1:]` predicted once, each from the tokens before it inside the
    window of `window` inputs that ends with it (disjoint windows of `window` predictions,
    the last one filled with earlier text): one plain forward pass per window."""
    n, total = len(seq) - 1, 0.0
    for start in range(0, n, window):
        stop = min(start + window, n)
        first = max(0, stop - window)
        total += forward_nll(model, seq[first: stop + 1])[start - first:].sum()
    return total


def run_eval(argv, monkeypatch=None):
    """`eval_main` in-process -> (results, stdout text, stderr text, what stdout and stderr
    held when the checkpoint started loading)."""
    out, err, seen = io.StringIO(), io.StringIO(), {}
    if monkeypatch is not None:
        import lwm_jax.generate.cli as gen_cli
        load = gen_cli.load_model_and_tokenizer

        def spy(args):
            seen["out"], seen["err"] = out.getvalue(), err.getvalue()
            return load(args)
        monkeypatch.setattr(gen_cli, "load_model_and_tokenizer", spy)
    args = add_eval_args(argparse.ArgumentParser()).parse_args(argv)
    results = eval_main(args, out=out, err=err)
    return results, out.getvalue(), err.getvalue(), seen


def test_stream_windows_are_the_rolling_windows_of_lm_eval():
    tokens = list(range(100, 112))                 # head + 11 predicted tokens
    for window in (1, 4, 11, 20):
        pieces = rolling_pairs(tokens[:1], tokens[1:], window)
        spans = list(stream_windows(len(tokens) - 1, window))
        assert [(tokens[first: start + 1], tokens[start + 1: stop + 1])
                for first, start, stop in spans] == pieces


def test_llama_perplexity_and_lambada(llama_ckpt, tmp_path, monkeypatch):
    (tmp_path / "short.txt").write_text(SHORT)
    (tmp_path / "long.txt").write_text(LONG)
    (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    model, _ = load_pretrained(llama_ckpt)
    res, out, err, seen = run_eval(
        ["--checkpoint", str(llama_ckpt), "--data", str(tmp_path / "short.txt"),
         "--lambada", str(tmp_path / "l.jsonl"), "--batch-size", "2"], monkeypatch)
    # the text fits one window: the full-sequence loss of one forward pass
    seq = [0] + list(SHORT.encode())
    ppl = res["perplexity"]
    assert ppl["n_tokens"] == len(SHORT) and ppl["window"] == 32 and not ppl["state_carried"]
    assert ppl["loss"] == pytest.approx(forward_nll(model, seq).mean(), rel=1e-5)
    assert ppl["perplexity"] == pytest.approx(math.exp(forward_nll(model, seq).mean()), rel=1e-5)
    # LAMBADA: target nats from plain forward passes; the long example loses its left context
    nats, hits = [], []
    for text in LAMBADA:
        cut = text.rfind(" ")
        ctx, tgt = list(text[:cut].encode()), list(text[cut:].encode())   # no prefix
        s = (ctx + tgt)[-(LLAMA.max_seq_len + 1):]
        logits = forward_logits(model, s)[len(s) - 1 - len(tgt): len(s) - 1]
        nats.append(forward_nll(model, s)[-len(tgt):].sum())
        hits.append(logits.argmax(-1).tolist() == tgt)
    lam = res["lambada"]
    assert lam["n"] == 3 and lam["n_truncated"] == 1 and lam["n_correct"] == sum(hits)
    assert lam["perplexity"] == pytest.approx(math.exp(np.mean(nats)), rel=1e-5)
    assert json.loads(out) == res
    # progress: a stage line before the checkpoint loads (nothing on stdout yet), then more
    assert seen["out"] == "" and seen["err"].startswith("[eval] loading checkpoint")
    assert "llama model" in err and "windows of 32 tokens (its max_seq_len" in err
    assert "[eval] perplexity:" in err and "[eval] lambada:" in err and "compiling" in err
    assert "1 of 3 contexts were cut from the left to fit 32 tokens" in err

    # a text over several windows: each token once, from the text inside its window
    res, *_ = run_eval(["--checkpoint", str(llama_ckpt), "--data", str(tmp_path / "long.txt"),
                        "--batch-size", "2"])
    ppl = res["perplexity"]
    seq = [0] + list(LONG.encode())
    want = windowed_nats(model, seq, LLAMA.max_seq_len)
    assert ppl["n_tokens"] == len(LONG) and ppl["n_bytes"] == len(LONG)
    assert ppl["loss"] * ppl["n_tokens"] == pytest.approx(want, rel=1e-5)
    assert want != pytest.approx(windowed_nats(model, seq, 16), rel=1e-3)   # window matters
    # the same windows as lm-eval's loglikelihood_rolling (--tasks)
    rolling, = HarnessModel(model, TOK, batch_size=2).loglikelihood_rolling([LONG])
    assert -rolling == pytest.approx(want, rel=1e-5)


def test_hybrid_perplexity_and_lambada_in_ctx_len_windows(hybrid_ckpt, tmp_path):
    (tmp_path / "long.txt").write_text(LONG)
    (tmp_path / "l.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                              for t in LAMBADA[:2]))
    model, _ = load_pretrained(hybrid_ckpt)
    res, _, err, _ = run_eval(["--checkpoint", str(hybrid_ckpt), "--data",
                               str(tmp_path / "long.txt"), "--lambada",
                               str(tmp_path / "l.jsonl"), "--ctx-len", "32"])
    ppl = res["perplexity"]
    seq = [0] + list(LONG.encode())
    assert ppl["n_tokens"] == len(LONG) and ppl["window"] == 32 and not ppl["state_carried"]
    assert ppl["loss"] * ppl["n_tokens"] == pytest.approx(windowed_nats(model, seq, 32),
                                                          rel=1e-5)
    nats = []
    for text in LAMBADA[:2]:                        # both fit 32 tokens: nothing cut
        cut = text.rfind(" ")
        ctx, tgt = list(text[:cut].encode()), list(text[cut:].encode())   # no prefix
        nats.append(forward_nll(model, ctx + tgt)[-len(tgt):].sum())
    lam = res["lambada"]
    assert lam["n"] == 2 and lam["n_truncated"] == 0
    assert lam["perplexity"] == pytest.approx(math.exp(np.mean(nats)), rel=1e-5)
    assert "rwkv7-hybrid model" in err and "windows of 32 tokens (--ctx-len" in err


def test_bad_paths_are_one_line_before_any_stage(llama_ckpt, tmp_path, capsys):
    """A missing checkpoint or data file is found before the first stage line: the error is
    the only line on stderr and costs no checkpoint load."""
    from lwm_jax.cli import main
    (tmp_path / "t.txt").write_text(SHORT)
    for argv, name in ((["--checkpoint", str(tmp_path / "no-such-ckpt"), "--data",
                         str(tmp_path / "t.txt")], "no-such-ckpt"),
                       (["--checkpoint", str(llama_ckpt), "--data",
                         str(tmp_path / "no-such.txt")], "no-such.txt")):
        status = main(["eval", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1 and name in err[0], err


def test_eval_cli_module_imports_no_jax():
    """`lwm-jax eval` imports `lwm_jax.eval.cli` before its first stage line: it must not pull
    in jax (or lm_eval), whose import alone takes seconds on a cold start."""
    code = ("import sys, lwm_jax.eval.cli; "
            "print(sorted(m for m in ('jax', 'flax', 'lm_eval') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"
