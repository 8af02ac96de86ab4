"""The built-in stdlib corpus (selection, split, cache) and `prepare` (txt/jsonl -> binidx)."""
import argparse
import json

import numpy as np
import pytest

from lwm_jax.data import corpus
from lwm_jax.data.binidx import BinIdxDataset, BinIdxWriter
from lwm_jax.data.corpus import build_stdlib_corpus, cache_root, stdlib_corpus, stdlib_sources
from lwm_jax.cli.args import add_prepare_args
from lwm_jax.data.prepare import prepare, run_prepare
from lwm_jax.tokenizers import ByteTokenizer


@pytest.fixture
def fake_stdlib(tmp_path):
    """A small tree shaped like a stdlib: kept files and every kind of skipped file."""
    root = tmp_path / "lib"
    files = {
        "abc.py": "import os\n", "zz.py": "x = 1\n" * 30, "email/parser.py": "def parse():\n    pass\n",
        "email/__init__.py": "", "json/decoder.py": "# é ü 中\n", "b.py": "print('b')\n",
        "test/test_x.py": "SKIP", "email/tests/t.py": "SKIP", "idlelib/run.py": "SKIP",
        "site-packages/pkg/m.py": "SKIP", "__pycache__/abc.py": "SKIP", "_sysconfigdata_x.py": "SKIP",
        "config-3.11-x86_64-linux-gnu/python-config.py": "SKIP", "notes.txt": "SKIP",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return root


def test_sources_are_sorted_filtered_and_capped(fake_stdlib):
    got = stdlib_sources(root=fake_stdlib)
    assert [r for r, _ in got] == ["abc.py", "b.py", "email/__init__.py", "email/parser.py",
                                   "json/decoder.py", "zz.py"]
    assert all(size == (fake_stdlib / r).stat().st_size for r, size in got)
    capped = stdlib_sources(max_bytes=25, root=fake_stdlib)  # 10 + 11 bytes fit, then 0 + 22 does not
    assert [r for r, _ in capped] == ["abc.py", "b.py", "email/__init__.py"]
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        stdlib_sources(max_bytes=0, root=fake_stdlib)


def test_build_splits_documents_and_caches(fake_stdlib, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    out = build_stdlib_corpus(val_fraction=0.3, cache_dir=cache, root=fake_stdlib)
    assert out.parent == cache and out.name.startswith("stdlib-")
    manifest = json.loads((out / "manifest.json").read_text())
    rels = [r for r, _ in stdlib_sources(root=fake_stdlib)]
    docs = {}
    for split in ("train", "val"):
        ds = BinIdxDataset(out / split)
        assert ds.dtype == np.uint8
        for i in range(len(ds)):
            assert ds[i][-1] == 0  # EOD after every file
            docs[bytes(ds[i][:-1])] = split
    assert len(docs) == len(set((fake_stdlib / r).read_bytes() for r in rels))
    val_files = set(manifest["val_files"])
    assert val_files and val_files < set(rels)
    for rel in rels:
        assert docs[(fake_stdlib / rel).read_bytes()] == ("val" if rel in val_files else "train")
    # second call: found in the cache, nothing is written
    monkeypatch.setattr(corpus, "BinIdxWriter", None)
    assert build_stdlib_corpus(val_fraction=0.3, cache_dir=cache, root=fake_stdlib) == out
    train, val = stdlib_corpus(val_fraction=0.3, cache_dir=cache, root=fake_stdlib)
    assert isinstance(train, np.memmap) and len(train) + len(val) == sum(len(d) + 1 for d in docs)
    # a changed file list is a different cache entry
    (fake_stdlib / "new.py").write_text("y = 2\n")
    monkeypatch.setattr(corpus, "BinIdxWriter", BinIdxWriter)
    assert build_stdlib_corpus(val_fraction=0.3, cache_dir=cache, root=fake_stdlib) != out


def test_real_stdlib_corpus_is_deterministic(tmp_path):
    a_train, a_val = stdlib_corpus(max_bytes=300_000, cache_dir=tmp_path / "a")
    b_train, b_val = stdlib_corpus(max_bytes=300_000, cache_dir=tmp_path / "b")
    np.testing.assert_array_equal(a_train, b_train)
    np.testing.assert_array_equal(a_val, b_val)
    assert 0 < len(a_val) < len(a_train) and len(a_train) + len(a_val) <= 300_000 + 1000
    text = ByteTokenizer().decode(a_train[:20_000])
    assert "def " in text and "import " in text


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("LWM_JAX_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("LWM_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "lwm_jax"


# ------------------------------------------------------------------------------------------ prepare
def test_prepare_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n\nworld", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n\n{"text": "中"}\n{"text": ""}\n', encoding="utf-8")
    res = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "out/p", "byte", progress=False)
    assert (res.documents, res.skipped_empty, res.dtype) == (3, 1, "uint16")
    ds = BinIdxDataset(tmp_path / "out/p")
    want = [b"hello\n\nworld", b"x", "中".encode()]
    assert [bytes(ds[i].astype(np.uint8)) for i in range(3)] == [w + b"\x00" for w in want]
    assert res.tokens == ds.num_tokens == sum(len(w) + 1 for w in want)
    res = prepare([tmp_path], tmp_path / "q", ByteTokenizer(), append_eod=False, progress=False)
    assert res.documents == 3 and BinIdxDataset(tmp_path / "q").num_tokens == sum(map(len, want))


def test_prepare_world_uses_uint16(tmp_path):
    from lwm_jax.tokenizers import WorldTokenizer

    try:
        tok = WorldTokenizer()
    except FileNotFoundError:
        pytest.skip("World vocabulary not available")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "Hello 世界"}) + "\n", encoding="utf-8")
    prepare([tmp_path / "d.jsonl"], tmp_path / "w", tok, text_key="body", progress=False)
    ds = BinIdxDataset(tmp_path / "w")
    assert ds.dtype == np.uint16 and list(ds[0]) == tok.encode("Hello 世界") + [0]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "bad"\n', r"b\.jsonl:2: invalid JSON line"),
    ('{"text": "ok"}\n\n{"body": "x"}\n', r"b\.jsonl:3: no 'text' field"),
    ('{"text": 5}\n', r"b\.jsonl:1: field 'text' is int, expected a string"),
    ('\n\n', "no non-empty documents"),
])
def test_prepare_bad_jsonl_names_file_and_line(tmp_path, content, message):
    (tmp_path / "b.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        prepare([tmp_path / "b.jsonl"], tmp_path / "o", "byte", progress=False)
    assert not any(p.name.startswith("o.") for p in tmp_path.iterdir())  # nothing half-written


def test_prepare_input_errors(tmp_path):
    (tmp_path / "x.csv").write_text("a")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="unsupported suffix '.csv'"):
        prepare([tmp_path / "x.csv"], tmp_path / "o", "byte", progress=False)
    with pytest.raises(FileNotFoundError, match="no such file"):
        prepare([tmp_path / "nope.txt"], tmp_path / "o", "byte", progress=False)
    with pytest.raises(ValueError, match=r"bad\.txt: not valid UTF-8 at byte 0"):
        prepare([tmp_path / "bad.txt"], tmp_path / "o", "byte", progress=False)


def test_cli_wiring(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("abc", encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_prepare_args(parser)
    args = parser.parse_args(["--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "c"),
                              "--tokenizer", "byte", "--quiet"])
    assert run_prepare(args) == 0
    assert "1 documents, 4 tokens" in capsys.readouterr().out
    assert list(BinIdxDataset(tmp_path / "c")[0]) == [97, 98, 99, 0]
