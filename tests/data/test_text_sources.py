"""Text read on the fly (JSONL / Parquet / txt directories, Hugging Face `datasets` streamed)
and weighted mixtures: deterministic order, exact resume from a saved state, the tokenizer
recorded in the state and a mismatch refused."""
import json

import numpy as np
import pytest

from lwm_jax.data import write_binidx
from lwm_jax.data.mixture import MixtureSampler
from lwm_jax.data.stream import PermutedWindows, TokenWindows
from lwm_jax.data.text_sources import open_documents, source_kind
from lwm_jax.tokenizers import get_tokenizer

T = 16


def write_corpus(root, n_files=3, docs_per_file=5, seed=0):
    """`root/` with .jsonl files (a blank line each) and one .parquet file; returns every
    document's text by file name."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for f in range(n_files):
        docs = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(3, 40)))
                for _ in range(docs_per_file)]
        lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(docs)]
        (root / f"part-{f}.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
        texts[f"part-{f}.jsonl"] = docs
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    docs = [f"parquet document {i} " * (i + 1) for i in range(7)]
    pq.write_table(pa.table({"text": docs}), root / "z.parquet", row_group_size=3)
    texts["z.parquet"] = docs
    return texts


def windows(source, n):
    return np.stack([source.next_window() for _ in range(n)])


def test_source_kinds(tmp_path):
    (tmp_path / "d").mkdir()
    assert source_kind(str(tmp_path / "d")) == "text"
    assert source_kind("x/y.jsonl") == "text" and source_kind("x/y.parquet") == "text"
    assert source_kind("hf:wikitext:wikitext-2-raw-v1") == "hf"
    assert source_kind("data/train") == "binidx" and source_kind("data/train.bin") == "binidx"


def test_files_are_read_in_a_seeded_order_and_every_document_once_per_epoch(tmp_path):
    texts = write_corpus(tmp_path / "c")
    docs = open_documents(str(tmp_path / "c"), seed=3)
    names = [f.name for f in docs.files]
    assert names == sorted(texts)
    want_epoch = [t for k in docs.order(0) for t in texts[names[k]]]
    reader = docs.read(docs.start())
    got = [next(reader)[0] for _ in range(2 * len(want_epoch))]
    assert got[:len(want_epoch)] == want_epoch               # epoch 0, blank lines skipped
    assert sorted(got[len(want_epoch):]) == sorted(want_epoch)   # epoch 1: the same documents
    assert list(docs.order(0)) != list(docs.order(1)) or len(names) < 3


def test_token_windows_resume_exactly_and_refuse_another_tokenizer(tmp_path):
    write_corpus(tmp_path / "c")
    byte = get_tokenizer("byte")
    make = lambda: TokenWindows(open_documents(str(tmp_path / "c"), seed=1), byte, T)  # noqa
    full = windows(make(), 40)
    first = make()
    head = windows(first, 17)
    state = json.loads(json.dumps(first.state_dict()))      # as a checkpoint stores it
    second = make()
    second.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate([head, windows(second, 23)]), full)
    # windows are the concatenated documents + EOD, consecutive windows share one token
    assert (full[1:, 0] == full[:-1, -1]).all()
    stream = np.concatenate([full[0], *[w[1:] for w in full[1:]]])
    docs = open_documents(str(tmp_path / "c"), seed=1).read({"epoch": 0, "file": 0,
                                                              "offset": 0})
    expect = []
    while len(expect) < len(stream):
        expect += list(next(docs)[0].encode()) + [0]
    np.testing.assert_array_equal(stream, expect[:len(stream)])
    with pytest.raises(ValueError, match=r"^data.tokenizer: the checkpoint's data of .* was "
                                         r"tokenised with 'byte', this run uses 'other'"):
        other = make()
        other.tokenizer = type("Tok", (), {"name": "other", "eod_id": 0})()
        other.load_state_dict(state)


def test_hf_datasets_stream_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")               # a local directory: no network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets")
    texts = write_corpus(tmp_path / "hub", n_files=2)
    (tmp_path / "hub" / "z.parquet").unlink()           # one format per local dataset
    spec = f"hf:{tmp_path / 'hub'}"
    byte = get_tokenizer("byte")
    make = lambda: TokenWindows(open_documents(spec), byte, T)  # noqa: E731
    full = windows(make(), 12)
    first = make()
    head = windows(first, 5)
    second = make()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    np.testing.assert_array_equal(np.concatenate([head, windows(second, 7)]), full)
    all_bytes = b"".join(t.encode() + b"\0" for f in sorted(texts) for t in texts[f])
    assert bytes(full[0].astype(np.uint8)) == all_bytes[:T + 1]


def test_mixture_is_seeded_weighted_and_resumes_exactly(tmp_path):
    write_corpus(tmp_path / "c")
    prefix = str(tmp_path / "bin")
    write_binidx(prefix, [np.full(50, 200 + i) for i in range(8)], np.uint16, append_eod=True)
    tokens = np.fromfile(prefix + ".bin", np.uint16)
    byte = get_tokenizer("byte")

    def make(host_index=0, host_count=1):
        sources = [TokenWindows(open_documents(str(tmp_path / "c")), byte, T),
                   PermutedWindows(tokens, T, seed=5, name=prefix)]
        return MixtureSampler(sources, [3.0, 1.0], global_batch_size=8, seed=7,
                              host_index=host_index, host_count=host_count)

    full = make()
    batches = [next(full) for _ in range(12)]
    from_bin = np.mean([full.source_of(i) for i in range(96)])
    assert 0.1 < from_bin < 0.4                               # weight 1 of 4
    for i, batch in enumerate(batches):                       # rows are where the draw says
        for r, row in enumerate(batch):
            assert (row.max() >= 200) == (full.source_of(i * 8 + r) == 1)
    first = make()
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.step == 5
    for want in batches[5:]:
        np.testing.assert_array_equal(next(resumed), want)
    hosts = [make(h, 2) for h in range(2)]                    # two hosts: halves of each batch
    for want in batches[:3]:
        np.testing.assert_array_equal(np.concatenate([next(h) for h in hosts]), want)
    other = MixtureSampler(make().sources, [1.0, 1.0], global_batch_size=8, seed=7)
    with pytest.raises(ValueError, match=r"^data.weights: the checkpoint's data order used"):
        other.load_state_dict(state)


def test_prepare_reads_the_parquet_files_train_reads_from_a_directory(tmp_path, capsys):
    """`prepare DIR` once skipped DIR's .parquet files that `train data.path=DIR` reads (201 of
    403 documents written, no warning); now both read the same documents."""
    from lwm_jax.cli import main
    from lwm_jax.data.binidx import BinIdxDataset
    texts = write_corpus(tmp_path / "c")
    assert main(["prepare", "--input", str(tmp_path / "c"), "--output",
                 str(tmp_path / "out"), "--quiet"]) == 0
    docs = sum(len(v) for v in texts.values())
    out = capsys.readouterr().out
    assert f"{docs} documents" in out
    prefix = str(tmp_path / "out")
    assert f"wrote {prefix}.bin, {prefix}.idx and {prefix}.tokenizer.json:" in out
    data = BinIdxDataset(prefix)
    assert len(data) == docs
    want = sorted(t.encode() for v in texts.values() for t in v)
    got = sorted(bytes(data[i][:-1].astype(np.uint8)) for i in range(len(data)))  # EOD off
    assert got == want


@pytest.mark.parametrize("column", [[1, 2, 3], [b"a", b"b", b"c"], [["x"], ["y"], ["z"]]])
def test_a_parquet_column_that_is_not_text_is_one_line(tmp_path, column):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"text": column}), tmp_path / "d" / "x.parquet")
    def first_document():
        docs = open_documents(str(tmp_path / "d"))
        return next(iter(docs.read(docs.start())))
    with pytest.raises(ValueError, match=r"x.parquet: column 'text' holds .*, not text \(strings\); "
                                         r"choose the text column with data.text_key"):
        first_document()
    (tmp_path / "d" / "x.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    with pytest.raises(ValueError, match=r"x.parquet: not a readable Parquet file"):
        first_document()


def test_huge_weights_keep_their_ratio_and_a_vanishing_one_is_refused():
    """`data.weights: [1e308, 1e308]` summed to inf and sent every row to one source."""
    from lwm_jax.data.mixture import _cumulative_shares
    np.testing.assert_allclose(_cumulative_shares([1e308, 1e308]), [0.5, 1.0])
    np.testing.assert_allclose(_cumulative_shares([1.5e308, 0.5e308]), [0.75, 1.0])
    np.testing.assert_array_equal(_cumulative_shares([3.0, 1.0]),
                                  np.cumsum([3.0, 1.0]) / 4.0)      # as before: same draws
    with pytest.raises(ValueError, match=r"data.weights: .* would never be drawn"):
        _cumulative_shares([1e300, 1e-300])


def one_epoch(docs):
    """The training documents of `docs` (a reader), one epoch from the start."""
    out = []
    for text, pos in docs.read(docs.start()):
        if pos["epoch"] > 0:
            break
        out.append(text)
    return out


def write_many(root, n=300):
    """`root/` with 3 .jsonl files, a .parquet file and 4 .txt files: `n` + 4 documents of
    distinct text; returns them."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    root.mkdir(parents=True, exist_ok=True)
    docs = [f"document {i}: " + "abc" * (i % 7) for i in range(n)]
    third = n // 3
    for f in range(2):
        lines = [json.dumps({"text": t}) for t in docs[f * third:(f + 1) * third]]
        (root / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": docs[2 * third:]}), root / "rest.parquet",
                   row_group_size=17)
    for k in range(4):
        (root / f"note-{k}.txt").write_text(f"a whole file, number {k}")
        docs.append(f"a whole file, number {k}")
    return docs


def test_val_fraction_holds_out_a_fixed_disjoint_share_of_text_documents(tmp_path):
    """`data.val_fraction` was ignored for text: every document trained. Now about that
    share of the documents is held out, disjoint from training, by a hash of the text: the
    same split for every reader, seed and resume; 0 holds out nothing."""
    docs = write_many(tmp_path / "c")
    reader = open_documents(str(tmp_path / "c"), seed=1, val_fraction=0.2)
    train, val = one_epoch(reader), list(reader.held_out_documents())
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(docs)                 # nothing lost, nothing twice
    assert 0.12 < len(val) / len(docs) < 0.28
    # the same split from another reader, another seed (another file order), another epoch
    other = open_documents(str(tmp_path / "c"), seed=9, val_fraction=0.2)
    assert list(other.held_out_documents()) == val
    assert sorted(one_epoch(other)) == sorted(train)
    nothing = open_documents(str(tmp_path / "c"), seed=1, val_fraction=0.0)
    assert list(nothing.held_out_documents()) == []
    assert sorted(one_epoch(nothing)) == sorted(docs)
    # a resumed TokenWindows reads on through training documents only
    byte = get_tokenizer("byte")
    make = lambda: TokenWindows(open_documents(str(tmp_path / "c"), seed=1,  # noqa: E731
                                               val_fraction=0.2), byte, T)
    full = windows(make(), 120)
    first = make()
    head = windows(first, 50)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["val_fraction"] == 0.2
    second = make()
    second.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate([head, windows(second, 70)]), full)
    stream = bytes(np.concatenate([full[0], *[w[1:] for w in full[1:]]]).astype(np.uint8))
    seen = stream.split(b"\0")[1:-1]                          # whole documents only
    assert len(seen) > 50 and not {s.decode() for s in seen} & set(val)


def test_held_out_tokens_are_the_held_out_documents_cut_at_the_cap(tmp_path):
    from lwm_jax.data.stream import held_out_tokens
    write_many(tmp_path / "c")
    reader = open_documents(str(tmp_path / "c"), val_fraction=0.3)
    byte = get_tokenizer("byte")
    want = b"".join(t.encode() + b"\0" for t in reader.held_out_documents())
    every = held_out_tokens(reader, byte, 10**9)
    assert every.dtype == np.int32 and bytes(every.astype(np.uint8)) == want
    np.testing.assert_array_equal(held_out_tokens(reader, byte, 100), every[:100])
    assert len(held_out_tokens(open_documents(str(tmp_path / "c")), byte, 100)) == 0


def test_a_resume_with_another_val_fraction_is_refused(tmp_path):
    """Another fraction trains on other documents: refused in one line naming the key and
    the fix; a state saved before the fraction was recorded held nothing out."""
    write_many(tmp_path / "c")
    byte = get_tokenizer("byte")
    make = lambda f: TokenWindows(open_documents(str(tmp_path / "c"),  # noqa: E731
                                                 val_fraction=f), byte, T)
    saved = make(0.1)
    windows(saved, 3)
    state = saved.state_dict()
    with pytest.raises(ValueError, match=r"^data.val_fraction: the checkpoint's data of .* held "
                                         r"out 0.1 of its documents for validation, this run "
                                         r"0.05 .*resume with data.val_fraction=0.1 or"):
        make(0.05).load_state_dict(state)
    old = {k: v for k, v in make(0.0).state_dict().items() if k != "val_fraction"}
    make(0.0).load_state_dict(old)
    with pytest.raises(ValueError, match=r"^data.val_fraction: .* held out 0 of"):
        make(0.05).load_state_dict(old)
    tokens = np.arange(1000) % 200
    binidx = PermutedWindows(tokens, T, name="b", val_fraction=0.1)
    with pytest.raises(ValueError, match=r"^data.val_fraction: the checkpoint's data of b held "
                                         r"out 0.1"):
        PermutedWindows(tokens, T, name="b", val_fraction=0.2).load_state_dict(
            binidx.state_dict())


def test_every_document_held_out_is_one_line(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("the only document")
    docs = open_documents(str(tmp_path / "d"), val_fraction=0.999999)
    assert list(docs.held_out_documents()) == ["the only document"]
    with pytest.raises(ValueError, match=r"^data.val_fraction: every document of .*a.txt is "
                                         r"held out for validation .*lower data.val_fraction"):
        next(docs.read(docs.start()))


def test_hf_stream_holds_out_by_the_same_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")               # a local directory: no network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("datasets")
    (tmp_path / "hub").mkdir()
    texts = [f"example {i} " * (1 + i % 5) for i in range(120)]
    (tmp_path / "hub" / "data.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts))
    spec = f"hf:{tmp_path / 'hub'}"
    reader = open_documents(spec, val_fraction=0.25)
    train, val = one_epoch(reader), list(reader.held_out_documents())
    assert not set(train) & set(val) and sorted(train + val) == sorted(texts)
    assert 0.12 < len(val) / len(texts) < 0.38
    files = open_documents(str(tmp_path / "hub"), val_fraction=0.25)     # same text: same split
    assert list(files.held_out_documents()) == val
    assert one_epoch(open_documents(spec)) == texts                       # 0: all of it


def test_an_unreachable_hf_dataset_is_one_line_naming_the_fix(monkeypatch):
    """Offline, `hf:JeanKaddour/minipile` failed with datasets' own message only; it now names
    data.path and a copy to read as hf:<directory>."""
    datasets = pytest.importorskip("datasets")
    from lwm_jax.data.text_sources import HFDocuments

    def unreachable(path, *args, **kwargs):           # what datasets raises offline
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    docs = HFDocuments("hf:JeanKaddour/minipile", key="data.sources[1]")
    assert (docs.path, docs.config, docs.split) == ("JeanKaddour/minipile", None, "train")
    with pytest.raises(ValueError) as info:
        docs.probe()
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("data.sources[1]: hf:JeanKaddour/minipile cannot be streamed: the "
                          "Hugging Face Hub is not reachable from here (ConnectionError: ")
    assert msg.endswith("(hf download JeanKaddour/minipile --repo-type dataset --local-dir DIR), "
                        "bring DIR here and set data.sources[1]=hf:DIR")
    assert HFDocuments("hf:wikitext:wikitext-2-raw-v1:test").split == "test"
