"""Hugging Face `tokenizer.json` files through the `tokenizers` package (optional dependency).

The end-of-document id: `eod_token` when given (looked up in the vocabulary), else the special
token whose text comes first in `_EOD_NAMES` (GPT-NeoX / Pile tokenizers, which RWKV-4 used, have
`<|endoftext|>` = 0; Llama 2 has `</s>` = 2; the byte-level files `lwm-jax export` writes have
the NUL character = 0, `lwm_jax.tokenizers.hf_files`). A tokenizer with none of these raises,
asking for `eod_token` (guessing e.g. `<unk>` or `<pad>` would silently corrupt document
boundaries).

The file is read by Python and parsed from text (`Tokenizer.from_str`), so a path that is not
valid UTF-8 (a directory name in another encoding) works as well as any other.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

_EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>",
              "\x00")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("hf: tokenizers need the `tokenizers` package: pip install tokenizers "
                          "(or pip install 'lwm_jax[tokenizers]')") from None
    return tokenizers


class HFTokenizer:
    """Wraps `tokenizers.Tokenizer.from_file(path)`; encodes without adding special tokens.

    Args:
      path: a `tokenizer.json` file.
      eod_token: the end-of-document token's text (e.g. "<|endoftext|>"); None = detect.
    """

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None):
        tokenizers = _import_tokenizers()
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"hf: tokenizer file {self.path} not found (pass hf:/path/to/tokenizer.json)")
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"hf: {self.path} is not UTF-8 text (byte {e.start}); give a "
                             "tokenizers JSON file") from None
        try:
            self._tok = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
            raise ValueError(f"hf: cannot load {self.path} as a tokenizers JSON file ({e})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.name = f"hf:{self.path}"
        self.eod_id = self._find_eod(eod_token)

    def _find_eod(self, eod_token: str | None) -> int:
        if eod_token is not None:
            idx = self._tok.token_to_id(eod_token)
            if idx is None:
                raise ValueError(f"eod_token {eod_token!r} is not in the vocabulary of {self.path}")
            return int(idx)
        special = {t.content: int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        for name in _EOD_NAMES:
            if name in special:
                return special[name]
        raise ValueError(f"{self.path}: cannot tell the end-of-document token (special tokens: "
                         f"{sorted(special)[:8]}); pass eod_token=...")

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, eod_id={self.eod_id})"
