"""Text documents for on-the-fly tokenisation, read in a fixed order from a resumable position.

A source is named by one string (`data.path` or an entry of `data.sources`):

| spec                                    | kind     | documents                            |
|-----------------------------------------|----------|--------------------------------------|
| `corpus/` (a directory)                 | `text`   | every .jsonl/.parquet/.txt under it  |
| `a.jsonl`, `a.parquet`, `a.txt`         | `text`   | that file                            |
| `hf:<name or dir>[:<config>[:<split>]]` | `hf`     | `datasets`, streamed (split `train`) |
| anything else                           | `binidx` | a `<prefix>.bin` / `.idx` pair       |

Files under a directory are sorted by path; binidx is not read here.

Documents: a `.jsonl` line's `text_key` field (blank lines skipped), a `.parquet` row's
`text_key` column, a whole `.txt` file, a `datasets` example's `text_key` field.

Positions (JSON-able, saved in checkpoints, so a resumed run reads exactly on):
  * text files: `{"epoch", "file", "offset"}`: epoch e reads the files in the order
    `permute(range(n), n, key(seed, e))` (epoch 0 too), `file` indexes that order, `offset` is a
    byte offset (.jsonl), a row index (.parquet) or 0 / 1 (.txt, before / after its document);
  * `datasets`: `{"epoch", "state"}` with the dataset's own `state_dict()` (datasets >= 2.18).
Reaching the end of the data starts the next epoch. Nothing here tokenises
(`lwm_jax.data.stream` does).

Validation split (`val_fraction`, `data.val_fraction`): a document is held out when
`lwm_jax.data.corpus.is_held_out(text, val_fraction)` says so, a SHA-256 hash of its own text.
The text is the identity because it is the one every reader has, whatever the position it
resumed from (a byte offset, a Parquet row, a stream's state) and whatever the file order:
the split is identical across runs, hosts and resumes, and a document repeated in the data (or
in two sources of a mixture) is always on one side, never on both. `read` skips held-out
documents (training), `held_out_documents` yields only them (validation), in a fixed order:
files sorted by path, a `datasets` stream in its own order, independent of the seed. For a
stream that means reading it from the start until enough held-out text has come by, about
`1 / val_fraction` times the validation text.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from lwm_jax.data.corpus import is_held_out
from lwm_jax.data.permutation import derive_key, permute

TEXT_SUFFIXES = (".jsonl", ".parquet", ".txt")
HF_PREFIX = "hf:"


def source_kind(spec: str) -> str:
    """`"hf"`, `"text"` or `"binidx"` for a source spec (see the module docstring); reads
    nothing but the file system's entry for `spec`."""
    if spec.startswith(HF_PREFIX):
        return "hf"
    if os.path.isdir(spec) or os.path.splitext(spec)[1] in TEXT_SUFFIXES:
        return "text"
    return "binidx"


def missing_binidx(key: str, missing: str, tokenizer: str) -> str:
    """The one-line message of a binidx file `missing` (`<prefix>.bin` or `.idx`) that the
    setting `key` names: how `lwm-jax prepare` makes it and, for training data, the forms that
    need no preparing (an `hf:` stream, text files, the embedded corpus)."""
    def cut(text: str, n: int = 240) -> str:       # a user's path may be huge
        return text if len(text) <= n else text[:n - 3] + "..."
    prefix = os.path.splitext(missing)[0]
    head = (f"{cut(missing)} not found (a binidx pair <prefix>.bin + <prefix>.idx); create it "
            f"with `lwm-jax prepare --input <.jsonl/.parquet/.txt files> --output {cut(prefix)} "
            f"--tokenizer {cut(tokenizer, 120)}`")
    if key == "data.val_path":
        return head + ", or set data.val_path=null to hold out data.val_fraction of the data"
    tail = ", or data.path=null for the embedded corpus" if key == "data.path" else ""
    return (f"{head}, or stream the text instead with {key}=hf:<dataset>[:<config>[:<split>]] "
            f"(e.g. {key}=hf:JeanKaddour/minipile), or give {key} a directory or "
            f".jsonl/.parquet/.txt file of text{tail}")


def text_files(spec: str, key: str = "data.path") -> list[Path]:
    """The files of a `text` source: the file itself, or the sorted `.jsonl`/`.parquet`/`.txt`
    files under a directory. ValueError (one line naming `key`) when there are none."""
    p = Path(spec).expanduser()
    if p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not found:
            raise ValueError(f"{key}: directory {spec} holds no {', '.join(TEXT_SUFFIXES)} files")
        return found
    if p.exists() and not p.is_file():
        raise ValueError(f"{key}: {spec} is not a regular file (a FIFO, device or socket); give "
                         f"a directory or a {', '.join(TEXT_SUFFIXES)} file")
    if not p.is_file():
        raise ValueError(f"{key}: {spec} not found; give a directory or a "
                         f"{', '.join(TEXT_SUFFIXES)} file")
    return [p]


class FileDocuments:
    """Documents of text files, epoch after epoch (module docstring: order and positions)."""

    def __init__(self, files: list[Path], *, text_key: str = "text", seed: int = 0,
                 val_fraction: float = 0.0):
        self.files, self.text_key, self.seed = list(files), text_key, int(seed)
        self.val_fraction = float(val_fraction)
        self.name = ",".join(str(f) for f in self.files)

    def start(self) -> dict[str, int]:
        return {"epoch": 0, "file": 0, "offset": 0}

    def order(self, epoch: int) -> np.ndarray:
        n = len(self.files)
        return permute(np.arange(n), n, derive_key(self.seed, epoch, 3))

    def read(self, pos: dict[str, Any]) -> Iterator[tuple[str, dict[str, int]]]:
        """Yields `(text, position after it)` of the training documents (those not held out)
        from `pos` on, forever (epoch after epoch)."""
        epoch, index, offset = int(pos["epoch"]), int(pos["file"]), int(pos["offset"])
        while True:
            order = self.order(epoch)
            seen = found = False
            for k in range(index, len(order)):
                path = self.files[int(order[k])]
                for text, after in _file_documents(path, self.text_key, offset if k == index
                                                   else 0):
                    seen = True
                    if not is_held_out(text, self.val_fraction):
                        found = True
                        yield text, {"epoch": epoch, "file": k, "offset": after}
            if not found and index == 0 and offset == 0:
                _no_training_documents(self.name, self.text_key, seen, self.val_fraction)
            epoch, index, offset = epoch + 1, 0, 0

    def held_out_documents(self) -> Iterator[str]:
        """The validation documents, one pass: files in sorted path order (whatever the seed),
        each file's documents in order."""
        for path in self.files:
            for text, _ in _file_documents(path, self.text_key, 0):
                if is_held_out(text, self.val_fraction):
                    yield text


def _no_training_documents(name: str, text_key: str, seen: bool, val_fraction: float):
    """The one-line ValueError of a source with no training document: none at all, or every
    one held out for validation."""
    if not seen:
        raise ValueError(f"data: no documents in {name[:200]} (field {text_key!r})")
    raise ValueError(f"data.val_fraction: every document of {name[:200]} is held out for "
                     f"validation (val_fraction={val_fraction:g}); lower data.val_fraction or "
                     "add documents")


def _file_documents(path: Path, text_key: str, offset: int) -> Iterator[tuple[str, int]]:
    """`(text, offset after it)` of one file from `offset` on; empty documents are skipped."""
    if path.suffix == ".txt":
        if offset == 0:
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not valid UTF-8 at byte {e.start}") from None
            if text:
                yield text, 1
        return
    if path.suffix == ".parquet":
        yield from _parquet_documents(path, text_key, offset)
        return
    with open(path, "rb") as f:
        f.seek(offset)
        for raw in f:
            where = f"{path} at byte {offset}"
            offset += len(raw)
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{where}: invalid JSON line ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                raise ValueError(f"{where}: no string field {text_key!r} (set data.text_key)")
            try:
                obj[text_key].encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{where}: field {text_key!r} holds a lone surrogate (at "
                                 f"character {e.start}), which is not valid Unicode text; fix "
                                 "or drop that line") from None
            if obj[text_key]:
                yield obj[text_key], offset


def parquet_rows(path: Path, text_key: str, row: int = 0,
                 key: str = "data.text_key") -> Iterator[tuple[str | None, int]]:
    """`(text or None, row after it)` of every row of a `.parquet` file's string column
    `text_key` from `row` on (None for a null). A file pyarrow cannot read, a missing column or a
    column that does not hold strings (ints, bytes, lists) is a one-line ValueError naming the
    file, the column and `key` (the setting that names the column)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") \
            from None
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({str(err)[:120]}); replace or "
                         "remove it") from None
    schema = pf.schema_arrow
    if text_key not in schema.names:
        raise ValueError(f"{path}: no column {text_key!r} (columns: "
                         f"{', '.join(schema.names[:8])}); set {key}")
    kind = schema.field(text_key).type
    values = kind.value_type if pa.types.is_dictionary(kind) else kind   # dictionary-encoded
    if not (pa.types.is_string(values) or pa.types.is_large_string(values)):
        raise ValueError(f"{path}: column {text_key!r} holds {kind}, not text (strings); choose "
                         f"the text column with {key}")
    first = 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if first + n > row:
            try:
                texts = pf.read_row_group(g, columns=[text_key]).column(0).to_pylist()
            except (pa.ArrowException, OSError) as err:
                raise ValueError(f"{path}: row group {g} is damaged ({str(err)[:120]}); "
                                 "replace or remove the file") from None
            for i in range(max(row - first, 0), n):
                yield texts[i], first + i + 1
        first += n


def _parquet_documents(path: Path, text_key: str, row: int) -> Iterator[tuple[str, int]]:
    for text, after in parquet_rows(path, text_key, row):
        if text:
            yield text, after


class HFDocuments:
    """Examples of a Hugging Face `datasets` dataset, streamed (`load_dataset(..., streaming=
    True)`): `hf:<name or local dir>[:<config>[:<split>]]`, e.g. `hf:JeanKaddour/minipile`
    (config: the dataset's default, split: `train`) or `hf:wikitext:wikitext-103-raw-v1`."""

    def __init__(self, spec: str, *, text_key: str = "text", key: str = "data.path",
                 val_fraction: float = 0.0):
        parts = spec[len(HF_PREFIX):].split(":")
        if not parts[0] or len(parts) > 3:
            raise ValueError(f"{key}: {spec!r} is not hf:<name>[:<config>[:<split>]]")
        self.path, self.config = parts[0], (parts[1] or None) if len(parts) > 1 else None
        self.split = parts[2] if len(parts) > 2 and parts[2] else "train"
        self.text_key, self.name, self.key = text_key, spec, key
        self.val_fraction = float(val_fraction)
        if importlib.util.find_spec("datasets") is None:
            raise ValueError(f"{key}: {spec} needs the datasets package (pip install datasets)")

    def _open(self):
        import datasets
        try:
            return datasets.load_dataset(self.path, self.config, split=self.split,
                                         streaming=True)
        except Exception as err:          # datasets raises many classes; one line here
            raise ValueError(self._open_error(err)) from None

    def _open_error(self, err: Exception) -> str:
        """One line for a dataset that cannot be opened; an unreachable Hub (offline, no
        network) names the fix: a local copy read as `hf:<directory>`."""
        what = f"{type(err).__name__}: {str(err)[:160]}"
        if isinstance(err, ConnectionError) or "offline" in str(err).lower():
            return (f"{self.key}: {self.name} cannot be streamed: the Hugging Face Hub is not "
                    f"reachable from here ({what}); go online, or download a copy where it is "
                    f"(hf download {self.path} --repo-type dataset --local-dir DIR), bring "
                    f"DIR here and set {self.key}=hf:DIR")
        return (f"{self.key}: cannot stream {self.name} ({what}); check the name "
                "(hf:<dataset>[:<config>[:<split>]]) and the dataset's configs and splits")

    def probe(self) -> None:
        """Open the stream once (reading no example), so that a name that cannot be reached
        is refused before training is set up."""
        self._open()

    def _text(self, example: Any) -> str:
        text = example.get(self.text_key) if isinstance(example, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{self.name}: an example has no string field "
                             f"{self.text_key!r}; set data.text_key")
        return text

    def start(self) -> dict[str, Any]:
        return {"epoch": 0, "state": None}

    def read(self, pos: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yields `(text, position after it)` of the training examples (those not held out)
        from `pos` on, forever (epoch after epoch)."""
        epoch, state = int(pos["epoch"]), pos["state"]
        while True:
            ds, seen, found = self._open(), False, False
            if state is not None:
                ds.load_state_dict(state)
            for example in ds:
                text = self._text(example)
                seen = seen or bool(text)
                if text and not is_held_out(text, self.val_fraction):
                    found = True    # a copy: the dataset keeps updating its own state dict
                    yield text, {"epoch": epoch, "state": copy.deepcopy(ds.state_dict())}
            if not found and state is None:
                _no_training_documents(self.name, self.text_key, seen, self.val_fraction)
            epoch, state = epoch + 1, None

    def held_out_documents(self) -> Iterator[str]:
        """The validation examples, one pass over the stream from its start."""
        for example in self._open():
            text = self._text(example)
            if text and is_held_out(text, self.val_fraction):
                yield text


def open_documents(spec: str, *, text_key: str = "text", seed: int = 0,
                   key: str = "data.path", val_fraction: float = 0.0
                   ) -> FileDocuments | HFDocuments:
    """The document reader of a `text` or `hf` source spec; `val_fraction` of its documents
    are held out of `read` for validation (module docstring)."""
    if source_kind(spec) == "hf":
        return HFDocuments(spec, text_key=text_key, key=key, val_fraction=val_fraction)
    return FileDocuments(text_files(spec, key), text_key=text_key, seed=seed,
                         val_fraction=val_fraction)
