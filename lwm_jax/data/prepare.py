"""Tokenise text files into a binidx dataset (`lwm-jax prepare`).

Input formats (by suffix; a directory means every .txt / .jsonl file under it, sorted):
  * `.txt`   the whole file is one document (UTF-8);
  * `.jsonl` one JSON object per line, its `text_key` field (a string) is one document; blank
             lines are skipped; a malformed line is an error naming `file:line`.
Each document is followed by the tokenizer's EOD id (0 for byte / World) when `append_eod`.
Token dtype: uint16 when vocab_size <= 65536, else int32. Empty documents are skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from lwm_jax.data.binidx import BinIdxWriter, token_dtype_for_vocab
from lwm_jax.tokenizers import SPEC_HELP, Tokenizer, get_tokenizer

SUFFIXES = (".txt", ".jsonl")


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
    """
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    files = expand_inputs(inputs)
    dtype = token_dtype_for_vocab(tok.vocab_size)
    total = sum(f.stat().st_size for f in files)
    fast = getattr(tok, "encode_array", None)
    docs = skipped = 0
    bar = _progress(total, progress)
    try:
        with BinIdxWriter(output_prefix, dtype, append_eod=append_eod, eod_id=tok.eod_id) as writer:
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
    return PrepareResult(Path(output_prefix), docs, n_tokens, skipped, str(dtype))


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not enabled)


def add_prepare_args(parser: argparse.ArgumentParser) -> None:
    """Adds the `prepare` subcommand's options to `parser`."""
    parser.add_argument("--input", "-i", nargs="+", action="extend", required=True, metavar="PATH",
                        help=".txt (one document per file) or .jsonl (one per line) files or directories")
    parser.add_argument("--output", "-o", required=True, metavar="PREFIX",
                        help="output prefix; writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="world", help=SPEC_HELP)
    parser.add_argument("--text-key", default="text", help="field of each .jsonl object holding the text")
    parser.add_argument("--eod-token", default=None, help="hf: tokenizers only: end-of-document token text")
    parser.add_argument("--no-eod", action="store_true", help="do not append the EOD token to documents")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run_prepare(args: argparse.Namespace) -> int:
    """Runs `prepare` from parsed `add_prepare_args` options; prints a summary; returns 0."""
    tok = get_tokenizer(args.tokenizer, eod_token=args.eod_token)
    res = prepare(args.input, args.output, tok, text_key=args.text_key, append_eod=not args.no_eod,
                  progress=not args.quiet)
    print(f"wrote {res.prefix}.bin/.idx: {res.documents} documents, {res.tokens} tokens ({res.dtype}), "
          f"{res.skipped_empty} empty documents skipped, tokenizer {tok.name}")
    return 0
