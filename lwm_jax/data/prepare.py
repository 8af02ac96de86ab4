"""Tokenise text files into a binidx dataset (`lwm-jax prepare`).

Input formats (by suffix; a directory means every .txt / .jsonl / .parquet file under it,
sorted: the files `train` reads from the same directory):
  * `.txt`   the whole file is one document (UTF-8);
  * `.jsonl` one JSON object per line, its `text_key` field (a string) is one document; blank
             lines are skipped; a malformed line is an error naming `file:line`;
  * `.parquet` one row per document, its string column `text_key` (nulls skipped; a column of
             another type is an error naming the file and the column).
Each document is followed by the tokenizer's EOD id (0 for byte / World) when `append_eod`.
Token dtype: uint16 when vocab_size <= 65536, else int32. Empty documents are skipped.

Workers (`workers` > 1, `--workers`): documents are parsed here (so errors still name
`file:line`), sent in batches of ~1 MB to a pool of `workers` processes ('spawn' start: safe next
to JAX's threads) that each build the tokenizer once, and written back in input order, so the
output is byte-identical to `workers=1` (the in-process path). At most 2 batches per worker are
in flight (memory stays bounded). The tokenizer reaches the workers pickled (a `WorldTokenizer`
pickles as its vocabulary path); a tokenizer object that cannot be pickled falls back to one
worker. `auto_workers` (the CLI default) is min(cores, 32), fewer for small inputs (a worker
costs a process start and a tokenizer build), and 1 for the byte tokenizer (sending the text
costs more than encoding it).

Besides `<prefix>.bin` / `<prefix>.idx`, a small `<prefix>.tokenizer.json` records the tokenizer
used (`read_tokenizer_record`); training refuses data whose record disagrees with
`data.tokenizer`. The default tokenizer is "byte", matching the default (tiny) model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import pickle
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from lwm_jax.data.binidx import BinIdxWriter, token_dtype_for_vocab
from lwm_jax.tokenizers import ByteTokenizer, Tokenizer, get_tokenizer
from lwm_jax.user_input import check_encodable, check_output_file, quote_path, write_text

SUFFIXES = (".txt", ".jsonl", ".parquet")     # what `train` reads from a directory too
DEFAULT_TOKENIZER = "byte"
RECORD_SUFFIX = ".tokenizer.json"
RECORD_FORMAT = "lwm_jax-tokenizer-record/1"
BATCH_BYTES = 1 << 20  # text per batch sent to a worker
BATCH_DOCS = 4096  # documents per batch at most
MAX_WORKERS = 32
BYTES_PER_WORKER = 4 << 20  # auto_workers: a worker for each 4 MB of input, at most
__all__ = ["PrepareResult", "auto_workers", "binidx_prefix", "expand_inputs",
           "iter_documents", "prepare", "read_tokenizer_record", "run_prepare"]


@dataclasses.dataclass(frozen=True)
class PrepareResult:
    prefix: Path
    documents: int
    tokens: int
    skipped_empty: int
    dtype: str


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named directly, plus the sorted .txt/.jsonl/.parquet files under each named
    directory."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
            if not found:
                raise ValueError(f"--input {p}: directory holds no {'/'.join(SUFFIXES)} files")
            files.extend(found)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise ValueError(f"--input {p}: unsupported suffix {p.suffix!r}; use {' or '.join(SUFFIXES)}")
            files.append(p)
        elif p.exists():
            raise ValueError(f"--input {p}: not a regular file (a FIFO, device or socket); give "
                             f"a {'/'.join(SUFFIXES)} file or a directory of them")
        else:
            raise FileNotFoundError(f"--input {p}: no such file or directory")
    if not files:
        raise ValueError("no input files given (--input)")
    return files


def iter_documents(path: Path, text_key: str = "text") -> Iterator[tuple[str | None, int]]:
    """Yields (document text, input bytes consumed) for one .txt, .jsonl or .parquet file.

    The text is None for a blank .jsonl line or a null .parquet value (no document there). A
    .parquet file's bytes count as consumed after its last row.
    """
    if path.suffix == ".parquet":
        from lwm_jax.data.text_sources import parquet_rows
        last = None
        for text, _ in parquet_rows(path, text_key, key="--text-key"):
            if last is not None:
                yield last, 0
            last = text
        yield last, path.stat().st_size
        return
    if path.suffix == ".txt":
        raw = path.read_bytes()
        try:
            yield raw.decode("utf-8"), len(raw)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not valid UTF-8 at byte {e.start}") from None
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                yield None, len(raw)
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{where}: invalid JSON line ({e})") from None
            if not isinstance(obj, dict) or text_key not in obj:
                raise ValueError(f"{where}: no {text_key!r} field (choose the field with --text-key)")
            text = obj[text_key]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {text_key!r} is {type(text).__name__}, expected a string")
            check_encodable(text, where, text_key)
            yield text, len(raw)


def auto_workers(total_bytes: int, tokenizer: Tokenizer | None = None) -> int:
    """Default worker count: min(cores, 32, one per `BYTES_PER_WORKER` of input), at least 1;
    1 for the byte tokenizer (a copy: sending text to a worker costs more than encoding it)."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS, total_bytes // BYTES_PER_WORKER))


def iter_batches(files: Sequence[Path], text_key: str = "text"
                 ) -> Iterator[tuple[list[str | None], int]]:
    """Yields (documents, input bytes consumed) in input order, ~`BATCH_BYTES` of text at a
    time; a document is None for a blank .jsonl line (see `iter_documents`)."""
    docs: list[str | None] = []
    n_text = n_bytes = 0
    for path in files:
        for text, consumed in iter_documents(path, text_key):
            docs.append(text)
            n_text += len(text) if text else 0
            n_bytes += consumed
            if n_text >= BATCH_BYTES or len(docs) >= BATCH_DOCS:
                yield docs, n_bytes
                docs, n_text, n_bytes = [], 0, 0
    if docs:
        yield docs, n_bytes


def encode_texts(tok: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Ids of each text: the tokenizer's batch path (`encode_many_arrays`), else
    `encode_array`, else `encode`."""
    many = getattr(tok, "encode_many_arrays", None)
    if many is not None:
        return many(texts)
    one = getattr(tok, "encode_array", None)
    if one is not None:
        return [one(t) for t in texts]
    return [np.asarray(tok.encode(t), dtype=np.int64) for t in texts]


_worker_tokenizer: Tokenizer | None = None  # set once in each worker process (`_init_worker`)


def _init_worker(pickled_tokenizer: bytes) -> None:
    global _worker_tokenizer
    _worker_tokenizer = pickle.loads(pickled_tokenizer)


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return encode_texts(_worker_tokenizer, texts)


def _encoded_batches(batches: Iterator[tuple[list[str | None], int]], tok: Tokenizer,
                     workers: int) -> Iterator[tuple[list[str | None], list[np.ndarray], int]]:
    """(documents, ids of the non-empty ones, bytes) per batch, in input order; tokenised here
    (workers=1) or in a pool with at most 2 batches per worker in flight."""
    pickled = None
    if workers > 1:
        try:
            pickled = pickle.dumps(tok)
        except (pickle.PicklingError, TypeError, AttributeError):
            pickled = None  # documented: an unpicklable tokenizer object runs in-process
    if pickled is None:
        for docs, n_bytes in batches:
            yield docs, encode_texts(tok, [d for d in docs if d]), n_bytes
        return
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(pickled,))
    # On an error here (a bad line, a full disk) the pool finishes the batches already running
    # and drops the queued ones: killing workers that may hold a queue's lock can hang the exit.
    try:
        pending: deque = deque()
        for docs, n_bytes in batches:
            pending.append((docs, pool.submit(_encode_in_worker, [d for d in docs if d]),
                            n_bytes))
            if len(pending) >= 2 * workers:
                docs, result, n = pending.popleft()
                yield docs, _result(result), n
        while pending:
            docs, result, n = pending.popleft()
            yield docs, _result(result), n
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future) -> list[np.ndarray]:
    try:
        return future.result()
    except BrokenProcessPool:
        raise RuntimeError("a tokenizer worker process died (out of memory?); rerun with fewer "
                           "--workers, or --workers 1") from None


def prepare(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike,
            tokenizer: Tokenizer | str, text_key: str = "text", append_eod: bool = True,
            progress: bool = True, workers: int = 1) -> PrepareResult:
    """Tokenises `inputs` into `<output_prefix>.bin/.idx` and returns counts.

    `tokenizer` is a `Tokenizer` or a spec string for `get_tokenizer` ("byte", "world", "hf:...").
    `workers` > 1 tokenises in that many processes (module docstring); the files written are
    the same for every count.
    On success `<output_prefix>.tokenizer.json` records it (see `read_tokenizer_record`).
    Raises ValueError (one line) for bad input files, an output path that is a directory or a
    worker count below 1.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers (--workers) must be an integer >= 1, got {workers!r}")
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    prefix = binidx_prefix(output_prefix)
    for suffix in (".bin", ".idx", RECORD_SUFFIX):
        check_output_file(f"{prefix}{suffix}", "--output")
    files = expand_inputs(inputs)
    dtype = token_dtype_for_vocab(tok.vocab_size)
    total = sum(f.stat().st_size for f in files)
    docs = skipped = 0
    bar = _progress(total, progress)
    try:
        with _names_the_file(f"{prefix}.bin"), BinIdxWriter(
                output_prefix, dtype, append_eod=append_eod, eod_id=tok.eod_id) as writer:
            for batch, ids, n_bytes in _encoded_batches(iter_batches(files, text_key), tok,
                                                        workers):
                it = iter(ids)
                for text in batch:
                    if text:
                        writer.add_document(next(it))
                        docs += 1
                    elif text is not None:
                        skipped += 1
                bar.update(n_bytes)
            if docs == 0:
                raise ValueError(f"no non-empty documents found in {len(files)} input file(s)")
            n_tokens = writer.num_tokens
    finally:
        bar.close()
    record = {"format": RECORD_FORMAT, "tokenizer": tok.name, "vocab_size": int(tok.vocab_size),
              "eod_id": int(tok.eod_id), "append_eod": bool(append_eod), "documents": docs,
              "tokens": int(n_tokens)}
    write_text(f"{prefix}{RECORD_SUFFIX}", json.dumps(record, indent=2) + "\n")
    return PrepareResult(Path(output_prefix), docs, n_tokens, skipped, str(dtype))


class _names_the_file:
    """Attach `name` to an OSError raised without a file name (a full disk reports only
    `[Errno 28] No space left on device` from a write)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, self.name) from None
        return False


def binidx_prefix(path: str | os.PathLike) -> str:
    """`data/x.bin`, `data/x.idx` and `data/x` all name the binidx pair `data/x`."""
    root, ext = os.path.splitext(os.fspath(path))
    return root if ext in (".bin", ".idx") else os.fspath(path)


def read_tokenizer_record(path: str | os.PathLike) -> dict | None:
    """The record `prepare` wrote next to the binidx pair `path` (prefix, .bin or .idx):
    `{"tokenizer": spec, "vocab_size": int, "eod_id": int, ...}`, or None when there is none
    (data prepared elsewhere). Raises ValueError (one line naming the file) when it is damaged.
    """
    file = Path(binidx_prefix(path) + RECORD_SUFFIX)
    if not file.is_file():
        return None
    fix = "delete it (the check is skipped) or re-run lwm-jax prepare"
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{quote_path(file)}: damaged tokenizer record ({type(err).__name__}); "
                         f"{fix}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tokenizer"), str) or not (
            doc.get("vocab_size") is None or isinstance(doc["vocab_size"], int)):
        raise ValueError(f"{quote_path(file)}: damaged tokenizer record (expected an object with "
                         f"a string 'tokenizer' and an integer 'vocab_size'); {fix}")
    return doc


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not enabled)


def run_prepare(args: argparse.Namespace) -> int:
    """Runs `prepare` from parsed `add_prepare_args` options; prints a summary; returns 0."""
    workers = getattr(args, "workers", None)
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers} (1 = no worker processes)")
    if getattr(args, "eod_token", None) is not None and not str(args.tokenizer).startswith("hf:"):
        raise ValueError("--eod-token: applies to hf: tokenizers only (byte and world have a "
                         "fixed EOD id 0); drop it")
    tok = get_tokenizer(args.tokenizer, eod_token=args.eod_token)
    if workers is None:
        workers = auto_workers(sum(f.stat().st_size for f in expand_inputs(args.input)), tok)
    res = prepare(args.input, args.output, tok, text_key=args.text_key, append_eod=not args.no_eod,
                  progress=not args.quiet, workers=workers)
    print(f"wrote {res.prefix}.bin, {res.prefix}.idx and {res.prefix}{RECORD_SUFFIX}: "
          f"{res.documents} documents, "
          f"{res.tokens} tokens ({res.dtype}), {res.skipped_empty} empty documents skipped, "
          f"tokenizer {tok.name}, {workers} worker(s)")
    return 0
