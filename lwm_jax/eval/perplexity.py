"""Perplexity and bits-per-byte of a token stream (a text file or a binidx dataset), for every
model family (`lwm_jax.eval.scoring.model_context`):

- a recurrent model (RWKV-7) scores the stream exactly as one long sequence: windows of
  `ctx_len` tokens run one after another with the state carried across windows, so every token
  is conditioned on everything before it (no sliding-window approximation; RWKV needs none);
- a model that sees a bounded window (LLaMA: its `max_seq_len`; the hybrid, which carries no
  state: `ctx_len`) scores it in windows of that many tokens, the same disjoint windows as
  lm-eval's `loglikelihood_rolling` (`lwm_jax.eval.requests.rolling_pairs`): every token is
  predicted exactly once, from the tokens before it in its own window (the first of a window
  from one token of the previous one). No token is dropped; the window used is reported.

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
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:           # imported by the caller: this module stays light (no jax)
    from lwm_jax.eval.scoring import Scorer

# `progress(total)` -> `update(n_done)`: told the number of windows, then the windows finished
Progress = Callable[[int], Callable[[int], None]]


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Totals of one scored stream (nats are natural-log units, summed in float64).

    `window`: tokens per scoring window; `state_carried`: whether the state ran through the
    whole stream (recurrent) rather than each window standing alone."""

    n_tokens: int
    nats: float
    n_bytes: int | None = None
    window: int | None = None
    state_carried: bool | None = None

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
                "bits_per_byte": self.bits_per_byte, "window": self.window,
                "state_carried": self.state_carried}


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def stream_window(scorer: Scorer, ctx_len: int) -> int:
    """Tokens per scoring window: a KV-cache model's `max_seq_len`, else `ctx_len`."""
    if not isinstance(ctx_len, int) or isinstance(ctx_len, bool) or ctx_len < 1:
        raise ValueError(f"ctx_len: must be a positive integer, got {ctx_len!r}")
    return scorer.max_len if scorer.max_len is not None else ctx_len


def count_windows(scorer: Scorer, n_predicted: int, ctx_len: int) -> int:
    """Scoring windows (model calls of one row) for `n_predicted` tokens."""
    return -(-n_predicted // stream_window(scorer, ctx_len))


def stream_nll(scorer: Scorer, tokens, ctx_len: int = 1024, batch_size: int = 1,
               progress: Callable[[int], None] | None = None) -> np.ndarray:
    """float64 `[n - 1]`: -log p(tokens[t + 1] | context) for every t (see the module docstring:
    the whole prefix for a recurrent model, the window's earlier tokens otherwise).

    `batch_size`: windows per call of a model without carried state (a recurrent model runs
    its windows one after another, one row). `progress(n)`: told of each `n` windows done."""
    tokens = np.asarray(tokens, np.int64)
    window = stream_window(scorer, ctx_len)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
    if tokens.ndim != 1 or tokens.size < 2:
        raise ValueError(f"tokens: need a 1-D stream of at least 2 tokens, got shape {tokens.shape}")
    if not scorer.recurrent:
        return _windowed_nll(scorer, tokens, window, batch_size, progress)
    n = tokens.size - 1
    state, parts = None, []
    for start in range(0, n, window):
        stop = min(start + window, n)
        inputs = np.zeros((1, window), np.int32)
        targets = np.zeros((1, window), np.int32)
        inputs[0, : stop - start] = tokens[start:stop]
        targets[0, : stop - start] = tokens[start + 1: stop + 1]
        nll, _, state = scorer.score(inputs, targets, state)
        parts.append(nll[0, : stop - start].astype(np.float64))
        if progress is not None:
            progress(1)
    return np.concatenate(parts)


def stream_windows(n_predicted: int, window: int):
    """`(first, start, stop)` per window of a model without carried state, over a stream
    `tokens` of `n_predicted + 1` ids: the window predicts `tokens[start + 1: stop + 1]` from
    the inputs `tokens[first: stop]` (`stop - first <= window`, as much earlier text as fits).
    The same windows as `lwm_jax.eval.requests.rolling_pairs` with a one-token head."""
    for start in range(0, n_predicted, window):
        stop = min(start + window, n_predicted)
        yield max(0, stop - window), start, stop


def _windowed_nll(scorer: Scorer, tokens: np.ndarray, window: int, batch_size: int,
                  progress) -> np.ndarray:
    """`stream_nll` of a model without carried state: `stream_windows`, each scored alone,
    `batch_size` rows per call (right-padded rows: in a causal model padding never reaches
    earlier positions; narrower than `window` only when the whole stream is, then a power of
    two so that short files share a compilation)."""
    from lwm_jax.eval.batched import bucket_width
    n = tokens.size - 1
    width = bucket_width(min(n, window), window)
    spans = list(stream_windows(n, window))
    parts = []
    for at in range(0, len(spans), batch_size):
        batch = spans[at: at + batch_size]
        inputs = np.zeros((batch_size, width), np.int32)
        targets = np.zeros((batch_size, width), np.int32)
        for row, (first, _, stop) in enumerate(batch):
            inputs[row, : stop - first] = tokens[first:stop]
            targets[row, : stop - first] = tokens[first + 1: stop + 1]
        nll, _, _ = scorer.score(inputs, targets)
        for row, (first, start, stop) in enumerate(batch):
            parts.append(nll[row, start - first: stop - first].astype(np.float64))
        if progress is not None:
            progress(len(batch))
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


def check_stream_path(path: str | os.PathLike) -> None:
    """ValueError (one line naming the path) unless `path` is a file or a binidx prefix (what
    `load_stream` reads); reads nothing, so a typo is caught before a model is loaded."""
    p = Path(path)
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    for part in (p, Path(f"{prefix}.idx"), Path(f"{prefix}.bin")):
        if part.exists() and not part.is_file() and not part.is_dir():   # open() would block
            raise ValueError(f"data: {str(part)!r} is not a regular file (a FIFO, device or "
                             "socket); give a text file or a binidx prefix")
    if not (p.is_file() or (Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file())):
        raise ValueError(f"data: {str(p)!r} is neither a text file nor a binidx prefix "
                         "(expected PREFIX.bin + PREFIX.idx)")


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
    check_stream_path(p)
    if tokenizer is None:
        raise ValueError("tokenizer: a text file needs a tokenizer (e.g. --tokenizer world)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data: {str(p)!r} is not UTF-8 text (byte {err.start}); give a UTF-8 "
                         "text file or a binidx prefix") from None
    return np.asarray(tokenizer.encode(text), np.int64)


def evaluate_stream(scorer: Scorer, stream, tokenizer=None, ctx_len: int = 1024,
                    max_tokens: int | None = None, eod_id: int = 0, batch_size: int = 1,
                    progress: Progress | None = None) -> PerplexityResult:
    """Score `[eod_id] + stream` (first `max_tokens` predicted tokens) -> `PerplexityResult`.

    `ctx_len`: tokens per window (a KV-cache model uses its `max_seq_len`); `batch_size`: see
    `stream_nll`; `progress(total windows)` returns an updater told of windows done.
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
    update = progress(count_windows(scorer, int(stream.size), ctx_len)) if progress else None
    nll = stream_nll(scorer, tokens, ctx_len, batch_size, update)
    n_bytes = count_bytes(tokenizer, stream, eod_id) if tokenizer is not None else None
    return PerplexityResult(n_tokens=int(stream.size), nats=float(nll.sum()), n_bytes=n_bytes,
                            window=stream_window(scorer, ctx_len),
                            state_carried=scorer.recurrent)
