"""Tokenizers: byte-level, RWKV World, Hugging Face `tokenizer.json`.

    tok = get_tokenizer("world")            # or "byte", "world:/path/vocab.txt", "hf:/path/tokenizer.json"
    ids = tok.encode("text"); text = tok.decode(ids); tok.vocab_size; tok.eod_id
"""
from __future__ import annotations

from lwm_jax.tokenizers.base import Tokenizer
from lwm_jax.tokenizers.byte import ByteTokenizer
from lwm_jax.tokenizers.hf import HFTokenizer
from lwm_jax.tokenizers.world import WorldTokenizer, find_world_vocab

SPEC_HELP = "byte | world | world:/path/to/rwkv_vocab_v20230424.txt | hf:/path/to/tokenizer.json"


def get_tokenizer(spec: str, *, eod_token: str | None = None) -> Tokenizer:
    """Builds a tokenizer from a spec string (`SPEC_HELP`).

    `eod_token` only applies to `hf:` tokenizers (see `HFTokenizer`).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tokenizer spec must be a non-empty string: {SPEC_HELP}")
    kind, _, arg = spec.partition(":")
    if kind == "byte" and not arg:
        return ByteTokenizer()
    if kind == "world":
        return WorldTokenizer(arg or None)
    if kind == "hf" and arg:
        return HFTokenizer(arg, eod_token=eod_token)
    raise ValueError(f"unknown tokenizer spec {spec!r}; expected {SPEC_HELP}")


__all__ = ["Tokenizer", "ByteTokenizer", "WorldTokenizer", "HFTokenizer", "get_tokenizer",
           "find_world_vocab", "SPEC_HELP"]
