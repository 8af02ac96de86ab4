"""Tokenise text files into a binidx dataset (`lwm-jax prepare`).

Input formats (by suffix; a directory means every .txt / .jsonl file under it, sorted):
  * `.txt`   the whole file is one document (UTF-8);
  * `.jsonl` one JSON object per line, its `text_key` field (a string) is one document; blank
             lines are skipped; a malformed line is an error naming `file:line`.
Each document is followed by the tokenizer's EOD id (0 for byte / World) when `append_eod`.
Token dtype: uint16 when vocab_size <= 65536, else int32. Empty documents are skipped.

Besides `<prefix>.bin` / `<prefix>.idx`, a small `<prefix>.tokenizer.json` records the tokenizer
used (`read_tokenizer_record`); training refuses data whose record disagrees with
`data.tokenizer`. The default tokenizer is "byte", matching the default (tiny) model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from lwm_jax.cli_args import add_prepare_args  # re-exported (API)
from lwm_jax.data.binidx import BinIdxWriter, token_dtype_for_vocab
from lwm_jax.tokenizers import Tokenizer, get_tokenizer
from lwm_jax.user_input import check_output_file, quote_path, write_text

SUFFIXES = (".txt", ".jsonl")
DEFAULT_TOKENIZER = "byte"
RECORD_SUFFIX = ".tokenizer.json"
RECORD_FORMAT = "lwm_jax-tokenizer-record/1"
__all__ = ["PrepareResult", "add_prepare_args", "binidx_prefix", "expand_inputs", "iter_documents",
           "prepare", "read_tokenizer_record", "run_prepare"]


@dataclasses.dataclass(frozen=True)
class PrepareResult:
    prefix: Path
    documents: int
    tokens: int
    skipped_empty: int
    dtype: str


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named directly, plus the sorted .txt/.jsonl files under each named directory."""
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
        else:
            raise FileNotFoundError(f"--input {p}: no such file or directory")
    if not files:
        raise ValueError("no input files given (--input)")
    return files


def iter_documents(path: Path, text_key: str = "text") -> Iterator[tuple[str | None, int]]:
    """Yields (document text, input bytes consumed) for one .txt or .jsonl file.

    The text is None for a blank .jsonl line (no document there).
    """
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
            yield text, len(raw)


def prepare(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike,
            tokenizer: Tokenizer | str, text_key: str = "text", append_eod: bool = True,
            progress: bool = True) -> PrepareResult:
    """Tokenises `inputs` into `<output_prefix>.bin/.idx` and returns counts.

    `tokenizer` is a `Tokenizer` or a spec string for `get_tokenizer` ("byte", "world", "hf:...").
    On success `<output_prefix>.tokenizer.json` records it (see `read_tokenizer_record`).
    Raises ValueError (one line) for bad input files or an output path that is a directory.
    """
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    prefix = binidx_prefix(output_prefix)
    for suffix in (".bin", ".idx", RECORD_SUFFIX):
        check_output_file(f"{prefix}{suffix}", "--output")
    files = expand_inputs(inputs)
    dtype = token_dtype_for_vocab(tok.vocab_size)
    total = sum(f.stat().st_size for f in files)
    fast = getattr(tok, "encode_array", None)
    docs = skipped = 0
    bar = _progress(total, progress)
    try:
        with _names_the_file(f"{prefix}.bin"), BinIdxWriter(
                output_prefix, dtype, append_eod=append_eod, eod_id=tok.eod_id) as writer:
            for path in files:
                for text, n_bytes in iter_documents(path, text_key):
                    if text:
                        ids = fast(text) if fast is not None else np.asarray(tok.encode(text), dtype=np.int64)
                        writer.add_document(ids)
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
    tok = get_tokenizer(args.tokenizer, eod_token=args.eod_token)
    res = prepare(args.input, args.output, tok, text_key=args.text_key, append_eod=not args.no_eod,
                  progress=not args.quiet)
    print(f"wrote {res.prefix}.bin/.idx/{RECORD_SUFFIX[1:]}: {res.documents} documents, "
          f"{res.tokens} tokens ({res.dtype}), {res.skipped_empty} empty documents skipped, "
          f"tokenizer {tok.name}")
    return 0
