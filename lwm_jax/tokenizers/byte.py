"""Byte-level tokenizer: one token per UTF-8 byte, id = byte value, vocab 256.

Convention (RWKV byte-level): ids are the raw byte values 0..255 with no offset, so any text or
byte string round-trips exactly, and id 0 (the NUL byte) doubles as the end-of-document marker.
Text practically never contains NUL, so the overlap only means that a literal NUL inside a
document looks like a document boundary to the model.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class ByteTokenizer:
    """`encode(text) = list(text.encode("utf-8"))`; vocab_size 256; eod_id 0."""

    vocab_size = 256
    eod_id = 0
    name = "byte"

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__} (use encode_bytes for bytes)")
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(bytes(data))

    def encode_array(self, text: str) -> np.ndarray:
        """uint8 [n_bytes] ids without building a Python list (fast path for big corpora)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        arr = np.asarray(ids)
        if arr.size == 0:
            return b""
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
        if int(arr.min()) < 0 or int(arr.max()) > 255:
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise ValueError(f"byte tokenizer ids must lie in [0, 256), got {bad}")
        return arr.astype(np.uint8).tobytes()

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
