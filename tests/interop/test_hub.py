"""Hugging Face Hub interop without a network: Hub names resolve through a local cache
(`HF_HUB_OFFLINE=1`), offline misses and a missing `huggingface_hub` are one line, and an HF
export carries tokenizer files that tokenize exactly like the World tokenizer when read back
by our tokenizers and by transformers' `AutoTokenizer`."""
from __future__ import annotations

import re
import sys
import time

import numpy as np
import pytest

from lwm_jax.cli import main
from lwm_jax.interop import convert, export, load_pretrained, read_params
from lwm_jax.interop import hf, hub
from lwm_jax.interop.native import load_native
from lwm_jax.interop.params import flatten, model_from_params, params_from_model
from lwm_jax.interop.testing import random_params
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.tokenizers import HFTokenizer, WorldTokenizer
from lwm_jax.tokenizers.hf_files import byte_chars, longest_match_regex

CFG = ModelConfig(vocab_size=96, n_layer=2, n_embd=64, head_size=32, decay_lora=16, a_lora=8,
                  v_lora=8, gate_lora=16).resolved()
WORLD_CFG = ModelConfig(vocab_size=65536, n_layer=2, n_embd=32, head_size=32, decay_lora=8,
                        a_lora=8, v_lora=8, gate_lora=8).resolved()
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEXTS = ["Grüße aus Köln — 東京 tokens!\n\n\tend", "  two leading spaces, trailing  ",
         "def f(x):\r\n    return x  # comment\n", "émoji 🙂 and bytes \x01\x7f", ""]


@pytest.fixture(scope="module")
def tree():
    return random_params(CFG, seed=2)


def fake_cache(root, repo: str):
    """The snapshot directory of `repo` in a Hugging Face cache laid out at `root`."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snap = folder / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def assert_same_params(a, b):
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        np.testing.assert_array_equal(np.asarray(fa[key]), np.asarray(fb[key]), err_msg=key)


def test_hub_names_are_told_from_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_name("RWKV/RWKV7-Goose-World3-1.5B-HF")
    assert hub.is_hub_name("BlinkDL/rwkv-7-world/RWKV-x070-World-0.1B-v2.8-20241210-ctx4096.pth")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "x").mkdir()
    for not_hub in ("ckpt/x", "/abs/path", "one", "a/b/c", "../a/b", "a/b/c.safetensors",
                    tmp_path / "RWKV"):
        assert not hub.is_hub_name(not_hub), not_hub


def test_offline_cache_serves_hub_names(tree, offline_cache, tmp_path):
    hf.write_hf(CFG, tree, fake_cache(offline_cache, "RWKV/tiny-test"))
    model, cfg = load_pretrained("RWKV/tiny-test")
    assert cfg == CFG
    assert_same_params(params_from_model(model), read_params(
        offline_cache / "models--RWKV--tiny-test" / "snapshots" / COMMIT)[1])
    convert("RWKV/tiny-test", tmp_path / "ckpt")
    assert_same_params(load_native(tmp_path / "ckpt")[1], params_from_model(model))
    pytest.importorskip("torch")
    from lwm_jax.interop.rwkv_pth import save_pth
    save_pth(CFG, tree, fake_cache(offline_cache, "BlinkDL/rwkv-tiny") / "tiny.pth", dtype="f32")
    cfg2, back = read_params("BlinkDL/rwkv-tiny/tiny.pth")
    assert cfg2 == CFG
    assert_same_params(back, tree)                   # f32 .pth: exact


def test_offline_miss_is_one_line(offline_cache, tmp_path, capsys):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set and it is not in the Hugging "
                                         "Face cache"):
        load_pretrained("RWKV/not-cached")
    status = main(["convert", "--input", "RWKV/not-cached", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and "'RWKV/not-cached': no such local path" in err[0]


def test_missing_huggingface_hub_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ImportError, match=r"pip install 'lwm_jax\[hub\]'") as info:
        load_pretrained("RWKV/anything")
    assert "\n" not in str(info.value)


def test_hf_export_writes_world_tokenizer_files(tmp_path):
    world = WorldTokenizer()
    model = model_from_params(WORLD_CFG, random_params(WORLD_CFG, seed=1))
    out = export(model, tmp_path / "hf", format="hf")            # tokenizer="auto": World
    names = sorted(p.name for p in out.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "rwkv_vocab_v20230424.txt",
            "config.json", "model.safetensors"} <= set(names)
    back = HFTokenizer(out / "tokenizer.json")
    again = WorldTokenizer(out / "rwkv_vocab_v20230424.txt")
    assert back.eod_id == 0 and back.vocab_size == 65530
    for text in TEXTS:
        ids = world.encode(text)
        assert back.encode(text) == ids == again.encode(text), text
        assert back.decode(ids) == text
    cjk = "東京は日本の首都です。" * 300                           # 3300 characters, no spaces
    start = time.perf_counter()
    assert back.encode(cjk) == world.encode(cjk)
    assert time.perf_counter() - start < 2.0                     # linear: ~0.01 s here
    assert read_params(out)[0] == WORLD_CFG                      # the weights still load
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(out))   # local files: no network
    for text in TEXTS:
        assert auto(text)["input_ids"] == world.encode(text), text
        assert auto.decode(world.encode(text)) == text
    assert (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id) == (0, 0, 0)


def test_longest_match_regex_and_byte_table(tmp_path):
    chars = byte_chars()
    assert len(set(chars)) == 256 and chars[ord("A")] == "A" and chars[0] == "\u0100"
    tokens = ["a", "b", "(", "ab", "abc", "b(", "ab(d", "x.*", "x", ".", "*"]
    pattern = re.compile(longest_match_regex(tokens))
    for text in ("abcd", "ab(d", "ab(x", "b(", "x.*", "x.y", "(a"):
        want = max((t for t in tokens if text.startswith(t)), key=len)
        assert pattern.match(text).group() == want, text
    with pytest.raises(ValueError, match="only the hf format stores tokenizer files"):
        export(tmp_path, tmp_path / "x.pth", format="rwkv-pth", tokenizer="world")
