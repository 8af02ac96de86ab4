"""Training windows from text, tokenised on the fly, and from binidx tokens: one interface.

`TokenWindows` cuts windows of `ctx_len + 1` tokens back to back from the concatenated
documents of a text source (each document's tokens followed by the tokenizer's EOD id, as
`lwm-jax prepare` stores them), consecutive windows sharing one boundary token (as
`WindowSampler` does). Its state is the reader's position before the first document not yet
used up, how many of its tokens are used, and the tokenizer's name: a resume re-reads and
re-tokenises from there and continues with exactly the next window, and a resume with another
tokenizer is refused. The reader's `val_fraction` (documents held out for validation,
`lwm_jax.data.text_sources`) is part of the state too: another fraction would train on other
documents, so a resume with it is refused. `held_out_tokens` tokenises the held-out documents.

`PermutedWindows` gives the windows of a flat token array (binidx) one at a time in
`WindowSampler`'s seeded order (batch size 1); its state is its window counter and the
`val_fraction` cut off its tokens before it (`lwm_jax.train.batches`).

A state saved before `val_fraction` was recorded held nothing out: it reads as 0.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from lwm_jax.data.sampler import WindowSampler


class WindowSource(Protocol):
    """A source of training windows: int32 `[ctx_len + 1]` each, in a fixed order."""

    name: str

    def next_window(self) -> np.ndarray: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TokenWindows:
    """Windows of a document reader (`lwm_jax.data.text_sources`) tokenised by `tokenizer`
    (an `lwm_jax.tokenizers.Tokenizer`; its EOD id follows every document)."""

    def __init__(self, documents, tokenizer, ctx_len: int):
        self.documents, self.tokenizer, self.ctx_len = documents, tokenizer, int(ctx_len)
        self.name = documents.name
        self._pos = documents.start()       # the reader's position after the last doc read
        self._docs: list[tuple[Any, np.ndarray]] = []   # (position before it, its tokens)
        self._skip = 0                      # tokens of the first queued document already used
        self._reader = None
        self._encode = getattr(tokenizer, "encode_array", None) or tokenizer.encode

    def _read_document(self) -> None:
        if self._reader is None:
            self._reader = self.documents.read(self._pos)
        before = self._pos
        text, self._pos = next(self._reader)
        ids = np.asarray(self._encode(text), np.int64)
        self._docs.append((before, np.concatenate([ids, [self.tokenizer.eod_id]])))

    def next_window(self) -> np.ndarray:
        width = self.ctx_len + 1
        while sum(len(t) for _, t in self._docs) - self._skip < width:
            self._read_document()
        tokens = np.concatenate([t for _, t in self._docs])[self._skip:self._skip + width]
        self._skip += self.ctx_len                  # the boundary token starts the next one
        while self._docs and self._skip >= len(self._docs[0][1]):
            self._skip -= len(self._docs.pop(0)[1])
        return tokens.astype(np.int32)

    def state_dict(self) -> dict[str, Any]:
        """`{"start": reader position before the first unfinished document, "skip": its
        tokens already used, "tokenizer", "val_fraction"}`: small whatever the documents'
        length."""
        start = self._docs[0][0] if self._docs else self._pos
        return {"start": start, "skip": int(self._skip), "tokenizer": self.tokenizer.name,
                "val_fraction": float(getattr(self.documents, "val_fraction", 0.0))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_val_fraction(self.name, state, getattr(self.documents, "val_fraction", 0.0))
        if state.get("tokenizer") != self.tokenizer.name:
            raise ValueError(f"data.tokenizer: the checkpoint's data of {self.name[:120]} was "
                             f"tokenised with {state.get('tokenizer')!r}, this run uses "
                             f"{self.tokenizer.name!r}; resume with the same data.tokenizer or "
                             "choose a new run_dir")
        self._pos, self._reader, self._docs = state["start"], None, []
        self._skip = int(state["skip"])


class PermutedWindows:
    """The windows of `tokens` (1-D, e.g. a binidx memmap) in `WindowSampler`'s seeded order."""

    def __init__(self, tokens: np.ndarray, ctx_len: int, *, seed: int = 0, name: str = "",
                 val_fraction: float = 0.0):
        self._sampler = WindowSampler(tokens, ctx_len, 1, seed=seed)
        self.name, self.count, self.val_fraction = name, 0, float(val_fraction)

    def next_window(self) -> np.ndarray:
        window = self._sampler.batch_at(self.count)[0]
        self.count += 1
        return window

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "num_windows": int(self._sampler.num_windows),
                "val_fraction": self.val_fraction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_val_fraction(self.name, state, self.val_fraction)
        if int(state["num_windows"]) != self._sampler.num_windows:
            raise ValueError(f"data: {self.name} now holds {self._sampler.num_windows} windows, "
                             f"the checkpoint's data {state['num_windows']}; resume with the "
                             "same data or choose a new run_dir")
        self.count = int(state["count"])


def check_val_fraction(name: str, state: dict[str, Any], val_fraction: float) -> None:
    """Refuse (one-line ValueError) to resume a source whose saved state held out another
    fraction of its documents for validation than this run does."""
    saved = float(state.get("val_fraction", 0.0))
    if saved != float(val_fraction):
        raise ValueError(f"data.val_fraction: the checkpoint's data of {name[:120]} held out "
                         f"{saved:g} of its documents for validation, this run "
                         f"{float(val_fraction):g} (other training documents); resume with "
                         f"data.val_fraction={saved:g} or choose a new run_dir")


def held_out_tokens(documents, tokenizer, max_tokens: int) -> np.ndarray:
    """int32 `[n]`, n <= max_tokens: the reader's held-out documents
    (`documents.held_out_documents()`), each tokenised and followed by the tokenizer's EOD id,
    concatenated, cut at `max_tokens`. Reading stops there, so a large source costs only what
    validation uses; a source whose held-out documents run out gives fewer tokens."""
    encode = getattr(tokenizer, "encode_array", None) or tokenizer.encode
    parts, n = [], 0
    if max_tokens > 0:
        for text in documents.held_out_documents():
            ids = np.asarray(encode(text), np.int64)
            parts += [ids, np.asarray([tokenizer.eod_id], np.int64)]
            n += len(ids) + 1
            if n >= max_tokens:
                break
    if not parts:
        return np.zeros(0, np.int32)
    return np.concatenate(parts)[:max_tokens].astype(np.int32)
