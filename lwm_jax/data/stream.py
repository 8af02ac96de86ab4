"""Training windows from text, tokenised on the fly, and from binidx tokens: one interface.

`TokenWindows` cuts windows of `ctx_len + 1` tokens back to back from the concatenated
documents of a text source (each document's tokens followed by the tokenizer's EOD id, as
`lwm-jax prepare` stores them), consecutive windows sharing one boundary token (as
`WindowSampler` does). Its state is the reader's position before the first document not yet
used up, how many of its tokens are used, and the tokenizer's name: a resume re-reads and
re-tokenises from there and continues with exactly the next window, and a resume with another
tokenizer is refused.

`PermutedWindows` gives the windows of a flat token array (binidx) one at a time in
`WindowSampler`'s seeded order (batch size 1); its state is its window counter.
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
        tokens already used, "tokenizer"}`: small whatever the documents' length."""
        start = self._docs[0][0] if self._docs else self._pos
        return {"start": start, "skip": int(self._skip), "tokenizer": self.tokenizer.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("tokenizer") != self.tokenizer.name:
            raise ValueError(f"data.tokenizer: the checkpoint's data of {self.name[:120]} was "
                             f"tokenised with {state.get('tokenizer')!r}, this run uses "
                             f"{self.tokenizer.name!r}; resume with the same data.tokenizer or "
                             "choose a new run_dir")
        self._pos, self._reader, self._docs = state["start"], None, []
        self._skip = int(state["skip"])


class PermutedWindows:
    """The windows of `tokens` (1-D, e.g. a binidx memmap) in `WindowSampler`'s seeded order."""

    def __init__(self, tokens: np.ndarray, ctx_len: int, *, seed: int = 0, name: str = ""):
        self._sampler = WindowSampler(tokens, ctx_len, 1, seed=seed)
        self.name, self.count = name, 0

    def next_window(self) -> np.ndarray:
        window = self._sampler.batch_at(self.count)[0]
        self.count += 1
        return window

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "num_windows": int(self._sampler.num_windows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_windows"]) != self._sampler.num_windows:
            raise ValueError(f"data: {self.name} now holds {self._sampler.num_windows} windows, "
                             f"the checkpoint's data {state['num_windows']}; resume with the "
                             "same data or choose a new run_dir")
        self.count = int(state["count"])
