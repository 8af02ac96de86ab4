"""RWKV "World" tokenizer: greedy longest match over UTF-8 bytes with the 65529-entry vocabulary.

Vocabulary file `rwkv_vocab_v20230424.txt`: one entry per line, `<id> <python literal> <n_bytes>`,
where the literal is a `str` (stored UTF-8 encoded) or a `bytes`; it is parsed with
`ast.literal_eval` (never `eval`) and its encoded length must equal n_bytes. Ids run 1..65529;
id 0 is reserved for end-of-document and decodes to nothing; the model vocabulary is padded to
65536. All 256 single bytes are entries, so every input has a tokenization.

Encoding walks a trie of dicts (`{byte: child, -1: id}`) from each position as far as the input
allows and emits the id of the deepest node that is a token (the longest vocabulary entry that
is a prefix of the rest of the input), then resumes right after it. This reproduces the ids of
the official `rwkv.rwkv_tokenizer.TRIE_TOKENIZER` exactly (tested) at ~10 MB/s in pure Python
(`encode_bytes_trie`). Inputs of `FAST_MIN_BYTES` or more go through `world_fast.PieceEncoder`
(the same ids, several times faster: it cuts the input where no token can cross and reuses the
ids of pieces it has seen); `encode_many_arrays` tokenises a batch of texts in one pass.
"""
from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from lwm_jax.tokenizers.world_fast import PieceEncoder, boundary_pairs

VOCAB_FILENAME = "rwkv_vocab_v20230424.txt"
WORLD_VOCAB_SIZE = 65536  # model vocabulary (ids 0..65529 used, padded to a multiple of 64)
# ids in a vocabulary file are bounded: the id -> bytes table is a list as long as the largest id
MAX_WORLD_ID = 2 ** 24
_ID = -1  # key of a trie node's token id
FAST_MIN_BYTES = 256  # shorter inputs: the trie walk alone (NumPy's per-call cost dominates)


def find_world_vocab(path: str | os.PathLike | None = None) -> Path:
    """Locates the vocabulary: `path`, else $LWM_JAX_WORLD_VOCAB, else the installed `rwkv` package.

    The package directory is found with `importlib.util.find_spec`, which does not import `rwkv`
    (and so never imports torch).
    """
    if path is None:
        path = os.environ.get("LWM_JAX_WORLD_VOCAB") or None
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"World vocabulary file {p} not found (pass world:/path/to/{VOCAB_FILENAME})")
        return p
    spec = importlib.util.find_spec("rwkv")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / VOCAB_FILENAME
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"{VOCAB_FILENAME} not found: pip install rwkv (it ships the file), or pass "
        f"world:/path/to/{VOCAB_FILENAME}, or set LWM_JAX_WORLD_VOCAB")


def read_world_vocab(path: str | os.PathLike) -> dict[int, bytes]:
    """Parses the vocabulary file into {id: token bytes}, checking lengths and uniqueness."""
    path = Path(path)
    table: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            first, last = line.find(" "), line.rfind(" ")
            if first <= 0 or last <= first:
                raise ValueError(f"{where}: expected '<id> <literal> <n_bytes>', got {line[:60]!r}")
            try:
                idx = int(line[:first])
                n_bytes = int(line[last + 1:])
                tok = ast.literal_eval(line[first + 1: last])
            except (ValueError, SyntaxError) as e:
                raise ValueError(f"{where}: cannot parse vocabulary entry ({e})") from None
            if isinstance(tok, str):
                tok = tok.encode("utf-8")
            if not isinstance(tok, bytes) or not tok:
                raise ValueError(f"{where}: token must be a non-empty str or bytes literal")
            if len(tok) != n_bytes:
                raise ValueError(f"{where}: token is {len(tok)} bytes but the line says {n_bytes}")
            if idx >= MAX_WORLD_ID:
                raise ValueError(f"{where}: id {idx} is too large (ids must be below "
                                 f"{MAX_WORLD_ID}; the World vocabulary has {WORLD_VOCAB_SIZE}); "
                                 "fix the vocabulary file")
            if idx <= 0 or idx in table:
                raise ValueError(f"{where}: id {idx} is duplicated or not positive (0 is end-of-document)")
            if tok in seen:
                raise ValueError(f"{where}: token {tok!r} already has id {seen[tok]}")
            table[idx] = tok
            seen[tok] = idx
    missing = [b for b in range(256) if bytes([b]) not in seen]
    if missing:
        raise ValueError(f"{path}: single-byte tokens missing for bytes {missing[:8]}; not a World vocabulary")
    return table


class WorldTokenizer:
    """RWKV World tokenizer (vocab_size 65536, eod_id 0).

    Args:
      vocab_path: the vocabulary file; None = `find_world_vocab()`.
    """

    eod_id = 0

    def __init__(self, vocab_path: str | os.PathLike | None = None):
        self._vocab_arg = vocab_path
        self.vocab_path = find_world_vocab(vocab_path)
        table = read_world_vocab(self.vocab_path)
        self.vocab_size = max(WORLD_VOCAB_SIZE, max(table) + 1)
        # the spec that finds this file again: "world" when it was found automatically
        self.name = "world" if vocab_path is None else f"world:{self.vocab_path}"
        self._id_to_bytes: list[bytes | None] = [None] * (max(table) + 1)
        self._id_to_bytes[0] = b""
        root: dict = {}
        for idx, tok in table.items():
            self._id_to_bytes[idx] = tok
            node = root
            for byte in tok:
                child = node.get(byte)
                if child is None:
                    child = node[byte] = {}
                node = child
            node[_ID] = idx
        self._root = root
        self._fast = PieceEncoder(self.encode_bytes_trie, boundary_pairs(table.values()))

    def __reduce__(self):
        # pickles as the vocabulary path (cheap: `prepare --workers` sends it to each worker)
        return (type(self), (self._vocab_arg,))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Greedy longest-match ids of a byte string."""
        if len(data) < FAST_MIN_BYTES:
            return self.encode_bytes_trie(data)
        return self._fast.encode(bytes(data)).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """int32 [n_tokens] ids of `text` (what `encode` gives, without a Python list)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        data = text.encode("utf-8")
        if len(data) < FAST_MIN_BYTES:
            return np.asarray(self.encode_bytes_trie(data), dtype=np.int32)
        return self._fast.encode(data)

    def encode_many_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 ids of each text, tokenised independently, in one pass over the batch."""
        bad = next((t for t in texts if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"texts must be str, got {type(bad).__name__}")
        return self._fast.encode_many([t.encode("utf-8") for t in texts])

    def encode_bytes_trie(self, data: bytes) -> list[int]:
        """Greedy longest-match ids of a byte string by the trie walk alone (the reference)."""
        root = self._root
        out: list[int] = []
        emit = out.append
        n = len(data)
        i = 0
        while i < n:
            node = root
            j = i
            best_id = -1
            best_end = i
            while j < n:
                node = node.get(data[j])
                if node is None:
                    break
                j += 1
                tid = node.get(_ID)
                if tid is not None:
                    best_id = tid
                    best_end = j
            emit(best_id)  # always found: every single byte is a token
            i = best_end
        return out

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__} (use encode_bytes for bytes)")
        return self.encode_bytes(text.encode("utf-8"))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Concatenated token bytes; id 0 (end-of-document) contributes nothing."""
        table = self._id_to_bytes
        ids = list(ids)
        try:
            if ids and min(ids) < 0:
                raise IndexError
            return b"".join([table[i] for i in ids])
        except (IndexError, TypeError):
            pass
        bad = next(i for i in ids if not hasattr(i, "__index__") or not 0 <= int(i) < len(table)
                   or table[int(i)] is None)
        raise ValueError(f"id {bad!r} is not in the World vocabulary (valid ids: 0..{len(table) - 1})")

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"WorldTokenizer({str(self.vocab_path)!r})"
