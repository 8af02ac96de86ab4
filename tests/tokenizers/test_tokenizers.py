"""Byte, RWKV World (against the official tokenizer) and Hugging Face tokenizers."""
import importlib.util

import numpy as np
import pytest

from lwm_jax.tokenizers import ByteTokenizer, HFTokenizer, WorldTokenizer, get_tokenizer
from lwm_jax.tokenizers.world import find_world_vocab, read_world_vocab

SAMPLE = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159 o'clock!\n"
    "中文：人工智能正在改变世界，这是一个测试句子。\n"
    "日本語：吾輩は猫である。名前はまだ無い。カタカナとひらがな。\n"
    "한국어 문장입니다. Русский текст, Ελληνικά, عربى, हिन्दी\n"
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇺🇸\n"
    "def f(x):\n\treturn {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n"
    "    indented\n        more\n\n\n\n" + " " * 200 + "\t\t\t\r\n" + "-" * 90 + "=" * 33 + "\n"
    "café naïve façade Ünïcödé “quotes” — dash … ellipsis\n"
)


def _random_text(seed, n_chars):
    """Mixed-script text from a seeded generator: ASCII words, whitespace runs, CJK, kana, emoji."""
    rng = np.random.default_rng(seed)
    ranges = [(0x20, 0x7E), (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0x0400, 0x04FF), (0x1F300, 0x1F64F),
              (0x00A0, 0x00FF), (0xAC00, 0xD7A3)]
    words = ["the", " and", "def ", "return", "self.", "  ", "\n", "\t", "    ", "=", "()", "的", "是"]
    parts = []
    while sum(map(len, parts)) < n_chars:
        if rng.random() < 0.5:
            parts.append(words[rng.integers(len(words))])
        else:
            lo, hi = ranges[rng.integers(len(ranges))]
            parts.append("".join(chr(c) for c in rng.integers(lo, hi + 1, size=rng.integers(1, 6))))
    return "".join(parts)


# ------------------------------------------------------------------------------------------ byte
def test_byte_round_trips_text_and_bytes():
    tok = ByteTokenizer()
    text = SAMPLE + "\x00 nul inside"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert (tok.vocab_size, tok.eod_id) == (256, 0)
    data = bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8))
    assert tok.decode_bytes(tok.encode_bytes(data)) == data
    np.testing.assert_array_equal(tok.encode_array(text), ids)
    assert tok.decode_bytes(np.array(ids)) == text.encode("utf-8")
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a cut character decodes to U+FFFD
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 256\), got 300"):
        tok.decode([1, 300])
    with pytest.raises(TypeError, match="encode_bytes"):
        tok.encode(b"abc")


# ------------------------------------------------------------------------------------------ world
def _tiny_vocab(path, extra):
    lines = [f"{b + 1} {bytes([b])!r} 1" for b in range(256)]
    lines += [f"{257 + i} {t!r} {len(t.encode('utf-8') if isinstance(t, str) else t)}" for i, t in enumerate(extra)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_world_greedy_longest_match_on_tiny_vocab(tmp_path):
    tok = WorldTokenizer(_tiny_vocab(tmp_path / "v.txt", ["ab", "abcd", "bc", "é", b"\xff\xfe"]))
    a, b, c, x = (ord(ch) + 1 for ch in "abcx")
    # "abcx": "abcd" does not match, so the walk falls back to the longest token ending earlier ("ab")
    assert tok.encode("abcx") == [257, c, x]
    assert tok.encode("abcdbc") == [258, 259]
    assert tok.encode("é") == [260]
    assert tok.encode_bytes(b"\xff\xfe\xff") == [261, 256]
    assert tok.decode_bytes([261, 0, 257]) == b"\xff\xfeab"  # id 0 (end of document) is empty
    with pytest.raises(ValueError, match="id 999 is not in the World vocabulary"):
        tok.decode([1, 999])
    with pytest.raises(ValueError, match="id -1 is not in the World vocabulary"):
        tok.decode([-1])


@pytest.mark.parametrize("line, message", [
    ("257 'ab' 3", "token is 2 bytes but the line says 3"),
    ("257 __import__('os').system('echo pwned') 5", "cannot parse vocabulary entry"),
    ("5 'zz' 2", "id 5 is duplicated"),
    ("257 b'a' 1", "already has id 98"),
    ("257 12 2", "must be a non-empty str or bytes"),
    ("nonsense", "expected '<id> <literal> <n_bytes>'"),
    # a huge id once allocated a [None] * (id + 1) table: MemoryError instead of a message
    ("1000000000000000 'zz' 2", "id 1000000000000000 is too large"),
])
def test_world_vocab_errors_name_file_and_line(tmp_path, line, message):
    path = _tiny_vocab(tmp_path / "v.txt", [])
    path.write_text(path.read_text() + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        read_world_vocab(path)
    assert f"{path}:257" in str(err.value)


def test_world_vocab_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="World vocabulary file .* not found"):
        get_tokenizer(f"world:{tmp_path}/none.txt")


def _official_vocab():
    try:
        return find_world_vocab()
    except FileNotFoundError:
        return None


needs_vocab = pytest.mark.skipif(_official_vocab() is None, reason="rwkv_vocab_v20230424.txt not available")


@pytest.fixture(scope="module")
def world():
    return WorldTokenizer()


@needs_vocab
def test_world_matches_official_tokenizer(world):
    if importlib.util.find_spec("rwkv") is None:
        pytest.skip("the rwkv package (official tokenizer) is not installed")
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
    official = TRIE_TOKENIZER(str(world.vocab_path))
    texts = [SAMPLE, _random_text(0, 30_000), _random_text(1, 3_000), "a", " ", "\n\n", "x" * 1000]
    for text in texts:
        ids = world.encode(text)
        assert ids == official.encode(text)
        assert world.decode(ids) == text
    assert world.vocab_size == 65536 and world.eod_id == 0
    assert max(world.encode(SAMPLE)) <= 65529 and min(world.encode(SAMPLE)) >= 1


@needs_vocab
def test_world_known_ids_and_bytes_round_trip(world):
    # ids read from the vocabulary file: "\n" is line 11 (byte 10 -> id 11); a 128-space token is 65529
    assert world.encode("\n") == [11]
    assert world.encode(" " * 128) == [65529]
    data = bytes(np.random.default_rng(5).integers(0, 256, 5000, dtype=np.uint8))  # not UTF-8
    assert world.decode_bytes(world.encode_bytes(data)) == data


# ------------------------------------------------------------------------------- world, fast path
def _varied_texts():
    rng = np.random.default_rng(7)
    parts = ["The quick brown fox <|endoftext|> jumps.", "中华人民共和国是一个国家。我们今天去公园",
             "😀🎉👍🏽 emoji ", "Привет мир! ", "\t\x01\x02\x7f control ", " " * 300, "\n" * 40,
             "def f(x):\n        return x + 12345\n", "#" * 90, "a" * 700, "é" * 33]
    texts = ["", "a", "<|endoftext|>", SAMPLE, _random_text(3, 20_000)]
    texts += ["".join(rng.choice(parts, 60)) for _ in range(4)]
    return texts


@needs_vocab
def test_world_fast_path_equals_the_trie_walk(world):
    from lwm_jax.tokenizers.world import FAST_MIN_BYTES
    texts = _varied_texts()
    for text in texts:
        data = text.encode("utf-8")
        ref = world.encode_bytes_trie(data)
        assert world._fast.encode(data).tolist() == ref, text[:40]
        assert world.encode_array(text).tolist() == ref
        assert world.encode(text) == ref  # short texts take the trie, long ones the fast path
    assert any(len(t.encode()) >= FAST_MIN_BYTES for t in texts)
    batch = world.encode_many_arrays(texts)
    assert [ids.tolist() for ids in batch] == [world.encode_bytes_trie(t.encode()) for t in texts]
    # "<|endoftext|>" is plain text here (unlike the exported tokenizer.json): no id 0
    assert 0 not in world.encode("x <|endoftext|> y" * 30)
    data = bytes(np.random.default_rng(2).integers(0, 256, 3000, dtype=np.uint8))  # not UTF-8
    assert world._fast.encode(data).tolist() == world.encode_bytes_trie(data)


@needs_vocab
def test_world_fast_path_long_documents_merges_and_collisions(monkeypatch):
    from lwm_jax.tokenizers import world_fast
    monkeypatch.setattr(world_fast, "WINDOW_BYTES", 4096)  # documents cut into windows
    monkeypatch.setattr(world_fast, "MERGE_EVERY", 64)  # many table merges
    monkeypatch.setattr(world_fast, "_mix", lambda w0, w1: w0 & np.uint64(0xF))  # collisions
    tok = WorldTokenizer()
    long_text = "".join(_varied_texts())
    docs = [long_text, "", "short one", _random_text(9, 5000), long_text[:4095]]
    for _ in range(2):  # the second pass reads the pieces from the table
        got = tok._fast.encode_many([d.encode() for d in docs])
        assert [g.tolist() for g in got] == [tok.encode_bytes_trie(d.encode()) for d in docs]
    assert len(tok._fast._hash) > 0


def test_world_fast_path_on_tiny_vocab_cuts_only_where_no_token_crosses(tmp_path):
    tok = WorldTokenizer(_tiny_vocab(tmp_path / "v.txt", ["ab", "abcd", "bc", "é", b"\xff\xfe"]))
    text = "abcx abcdbc éé ab" * 40
    assert tok.encode_array(text).tolist() == tok.encode_bytes_trie(text.encode())
    assert tok.encode("abcdbc" * 50) == [258, 259] * 50


def test_world_tokenizer_pickles_as_its_vocabulary_path(tmp_path):
    import pickle
    tok = WorldTokenizer(_tiny_vocab(tmp_path / "v.txt", ["ab", "abcd"]))
    blob = pickle.dumps(tok)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    assert again.name == tok.name and again.encode("abcd ab") == tok.encode("abcd ab")


# ------------------------------------------------------------------------------------------ hf
def _hf_file(tmp_path, with_eos_zero=True):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, decoders, trainers

    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<unk>"] if with_eos_zero else ["<unk>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([SAMPLE, _random_text(2, 2000)] * 3, trainer)
    path = tmp_path / "tokenizer.json"
    tk.save(str(path))
    return path


def test_hf_wraps_tokenizers_and_finds_eod(tmp_path):
    import tokenizers

    path = _hf_file(tmp_path)
    tok = get_tokenizer(f"hf:{path}")
    ref = tokenizers.Tokenizer.from_file(str(path))
    ids = tok.encode(SAMPLE)
    assert ids == ref.encode(SAMPLE, add_special_tokens=False).ids
    assert tok.decode(ids) == SAMPLE
    assert tok.eod_id == 0 and tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    assert HFTokenizer(path, eod_token="<unk>").eod_id == 1
    with pytest.raises(ValueError, match="eod_token '<nope>' is not in the vocabulary"):
        HFTokenizer(path, eod_token="<nope>")


def test_hf_without_clear_eod_asks_for_it(tmp_path):
    path = _hf_file(tmp_path, with_eos_zero=False)
    with pytest.raises(ValueError, match="cannot tell the end-of-document token"):
        HFTokenizer(path)
    with pytest.raises(FileNotFoundError, match="hf: tokenizer file"):
        HFTokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        HFTokenizer(tmp_path / "bad.json")


@pytest.mark.parametrize("spec", ["", "bpe", "hf:", "byte:x", "World"])
def test_bad_specs(spec):
    with pytest.raises(ValueError, match="tokenizer spec"):
        get_tokenizer(spec)


# ------------------------------------------------------------------------------ byte as HF files
# Byte strings whose UTF-8 decoding goes wrong in every way a decoder can (a stray continuation
# byte, a cut sequence, an overlong form, an encoded surrogate, a code point past U+10FFFF):
# the files' ByteLevel decoder must replace exactly what `ByteTokenizer.decode` replaces.
INVALID_UTF8 = [b"\xff", b"\xe2\x82", b"\xe2\x82A", b"\xf0\x9f\x98", b"\xc0\xaf",
                b"\xed\xa0\x80", b"\x80\x80\x80", b"\xf4\x90\x80\x80", b"ok\xe4\xb8", b"\xfe\xfe"]
BYTE_TEXTS = ["plain ASCII text", "", " leading space", "tabs\tand\nnewlines\r\n",
              SAMPLE, "NUL \x00 inside", "<|endoftext|> is just text here",
              "\u0100 is the ByteLevel character of byte 0", "\x7f\x80\u00ff\u0100\uffff",
              _random_text(3, 3000)]


def test_byte_tokenizer_files_give_our_ids(tmp_path):
    """`write_tokenizer_files(ByteTokenizer())` writes files that `tokenizers`, our
    `HFTokenizer` and transformers' `AutoTokenizer` all read as the byte tokenizer: the same
    ids for any text, the same text (U+FFFD where the bytes are not UTF-8) for any ids, id 0 as
    bos/eos/pad."""
    tokenizers = pytest.importorskip("tokenizers")
    from lwm_jax.tokenizers.hf_files import write_tokenizer_files
    ours = ByteTokenizer()
    written = write_tokenizer_files(ours, tmp_path)
    assert sorted(p.name for p in written) == ["tokenizer.json", "tokenizer_config.json"]
    raw = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    wrapped = HFTokenizer(tmp_path / "tokenizer.json")
    assert (wrapped.vocab_size, wrapped.eod_id) == (256, 0)
    rng = np.random.default_rng(7)
    id_lists = [list(b) for b in INVALID_UTF8] + [list(range(256))] + [
        [int(i) for i in rng.integers(0, 256, n)] for n in (1, 2, 3, 50, 500)]
    for text in BYTE_TEXTS:
        ids = ours.encode(text)
        assert raw.encode(text, add_special_tokens=False).ids == ids, text[:40]
        assert wrapped.encode(text) == ids, text[:40]
        assert raw.decode(ids, skip_special_tokens=False) == text
    for ids in id_lists:
        assert raw.decode(ids, skip_special_tokens=False) == ours.decode(ids), ids[:8]
        assert wrapped.decode(ids) == ours.decode(ids)
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))   # local files only
    for text in BYTE_TEXTS:
        assert auto(text)["input_ids"] == ours.encode(text), text[:40]
        assert auto.decode(ours.encode(text)) == text
    for ids in id_lists:
        assert auto.decode(ids) == ours.decode(ids), ids[:8]
    assert (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id) == (0, 0, 0)
    assert auto.decode([104, 0, 105], skip_special_tokens=True) == "hi"   # id 0 = end of doc


def test_hf_tokenizer_file_under_a_non_utf8_directory(tmp_path):
    """A `hf:` tokenizer file whose directory name is not UTF-8 loads (the Rust loader takes
    only UTF-8 paths, so the file is read by Python)."""
    pytest.importorskip("tokenizers")
    import os
    from lwm_jax.tokenizers.hf_files import write_tokenizer_files
    folder = tmp_path / os.fsdecode(b"tok\xff")
    folder.mkdir()
    write_tokenizer_files(ByteTokenizer(), folder)
    tok = get_tokenizer(f"hf:{folder / 'tokenizer.json'}")
    assert tok.encode("h\u00e9") == [104, 0xC3, 0xA9] and tok.eod_id == 0
