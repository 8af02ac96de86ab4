"""binidx reader/writer: format bytes against the spec, round trips, and every corruption message."""
import struct

import numpy as np
import pytest

from lwm_jax.data.binidx import (MAGIC, BinIdxDataset, BinIdxError, BinIdxWriter, dtype_code,
                                 token_dtype_for_vocab, write_binidx)


def _write_raw(prefix, code, sizes, pointers, doc_idx, bin_bytes, version=1, magic=MAGIC, cut_idx=None):
    """Writes an .idx/.bin pair byte by byte from the format description (independent of the writer)."""
    idx = magic + struct.pack("<QBQQ", version, code, len(sizes), len(doc_idx))
    idx += np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
    idx += np.asarray(doc_idx, "<i8").tobytes()
    if cut_idx is not None:
        idx = idx[:cut_idx]
    (prefix.parent / f"{prefix.name}.idx").write_bytes(idx)
    (prefix.parent / f"{prefix.name}.bin").write_bytes(bin_bytes)


def _docs(rng, n_docs, vocab):
    return [rng.integers(1, vocab, size=int(rng.integers(0, 50))) for _ in range(n_docs)]


def test_reader_matches_hand_built_file(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 65536, size=n).astype(np.uint16) for n in (5, 0, 17, 3)]
    sizes = [len(s) for s in seqs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 2
    _write_raw(tmp_path / "d", 8, sizes, pointers, [0, 2, 4], b"".join(s.tobytes() for s in seqs))
    ds = BinIdxDataset(tmp_path / "d")
    assert ds.dtype == np.uint16 and len(ds) == 4 and ds.num_documents == 2
    assert ds.num_tokens == sum(sizes)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(ds[-1], seqs[-1])
    np.testing.assert_array_equal(ds.tokens, np.concatenate(seqs))
    assert isinstance(ds.tokens, np.memmap)
    np.testing.assert_array_equal(ds.sequence_bounds(), [0, 5, 5, 22, 25])
    with pytest.raises(IndexError, match="out of range"):
        ds[4]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16])
def test_writer_bytes_follow_spec(tmp_path, dtype):
    rng = np.random.default_rng(1)
    hi = min(np.iinfo(dtype).max, 1000)
    docs = _docs(rng, 7, hi)
    ds = write_binidx(tmp_path / "w", docs, dtype, append_eod=True)
    raw = (tmp_path / "w.idx").read_bytes()
    assert raw[:9] == MAGIC
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, n_seq, n_doc) == (1, dtype_code(dtype), 7, 8)
    expect = [np.append(d, 0).astype(dtype) for d in docs]
    sizes = np.frombuffer(raw, "<i4", 7, 34)
    np.testing.assert_array_equal(sizes, [len(e) for e in expect])
    ptr = np.frombuffer(raw, "<i8", 7, 34 + 28)
    np.testing.assert_array_equal(ptr, (np.cumsum(sizes) - sizes) * np.dtype(dtype).itemsize)
    np.testing.assert_array_equal(np.frombuffer(raw, "<i8", 8, 34 + 28 + 56), np.arange(8))
    assert len(raw) == 34 + 28 + 56 + 64
    np.testing.assert_array_equal(np.fromfile(tmp_path / "w.bin", dtype), np.concatenate(expect))
    for i, e in enumerate(expect):
        np.testing.assert_array_equal(ds[i], e)


def test_writer_chunked_index_equals_single_chunk(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    docs = _docs(rng, 11, 60000)
    write_binidx(tmp_path / "one", docs, np.uint16)
    monkeypatch.setattr(BinIdxWriter, "_CHUNK", 3)
    write_binidx(tmp_path / "many", docs, np.uint16)
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "many.idx").read_bytes()
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "many.bin").read_bytes()


def test_writer_empty_and_abort(tmp_path):
    ds = write_binidx(tmp_path / "e", [], np.uint16)
    assert len(ds) == 0 and ds.num_tokens == 0 and ds.tokens.size == 0 and ds.num_documents == 0
    with pytest.raises(RuntimeError, match="boom"):
        with BinIdxWriter(tmp_path / "a", np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.bin", "e.idx"]


def test_writer_rejects_bad_tokens(tmp_path):
    with BinIdxWriter(tmp_path / "r", np.uint16) as w:
        with pytest.raises(ValueError, match="do not fit dtype uint16"):
            w.add_document([1, 70000])
        with pytest.raises(ValueError, match="do not fit"):
            w.add_document([-1])
        with pytest.raises(TypeError, match="integers"):
            w.add_document([1.5])
        with pytest.raises(ValueError, match="1-D"):
            w.add_document([[1, 2]])
        w.add_document([4, 5])
    assert BinIdxDataset(tmp_path / "r").num_tokens == 2
    with pytest.raises(ValueError, match="cannot be stored"):
        BinIdxWriter(tmp_path / "f", np.float32)


def test_token_dtype_for_vocab():
    assert token_dtype_for_vocab(256) == np.uint16
    assert token_dtype_for_vocab(65536) == np.uint16
    assert token_dtype_for_vocab(65537) == np.int32


def _good(tmp_path, **over):
    kw = dict(code=8, sizes=[2, 3], pointers=[0, 4], doc_idx=[0, 1, 2], bin_bytes=bytes(10))
    kw.update(over)
    _write_raw(tmp_path / "c", **kw)
    return tmp_path / "c"


@pytest.mark.parametrize("over, message", [
    (dict(magic=b"NOTINDEX\x00"), "bad magic"),
    (dict(version=2), "unsupported binidx version 2"),
    (dict(code=9), "unknown dtype code 9"),
    (dict(code=0), "unknown dtype code 0"),
    (dict(code=6), "dtype code 6 .* not an integer token dtype"),
    (dict(cut_idx=34 + 8 + 16 + 23), "truncated .idx: header declares 2 sequences and 3 doc_idx entries"),
    (dict(cut_idx=20), "truncated .idx: header needs 34 bytes"),
    (dict(bin_bytes=bytes(9)), r"\.bin shorter than the index says: needs 10 bytes, file has 9"),
    (dict(pointers=[4, 0]), r"non-monotone pointers: pointer\[1\] < pointer\[0\]"),
    (dict(pointers=[0, 3]), "multiples of 2 bytes"),
    (dict(sizes=[2, -1]), "negative sequence size at sequence 1"),
    (dict(doc_idx=[0, 2, 1]), "doc_idx must be non-decreasing"),
    (dict(doc_idx=[0, 1, 3]), "doc_idx must be non-decreasing"),
])
def test_corrupt_files_give_one_line_errors(tmp_path, over, message):
    prefix = _good(tmp_path, **over)
    with pytest.raises(BinIdxError, match=message) as err:
        BinIdxDataset(prefix)
    text = str(err.value)
    assert "\n" not in text
    assert str(prefix) in text  # names the file


def test_good_fixture_opens_and_missing_files(tmp_path):
    ds = BinIdxDataset(f"{_good(tmp_path)}.bin")  # a path with a suffix is accepted
    assert ds.num_tokens == 5 and len(ds.tokens) == 5
    (tmp_path / "c.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"c\.bin: binidx file not found"):
        BinIdxDataset(tmp_path / "c")
