"""Perplexity and bits-per-byte of a token stream (a text file or a binidx dataset).

The stream is scored exactly as one long sequence: windows of `ctx_len` tokens are run one after
another with the recurrent state carried across windows, so every token is conditioned on
everything before it (no sliding-window approximation; RWKV needs none).

Conventions:
- The stream is prefixed with the end-of-document id (0 in RWKV), so the first real token is
  predicted too; every other token (including EOD markers inside a binidx stream) is predicted
  once and counted in `n_tokens`.
- `n_bytes` is the UTF-8 length of the predicted tokens' text, document by document (EOD markers
  contribute no bytes). bits/byte = total nats / (ln 2 · n_bytes). For a text file and a
  byte-exact tokenizer (byte, World) that is exactly the file's size in bytes.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from lwm_jax.eval.scoring import Scorer


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Totals of one scored stream (nats are natural-log units, summed in float64)."""

    n_tokens: int
    nats: float
    n_bytes: int | None = None

    @property
    def loss(self) -> float:
        """Mean cross-entropy per token, nats."""
        return self.nats / self.n_tokens

    @property
    def perplexity(self) -> float:
        """exp(loss); inf when that overflows a float."""
        return _exp(self.loss)

    @property
    def bits_per_token(self) -> float:
        return self.loss / math.log(2)

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.n_bytes else self.nats / (math.log(2) * self.n_bytes)

    def to_dict(self) -> dict:
        return {"n_tokens": self.n_tokens, "n_bytes": self.n_bytes, "loss": self.loss,
                "perplexity": self.perplexity, "bits_per_token": self.bits_per_token,
                "bits_per_byte": self.bits_per_byte}


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def stream_nll(scorer: Scorer, tokens, ctx_len: int = 1024) -> np.ndarray:
    """float64 `[n - 1]`: -log p(tokens[t + 1] | tokens[: t + 1]) for every t, state carried."""
    tokens = np.asarray(tokens, np.int64)
    if not isinstance(ctx_len, int) or ctx_len < 1:
        raise ValueError(f"ctx_len: must be a positive integer, got {ctx_len!r}")
    if tokens.ndim != 1 or tokens.size < 2:
        raise ValueError(f"tokens: need a 1-D stream of at least 2 tokens, got shape {tokens.shape}")
    n = tokens.size - 1
    state, parts = None, []
    for start in range(0, n, ctx_len):
        stop = min(start + ctx_len, n)
        inputs = np.zeros((1, ctx_len), np.int32)
        targets = np.zeros((1, ctx_len), np.int32)
        inputs[0, : stop - start] = tokens[start:stop]
        targets[0, : stop - start] = tokens[start + 1: stop + 1]
        nll, _, state = scorer.score(inputs, targets, state)
        parts.append(nll[0, : stop - start].astype(np.float64))
    return np.concatenate(parts)


def count_bytes(tokenizer, predicted, eod_id: int) -> int:
    """UTF-8 bytes of `predicted` token ids, decoded document by document (EOD ids excluded)."""
    ids = np.asarray(predicted, np.int64)
    cuts = np.flatnonzero(ids == eod_id)
    total, start = 0, 0
    for stop in [*cuts.tolist(), ids.size]:
        doc = ids[start:stop].tolist()
        if doc:
            if hasattr(tokenizer, "decode_bytes"):
                total += len(tokenizer.decode_bytes(doc))
            else:
                total += len(tokenizer.decode(doc).encode("utf-8"))
        start = stop + 1
    return total


def load_stream(path: str | os.PathLike, tokenizer=None) -> np.ndarray:
    """Token stream of a binidx dataset (`prefix`, `.bin` or `.idx`) or of a UTF-8 text file.

    Text files need `tokenizer`; binidx files are read as stored. Raises ValueError (one line
    naming the path) for a missing or non-UTF-8 file.
    """
    from lwm_jax.data.binidx import BinIdxDataset
    p = Path(path)
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    if Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file():
        ds = BinIdxDataset(prefix)
        bounds = ds.sequence_bounds()
        return np.asarray(ds.tokens[bounds[0]: bounds[-1]], np.int64)
    if not p.is_file():
        raise ValueError(f"data: {str(p)!r} is neither a text file nor a binidx prefix "
                         "(expected PREFIX.bin + PREFIX.idx)")
    if tokenizer is None:
        raise ValueError("tokenizer: a text file needs a tokenizer (e.g. --tokenizer world)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data: {str(p)!r} is not UTF-8 text (byte {err.start}); give a UTF-8 "
                         "text file or a binidx prefix") from None
    return np.asarray(tokenizer.encode(text), np.int64)


def evaluate_stream(scorer: Scorer, stream, tokenizer=None, ctx_len: int = 1024,
                    max_tokens: int | None = None, eod_id: int = 0) -> PerplexityResult:
    """Score `[eod_id] + stream` (first `max_tokens` predicted tokens) -> `PerplexityResult`.

    `n_bytes` is filled when a tokenizer is given.
    """
    stream = np.asarray(stream, np.int64)
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        stream = stream[:max_tokens]
    if stream.size == 0:
        raise ValueError("data: the token stream is empty")
    tokens = np.concatenate([[eod_id], stream])
    nll = stream_nll(scorer, tokens, ctx_len)
    n_bytes = count_bytes(tokenizer, stream, eod_id) if tokenizer is not None else None
    return PerplexityResult(n_tokens=int(stream.size), nats=float(nll.sum()), n_bytes=n_bytes)
