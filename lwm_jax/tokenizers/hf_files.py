"""Tokenizer files for a Hugging Face model directory, so that an exported checkpoint loads with
its tokenizer in `transformers` (`AutoTokenizer.from_pretrained(dir)`, no remote code), in FLA,
in the `tokenizers` library and in our `HFTokenizer` (`hf:DIR/tokenizer.json`).

World (`WorldTokenizer`) -> `tokenizer.json` that reproduces World's greedy longest match:
  1. pre-tokenizer `ByteLevel` (no prefix space, no regex): each byte -> one printable
     character (GPT-2's table, `byte_chars`), so tokens that are partial UTF-8 work;
  2. pre-tokenizer `Split` with `longest_match_regex`: the vocabulary as a trie written as a
     regular expression whose every optional group is tried before it is skipped, so at each
     position the regex matches the longest vocabulary entry there; each match is one piece;
  3. model `WordPiece` with an empty continuing-subword prefix: each piece is one entry, found
     at once (and were it not, WordPiece's own rule is the same greedy longest match);
  4. decoder `ByteLevel`.
  Linear in the text (a trie walk per token), whatever the text: no pre-split on spaces that
  CJK text would not have. Every single byte is an entry, so nothing is ever unknown.
  Id 0 (end of document) is the special token `<|endoftext|>` (bos = eos = pad in
  `tokenizer_config.json`). The one difference from World: a text that literally contains
  `<|endoftext|>` gets id 0 for it, as special tokens do in every Hugging Face tokenizer.
  The World vocabulary file itself is written too (`rwkv_vocab_v20230424.txt`, for `world:`
  specs and RWKV tools).
Byte-level (`ByteTokenizer`: id = UTF-8 byte value, no offset, id 0 = the NUL byte = end of
document) -> `tokenizer.json` that gives exactly our ids for every text:
  1. pre-tokenizer `ByteLevel` (no prefix space, no regex) as above, the whole text one piece;
  2. model `BPE` with no merges and the 256 byte characters as its vocabulary, id = byte value:
     each byte is one token;
  3. decoder `ByteLevel`: ids -> bytes -> text, an invalid UTF-8 sequence -> U+FFFD, as
     `ByteTokenizer.decode` (both replace each maximal invalid subpart by one U+FFFD).
  Id 0 is the special token whose text is the NUL character (U+0000) itself, so the files can
  name an end-of-document token (bos = eos = pad) without changing any encoding: NUL in a text
  is matched as that special token, which is id 0, the id the byte gives anyway, and it
  decodes back to NUL. A named token such as `<|endoftext|>` would instead turn that literal
  text into id 0, unlike `ByteTokenizer`. (`tokenizers` numbers a special token by the
  vocabulary entry of the same text, so the vocabulary lists NUL, not byte 0's `ByteLevel`
  character, for id 0; NUL never reaches the model, being matched first.)
  `skip_special_tokens=True` drops id 0, the end of document, when decoding.
A Hugging Face tokenizer (`HFTokenizer`) -> its `tokenizer.json`, copied.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lwm_jax.tokenizers.byte import ByteTokenizer
from lwm_jax.tokenizers.hf import HFTokenizer
from lwm_jax.tokenizers.world import VOCAB_FILENAME, WorldTokenizer, read_world_vocab

EOD_TOKEN = "<|endoftext|>"
BYTE_EOD_TOKEN = "\x00"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")


def byte_chars() -> list[str]:
    """The printable character standing for each byte 0..255 (GPT-2 / `ByteLevel`): printable
    Latin-1 bytes stand for themselves, the other bytes, in order, for U+0100, U+0101, ..."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _escape(ch: str) -> str:
    return "\\" + ch if ch in _REGEX_SPECIAL else ch


def longest_match_regex(tokens) -> str:
    """A regular expression that matches, at any position, the longest of `tokens` (strings)
    starting there: the tokens' trie, each node `(?:c1 R1|c2 R2|...)`, made optional (`?`,
    greedy: the longer match is tried first) where the path so far is itself a token."""
    trie: dict = {}
    for tok in tokens:
        node = trie
        for ch in tok:
            node = node.setdefault(ch, {})
        node[None] = True

    def node_regex(node: dict) -> str:
        alts = [_escape(ch) + node_regex(child)
                for ch, child in sorted((k, v) for k, v in node.items() if k is not None)]
        if not alts:
            return ""
        group = alts[0] if len(alts) == 1 and None not in node else f"(?:{'|'.join(alts)})"
        return group + "?" if None in node else group
    return node_regex(trie)


def world_tokenizer_json(tokenizer: WorldTokenizer) -> dict:
    """The `tokenizer.json` document for a World vocabulary (see the module docstring)."""
    table = read_world_vocab(tokenizer.vocab_path)
    chars = byte_chars()
    entries = {"".join(chars[b] for b in tok): idx for idx, tok in sorted(table.items())}
    vocab = {EOD_TOKEN: 0, **entries}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": longest_match_regex(entries)},
             "behavior": "Isolated", "invert": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": EOD_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [byte_level, split]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "WordPiece", "unk_token": EOD_TOKEN, "continuing_subword_prefix": "",
                  "max_input_chars_per_word": 1_000_000_000, "vocab": vocab},
    }


def byte_tokenizer_json() -> dict:
    """The `tokenizer.json` document for `ByteTokenizer` (see the module docstring)."""
    chars = byte_chars()
    vocab = {BYTE_EOD_TOKEN if b == 0 else chars[b]: b for b in range(256)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": BYTE_EOD_TOKEN, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True}],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def tokenizer_config(eod_token: str = EOD_TOKEN) -> dict:
    """`tokenizer_config.json` for `transformers`: the fast tokenizer class, no automatic
    special tokens, the end-of-document token as bos / eos / pad."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod_token,
            "eos_token": eod_token, "pad_token": eod_token, "add_bos_token": False,
            "add_eos_token": False, "clean_up_tokenization_spaces": False}


def write_tokenizer_files(tokenizer, out_dir: str | os.PathLike) -> list[Path]:
    """Write `tokenizer`'s Hugging Face files into `out_dir` (which must exist); returns their
    paths. A World tokenizer gets `tokenizer.json`, `tokenizer_config.json` and its vocabulary
    file; a `ByteTokenizer` and an `HFTokenizer` get `tokenizer.json` (the latter's copied) and a
    `tokenizer_config.json`. Raises ValueError (one line) for any other tokenizer."""
    root = Path(out_dir)
    if isinstance(tokenizer, ByteTokenizer):
        doc, eod = byte_tokenizer_json(), BYTE_EOD_TOKEN
        (root / TOKENIZER_JSON).write_text(json.dumps(doc) + "\n", encoding="utf-8")
        written = [root / TOKENIZER_JSON]
    elif isinstance(tokenizer, WorldTokenizer):
        doc, eod = world_tokenizer_json(tokenizer), EOD_TOKEN
        (root / TOKENIZER_JSON).write_text(json.dumps(doc, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
        shutil.copyfile(tokenizer.vocab_path, root / VOCAB_FILENAME)
        written = [root / TOKENIZER_JSON, root / VOCAB_FILENAME]
    elif isinstance(tokenizer, HFTokenizer):
        shutil.copyfile(tokenizer.path, root / TOKENIZER_JSON)
        eod = tokenizer.decode([tokenizer.eod_id])
        written = [root / TOKENIZER_JSON]
    else:
        raise ValueError(f"tokenizer: {getattr(tokenizer, 'name', tokenizer)!r} has no Hugging "
                         "Face tokenizer files to write (supported: byte, world, hf:...)")
    (root / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(eod), indent=2) + "\n",
                                         encoding="utf-8")
    return written + [root / TOKENIZER_CONFIG]
