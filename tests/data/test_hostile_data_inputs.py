"""Hostile inputs to `prepare` and the training text sources: each is one ValueError line
naming the file (or flag) and the fix, never a hang, a codec traceback or silent acceptance."""
import argparse
import itertools
import json
import os

import pytest

from lwm_jax.cli import main
from lwm_jax.data.prepare import expand_inputs, iter_documents, run_prepare
from lwm_jax.data.text_sources import open_documents, text_files

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def _first_document(path):
    docs = open_documents(str(path))
    return next(iter(docs.read(docs.start())))


def test_a_lone_surrogate_in_a_jsonl_text_names_the_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "\\ud800 x"}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: field 'text' holds a lone surrogate") as e:
        list(iter_documents(path))
    assert "\n" not in str(e.value) and "codec" not in str(e.value)
    (tmp_path / "d").mkdir()
    os.replace(path, tmp_path / "d" / "a.jsonl")
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "\\udcff x"}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl at byte 0: field 'text' holds a lone surrogate"):
        _first_document(tmp_path / "d")


def test_fifos_are_not_regular_files_rather_than_not_found(tmp_path):
    os.mkfifo(tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match=r"^data.path: .*a\.jsonl is not a regular file \(a FIFO, "
                                         r"device or socket\)"):
        text_files(str(tmp_path / "a.jsonl"))
    with pytest.raises(ValueError, match=r"^--input .*a\.jsonl: not a regular file \(a FIFO"):
        expand_inputs([tmp_path / "a.jsonl"])


def test_eod_token_with_a_tokenizer_that_ignores_it_is_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    args = argparse.Namespace(input=[str(tmp_path / "a.txt")], output=str(tmp_path / "o"),
                              tokenizer="byte", eod_token="</s>", text_key="text", no_eod=False,
                              quiet=True, workers=1)
    with pytest.raises(ValueError, match=r"^--eod-token: applies to hf: tokenizers only"):
        run_prepare(args)
    assert not (tmp_path / "o.bin").exists()
    assert main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "o"),
                 "--eod-token", "</s>", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--eod-token" in err[0] and "drop it" in err[0]


def test_dictionary_encoded_parquet_strings_are_read_by_prepare_and_train(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    (tmp_path / "d").mkdir()
    for i, typ in enumerate([pa.string(), pa.large_string()]):
        col = pa.array(["hello", "world", None, "hello"], typ).dictionary_encode()
        pq.write_table(pa.table({"text": col}), tmp_path / "d" / f"x{i}.parquet")
    assert [t for t, _ in iter_documents(tmp_path / "d" / "x0.parquet") if t] == \
        ["hello", "world", "hello"]
    docs = open_documents(str(tmp_path / "d"))
    got = sorted(text for text, _ in itertools.islice(docs.read(docs.start()), 6))  # an epoch
    assert got == ["hello"] * 4 + ["world"] * 2
    assert main(["prepare", "--input", str(tmp_path / "d"), "--output", str(tmp_path / "o"),
                 "--quiet"]) == 0
    assert "6 documents" in capsys.readouterr().out
    json.loads((tmp_path / "o.tokenizer.json").read_text())
