"""Continuing a saved state without new text: the state file stores the logits of its last
position (format 2), so the next token is drawn from them. Greedy continuation equals one
uninterrupted run; format-1 files still load with a prompt and refuse an empty one in one line;
damaged logits in a file are one line; families without a state file refuse in one line."""
from __future__ import annotations

import argparse
import io

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lwm_jax.cli import main as cli_main
from lwm_jax.cli.args import add_generate_args
from lwm_jax.generate import (generate_main, load_state, load_state_file,
                              save_state)
from lwm_jax.generate.state_io import FORMAT, FORMAT_V1
from lwm_jax.interop.native import save_native
from generate_common import CFG, GREEDY, rel


@pytest.fixture(scope="module")
def ckpt(tree, tmp_path_factory):
    return str(save_native(CFG, tree, tmp_path_factory.mktemp("ck") / "ckpt"))


@pytest.fixture(scope="module")
def saved(gen, tmp_path_factory):
    """A format-2 file of one row (prompt + 4 greedy tokens) and its tensors and metadata."""
    path = tmp_path_factory.mktemp("st") / "good.safetensors"
    res = gen.generate([[3, 1, 4, 1, 5]], max_new_tokens=4, sampling=GREEDY)
    save_state(path, res.state, CFG, n_tokens=[9], logits=res.last_logits)
    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    return path, load_file(str(path)), meta


def _cli(argv):
    p = add_generate_args(argparse.ArgumentParser())
    out, err = io.StringIO(), io.StringIO()
    ids = generate_main(p.parse_args(argv), out=out, err=err)
    return ids, out.getvalue(), err.getvalue()


def test_empty_prompts_continue_a_saved_state_like_one_uninterrupted_run(model, gen, tmp_path):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (21, 13, 30)]
    N, M = 5, 7
    first = gen.generate(prompts, max_new_tokens=N, sampling=GREEDY)
    # last_logits are the full forward's logits at each row's last consumed position
    assert first.last_logits.shape == (3, 256) and first.last_logits.dtype == np.float32
    seqs = [p + t for p, t in zip(prompts, first.tokens)]
    batch = np.zeros((3, max(map(len, seqs))), np.int32)   # right padding: earlier positions
    for i, s in enumerate(seqs):                           # are unaffected
        batch[i, : len(s)] = s
    full = np.asarray(model(jnp.asarray(batch)))
    for i, s in enumerate(seqs):
        assert rel(first.last_logits[i], full[i, len(s) - 1]) < 1e-5
    save_state(tmp_path / "s.safetensors", first.state, CFG, logits=first.last_logits,
               n_tokens=[len(p) + N for p in prompts])
    loaded = load_state_file(tmp_path / "s.safetensors", CFG)
    np.testing.assert_array_equal(loaded.logits, first.last_logits)
    assert loaded.n_tokens == [26, 18, 35]
    tail = [7, 7, 2]
    resumed = gen.generate([[], tail, []], max_new_tokens=M, sampling=GREEDY, return_logits=True,
                           initial_state=loaded.state, initial_logits=loaded.logits)
    whole = gen.generate(prompts, max_new_tokens=N + M, sampling=GREEDY)
    assert resumed.tokens[0] == whole.tokens[0][N:] and resumed.tokens[2] == whole.tokens[2][N:]
    np.testing.assert_array_equal(resumed.logits[0][0], loaded.logits[0])   # drawn from them
    with_tail = gen.generate([prompts[1] + first.tokens[1] + tail], M, GREEDY)
    assert resumed.tokens[1] == with_tail.tokens[0]            # a prompt row: as before
    assert len({tuple(t) for t in whole.tokens}) == 3          # the rows really differ
    # the final state and logits match the uninterrupted run's too
    assert rel(resumed.state.wkv[:, 0], whole.state.wkv[:, 0]) < 1e-6
    assert rel(resumed.last_logits[2], whole.last_logits[2]) < 1e-6


def test_a_row_stopped_by_a_stop_token_continues_with_that_token(gen):
    prompt = [9, 8, 7, 6, 5, 4]
    whole = gen.generate([prompt], max_new_tokens=12, sampling=GREEDY).tokens[0]
    k = next(j for j in range(1, 12) if whole[j] not in whole[:j])
    cut = gen.generate([prompt], max_new_tokens=12, sampling=GREEDY, stop_tokens=[whole[k]])
    assert cut.tokens[0] == whole[:k] and cut.finish_reasons == ["stop"]
    # the stop token was not consumed: the saved logits still produce it first
    more = gen.generate([[]], max_new_tokens=12 - k, sampling=GREEDY, initial_state=cut.state,
                        initial_logits=cut.last_logits[0])
    assert more.tokens[0] == whole[k:]
    zero = gen.generate([[]], max_new_tokens=0, initial_state=cut.state,
                        initial_logits=cut.last_logits)         # nothing consumed, nothing made
    assert zero.tokens == [[]] and rel(zero.state.wkv, cut.state.wkv) == 0.0
    np.testing.assert_array_equal(zero.last_logits, cut.last_logits)


def test_cli_continues_without_a_prompt_exactly(ckpt, gen, tmp_path):
    """Hello + 5 tokens saved; `--prompt ""` adds 4 and saves again; no prompt adds 3: the
    9 + 3 tokens are those of one greedy run of 12, and the counts in the files add up."""
    common = ["--checkpoint", ckpt, "--temperature", "0", "--no-stop-at-eod"]
    s1, s2 = str(tmp_path / "s1.safetensors"), str(tmp_path / "s2.safetensors")
    a, _, _ = _cli(common + ["--prompt", "Hello", "--max-new-tokens", "5", "--save-state", s1])
    b, out, err = _cli(common + ["--prompt", "", "--max-new-tokens", "4", "--load-state", s1,
                                 "--save-state", s2])
    c, _, _ = _cli(common + ["--max-new-tokens", "3", "--load-state", s2, "--no-echo"])
    whole = gen.generate([list(b"Hello")], max_new_tokens=12, sampling=GREEDY).tokens[0]
    assert (a, b, c) == (whole[:5], whole[5:9], whole[9:])
    assert out == bytes(b).decode("utf-8", errors="replace") + "\n"    # nothing to echo
    assert "prompt 0 tokens, 4 new tokens" in err
    assert load_state_file(s1, CFG).n_tokens == [10] and load_state_file(s2, CFG).n_tokens == [14]


def _write_v1(path, tensors, meta):
    """A file as the previous version wrote it: no logits, format 1."""
    save_file({k: v for k, v in tensors.items() if k != "logits"}, str(path),
              metadata={**meta, "format": FORMAT_V1})


def test_an_old_state_file_loads_with_a_prompt_and_refuses_an_empty_one(saved, ckpt, gen,
                                                                         tmp_path, capsys):
    path, tensors, meta = saved
    old = tmp_path / "old.safetensors"
    _write_v1(old, tensors, meta)
    got = load_state_file(old, CFG)
    assert got.logits is None and rel(got.state.wkv, load_state(path, CFG).wkv) == 0.0
    common = ["generate", "--checkpoint", ckpt, "--temperature", "0", "--no-stop-at-eod",
              "--max-new-tokens", "3", "--load-state", str(old)]
    for no_text in (["--prompt", ""], []):
        assert cli_main(common + no_text) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "old.safetensors' predates stored logits" in err and "--prompt" in err
        assert "save the state again" in err
    ids, _, _ = _cli(common[1:] + ["--prompt", "Hi"])               # with text: as before
    want = gen.generate([list(b"Hi")], max_new_tokens=3, sampling=GREEDY,
                        initial_state=got.state).tokens[0]
    assert ids == want


def test_no_prompt_without_load_state_is_one_line(ckpt, capsys):
    assert cli_main(["generate", "--checkpoint", ckpt]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--prompt: no prompt given" in err, err
    assert cli_main(["generate", "--checkpoint", ckpt, "--prompt", ""]) == 2
    assert "--prompt: empty after tokenization" in capsys.readouterr().err


@pytest.mark.parametrize("bad,message", [
    (np.zeros((1, 255), np.float32), r"'logits' has shape \[1, 255\], expected \[B, 256\]"),
    (np.zeros((2, 256), np.float32), r"'logits' has shape \[2, 256\], expected \[B, 256\]"),
    (np.zeros(256, np.float32), r"'logits' has shape \[256\], expected \[B, 256\]"),
    (np.zeros((1, 256), np.float16), r"'logits' has dtype float16, expected float32"),
    (np.zeros((1, 256), np.float64), r"'logits' has dtype float64, expected float32"),
    (np.zeros((1, 256), np.int32), r"'logits' has dtype int32, expected float32"),
    (np.full((1, 256), np.nan, np.float32), r"'logits' holds NaN/inf"),
    (np.array([[0.0] * 255 + [np.inf]], np.float32), r"'logits' holds NaN/inf"),
    (None, r"tensor 'logits' is missing"),
])
def test_damaged_logits_in_a_state_file_are_one_line(saved, tmp_path, bad, message):
    _, tensors, meta = saved
    path = tmp_path / "bad.safetensors"
    rest = {k: v for k, v in tensors.items() if k != "logits"}
    save_file(rest if bad is None else {**rest, "logits": bad}, str(path), metadata=meta)
    with pytest.raises(ValueError, match=message) as err:
        load_state_file(path, CFG)
    assert "\n" not in str(err.value) and "bad.safetensors" in str(err.value)


def test_damaged_logits_through_the_cli_are_one_line(saved, ckpt, tmp_path, capsys):
    _, tensors, meta = saved
    path = tmp_path / "nan.safetensors"
    save_file({**tensors, "logits": np.full((1, 256), np.nan, np.float32)}, str(path),
              metadata=meta)
    assert meta["format"] == FORMAT
    for text in (["--prompt", "x"], []):         # a damaged file is refused, prompt or not
        assert cli_main(["generate", "--checkpoint", ckpt, "--load-state", str(path)] + text) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "tensor 'logits' holds NaN/inf" in err, err


def test_unusable_logits_are_refused_when_saving_and_generating(gen, saved, tmp_path):
    path, _, _ = saved
    got = load_state_file(path, CFG)
    for bad, message in ((np.zeros((1, 255), np.float32), r"logits has shape \[1, 255\]"),
                         (np.full(256, np.inf, np.float32), "logits holds NaN/inf")):
        with pytest.raises(ValueError, match=message):
            save_state(tmp_path / "x.safetensors", got.state, CFG, logits=bad)
    assert not (tmp_path / "x.safetensors").exists()
    for rows in (2, 3):                  # one row per row of the (one-row) state, not prompt
        with pytest.raises(ValueError, match=rf"initial_logits: shape \[{rows}, 256\] "
                                             r"\(float32\), expected float \[1, 256\]"):
            gen.generate([[], []], 2, GREEDY, initial_state=got.state,
                         initial_logits=np.zeros((rows, 256), np.float32))
    with pytest.raises(ValueError, match="initial_logits: hold NaN/inf"):
        gen.generate([[]], 2, GREEDY, initial_state=got.state,
                     initial_logits=np.full(256, np.nan, np.float32))
    with pytest.raises(ValueError, match="initial_logits: given without the initial_state"):
        gen.generate([[]], 2, GREEDY, initial_logits=got.logits)
    with pytest.raises(ValueError, match=r"prompts\[0\]: empty prompt"):
        gen.generate([[]], 2, GREEDY, initial_state=got.state)       # no logits: needs text


def test_families_without_a_state_file_refuse_in_one_line(monkeypatch, saved, tmp_path):
    """A hybrid cannot generate and a LLaMA's KV cache is not saved: --save-state and
    --load-state (with or without a prompt) are one line naming the family's reason."""
    from flax import nnx

    from lwm_jax.generate import cli as gen_cli
    from lwm_jax.models.hybrid import HybridConfig, RWKVHybrid
    from lwm_jax.models.llama import Llama, LlamaConfig
    from lwm_jax.tokenizers import get_tokenizer
    path, _, _ = saved
    hybrid = HybridConfig(vocab_size=256, n_layer=2, n_embd=32, head_size=16,
                          attention_layers=(1,))
    llama = LlamaConfig(vocab_size=256, n_layer=1, n_embd=32, n_head=2, n_kv_head=1,
                        ffn_hidden=48, max_seq_len=64)
    for cls, cfg, reason in ((RWKVHybrid, hybrid, "rwkv7-hybrid model cannot generate yet"),
                             (Llama, llama, "llama model decodes from a KV cache")):
        m = cls(cfg, "fp32", rngs=nnx.Rngs(0))
        monkeypatch.setattr(gen_cli, "load_model_and_tokenizer",
                            lambda args, m=m, cfg=cfg: (m, cfg, get_tokenizer("byte")))
        for extra in (["--save-state", str(tmp_path / "o.safetensors"), "--prompt", "x"],
                      ["--load-state", str(path), "--prompt", ""], ["--load-state", str(path)]):
            flag = extra[0]
            with pytest.raises(ValueError, match=f"{flag}: only RWKV-7 models have a state "
                                                 f"file; this {reason}") as err:
                _cli(["--checkpoint", "unused"] + extra)
            assert "\n" not in str(err.value)
