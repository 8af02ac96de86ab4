"""The interface every tokenizer in `lwm_jax.tokenizers` implements."""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids.

    Attributes:
      vocab_size: number of ids the model's embedding must cover (ids lie in [0, vocab_size)).
      eod_id: end-of-document id appended after each document when preparing data (0 in RWKV).
      name: the spec string that rebuilds this tokenizer with `get_tokenizer`.
    """

    vocab_size: int
    eod_id: int
    name: str

    def encode(self, text: str) -> list[int]:
        """Ids of `text` (no EOD added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        ...
