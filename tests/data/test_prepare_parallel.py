"""`lwm-jax prepare --workers N`: the same files as one process, the same one-line errors."""
import importlib
import json
import multiprocessing
import re

import pytest

from lwm_jax.cli import main
from lwm_jax.data.prepare import auto_workers, iter_batches, prepare

prepare_mod = importlib.import_module("lwm_jax.data.prepare")  # the package re-exports prepare()
from lwm_jax.tokenizers import ByteTokenizer

DOCS = ["hello world\n", "", "Grüße, 世界! 😀 \t\x01 end", "x" * 5000, "   spaces   "]


def _inputs(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text("first document\nwith two lines\n", encoding="utf-8")
    (d / "b.txt").write_text("", encoding="utf-8")  # an empty document: skipped
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in DOCS]
    (d / "c.jsonl").write_text("\n".join(lines[:2]) + "\n\n  \n" + "\n".join(lines[2:]) + "\n",
                               encoding="utf-8")
    (d / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * i}) + "\n"
                                       for i in range(40)), encoding="utf-8")
    return d


def _files(prefix):
    return [open(f"{prefix}{s}", "rb").read() for s in (".bin", ".idx", ".tokenizer.json")]


def test_two_workers_write_the_same_files_as_one(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "BATCH_DOCS", 7)  # several batches, several in flight
    seen_workers = []
    real = prepare_mod._encoded_batches

    def spy(*args):
        for item in real(*args):
            seen_workers.append(len(multiprocessing.active_children()))
            yield item
    monkeypatch.setattr(prepare_mod, "_encoded_batches", spy)
    src = _inputs(tmp_path)
    one = prepare([src], tmp_path / "one", "byte", progress=False, workers=1)
    assert max(seen_workers) == 0
    seen_workers.clear()
    two = prepare([src], tmp_path / "two", ByteTokenizer(), progress=False, workers=2)
    assert len(seen_workers) > 2 and min(seen_workers) == 2  # the pool did the work
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert (one.documents, one.tokens, one.skipped_empty) == (two.documents, two.tokens,
                                                              two.skipped_empty)
    assert one.documents == 1 + 4 + 39 and one.skipped_empty == 3  # b.txt, "" and "doc 0" * 0

def test_batches_keep_order_blank_lines_and_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "BATCH_DOCS", 3)
    src = _inputs(tmp_path)
    files = sorted(src.iterdir())
    batches = list(iter_batches(files))
    flat = [d for docs, _ in batches for d in docs]
    assert all(len(docs) <= 3 for docs, _ in batches)
    assert sum(n for _, n in batches) == sum(f.stat().st_size for f in files)
    assert flat[:4] == ["first document\nwith two lines\n", "", DOCS[0], DOCS[1]]
    assert flat[4:6] == [None, None]  # the two blank .jsonl lines
    assert flat[6:9] == DOCS[2:]


def test_bad_jsonl_line_is_named_with_workers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_mod, "BATCH_DOCS", 3)  # the pool is busy when the error comes
    bad = tmp_path / "bad.jsonl"
    good = "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(20))
    bad.write_text(good + '\n{"text": broken\n{"text": "after"}\n', encoding="utf-8")
    for workers in ("1", "2"):
        code = main(["prepare", "--input", str(bad), "--output", str(tmp_path / "o"), "--quiet",
                     "--workers", workers])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert re.search(rf"{re.escape(str(bad))}:22: invalid JSON line", err[0]), err[0]
        assert not (tmp_path / "o.bin").exists()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_cli_refuses_fewer_than_one_worker(tmp_path, capsys, value):
    (tmp_path / "a.txt").write_text("text")
    code = main(["prepare", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "o"),
                 "--workers", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "--workers must be >= 1" in err[0]
    assert not (tmp_path / "o.bin").exists()


def test_prepare_refuses_bad_worker_counts(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="workers .* must be an integer >= 1"):
            prepare([tmp_path / "a.txt"], tmp_path / "o", "byte", progress=False, workers=bad)


def test_unpicklable_tokenizer_runs_in_process(tmp_path):
    class Local(ByteTokenizer):  # a local class cannot be pickled
        pass
    (tmp_path / "a.txt").write_text("abc")
    res = prepare([tmp_path / "a.txt"], tmp_path / "o", Local(), progress=False, workers=2)
    assert res.tokens == 4


def test_auto_workers_scales_with_input():
    import os
    assert auto_workers(0) == 1 and auto_workers(1000) == 1
    assert auto_workers(1 << 40) == min(os.cpu_count() or 1, 32)
    assert auto_workers(1 << 40, ByteTokenizer()) == 1


def test_world_with_workers_matches_one_process(tmp_path, world_tokenizer):
    src = _inputs(tmp_path)
    prepare([src], tmp_path / "one", world_tokenizer, progress=False, workers=1)
    prepare([src], tmp_path / "two", world_tokenizer, progress=False, workers=2)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


@pytest.fixture(scope="module")
def world_tokenizer():
    from lwm_jax.tokenizers import WorldTokenizer
    try:
        return WorldTokenizer()
    except FileNotFoundError:
        pytest.skip("World vocabulary not installed (pip install rwkv)")


class _KillsItsWorker(ByteTokenizer):
    """Unpickles (in a worker process) by calling os._exit: a worker that dies, as one killed
    for memory would."""

    def __reduce__(self):
        import os
        return os._exit, (3,)


def test_a_dead_worker_is_one_line_not_a_hang(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n"
                                              for i in range(50)), encoding="utf-8")
    with pytest.raises(RuntimeError, match="worker process died .* --workers 1"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o", _KillsItsWorker(), progress=False,
                workers=2)
    assert not (tmp_path / "o.bin").exists()
