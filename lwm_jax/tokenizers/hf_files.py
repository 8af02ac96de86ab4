"""Tokenizer files for a Hugging Face model directory, so that an exported checkpoint loads with
its tokenizer in `transformers` (`AutoTokenizer.from_pretrained(dir)`, no remote code), in FLA,
in the `tokenizers` library and in our `HFTokenizer` (`hf:DIR/tokenizer.json`).

World (`WorldTokenizer`) -> `tokenizer.json` that reproduces World's greedy longest match:
  1. pre-tokenizer `Split`: cut before every space that follows a character other than space,
     tab or newline. No World token holds such a pair of bytes (a space inside a World token
     only ever follows a space, tab or newline: checked against the vocabulary when the file is
     written), so greedy matching never crosses those cuts and the pieces can be matched one by
     one. The cuts keep pieces short, which matters for step 3's cost;
  2. pre-tokenizer `ByteLevel` (no prefix space, no regex): each byte -> one printable
     character (GPT-2's table, `byte_chars`), so tokens that are partial UTF-8 work;
  3. model `WordPiece` with an empty continuing-subword prefix: from the left, the longest
     vocabulary entry that starts the rest of the piece, which is World's rule. Every single
     byte is an entry, so nothing is ever unknown;
  4. decoder `ByteLevel`.
  Id 0 (end of document) is the special token `<|endoftext|>` (bos = eos = pad in
  `tokenizer_config.json`). The one difference from World: a text that literally contains
  `<|endoftext|>` gets id 0 for it, as special tokens do in every Hugging Face tokenizer.
  The World vocabulary file itself is written too (`rwkv_vocab_v20230424.txt`, for `world:`
  specs and RWKV tools).
A Hugging Face tokenizer (`HFTokenizer`) -> its `tokenizer.json`, copied.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lwm_jax.tokenizers.hf import HFTokenizer
from lwm_jax.tokenizers.world import VOCAB_FILENAME, WorldTokenizer, read_world_vocab

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPLIT = "(?<=[^\\t\\n ]) "      # a space after anything but whitespace: a World token boundary
_BEFORE_SPACE_OK = frozenset(b" \t\n")


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


def world_tokenizer_json(tokenizer: WorldTokenizer) -> dict:
    """The `tokenizer.json` document for a World vocabulary (see the module docstring).

    Raises ValueError (one line naming the file) for a vocabulary whose tokens hold a space
    after a non-whitespace byte: the split rule would then change the tokenization."""
    table = read_world_vocab(tokenizer.vocab_path)
    for idx, tok in table.items():
        if any(tok[i] == 0x20 and tok[i - 1] not in _BEFORE_SPACE_OK for i in range(1, len(tok))):
            raise ValueError(f"{tokenizer.vocab_path}: token {idx} ({tok!r}) holds a space after "
                             "a non-whitespace byte; this vocabulary cannot be written as a "
                             "tokenizer.json that tokenizes exactly like it")
    chars = byte_chars()
    vocab = {EOD_TOKEN: 0}
    vocab.update({"".join(chars[b] for b in tok): idx for idx, tok in sorted(table.items())})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": EOD_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _SPLIT}, "behavior": "MergedWithNext",
             "invert": False}, byte_level]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "WordPiece", "unk_token": EOD_TOKEN, "continuing_subword_prefix": "",
                  "max_input_chars_per_word": 1_000_000_000, "vocab": vocab},
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
    file; an `HFTokenizer` its `tokenizer.json` (copied) and a `tokenizer_config.json`.
    Raises ValueError (one line) for a tokenizer that has no such files (byte-level)."""
    root = Path(out_dir)
    if isinstance(tokenizer, WorldTokenizer):
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
                         "Face tokenizer files to write (supported: world, hf:...)")
    (root / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(eod), indent=2) + "\n",
                                         encoding="utf-8")
    return written + [root / TOKENIZER_CONFIG]
