"""How evaluation-harness requests (text) become token ids: the conventions, in one place.

Prefix. Every request's tokens start with `prefix_ids`, chosen by name (`prefix_ids_for`):
  "eod"     the tokenizer's end-of-document id (0 for RWKV World and byte): a context then
            starts the way every training document after the first does (default);
  "newline" the tokens of "\\n" (BlinkDL's RWKV-LM `run_lm_eval.py` prepends these);
  "none"    nothing; an empty context (or a rolling text) then gets the end-of-document id,
            as lm-eval's Hugging Face model does with its prefix token.

Pairs `(context, continuation)` (lm-eval's `loglikelihood`): trailing whitespace of the context
moves to the front of the continuation; `context + continuation` is encoded whole and split
after the tokens of the context alone, so the continuation is tokenized as it would be in the
running text. When the whole text's tokens do not start with the context's (a token straddles
the seam), the continuation is encoded on its own instead, so no continuation loses tokens.

Rolling texts (`loglikelihood_rolling`): every token of the text is predicted once, the first
from the prefix. A recurrent model scores the text as one pair `(prefix, text)` with its state
carried through windows (no truncation); a model with a bounded context (`max_len` tokens)
scores it as disjoint pieces of `max_len` predicted tokens, each with as much preceding text as
fits (`rolling_pairs`), as lm-eval does.
"""
from __future__ import annotations

from typing import Sequence

PREFIXES = ("eod", "newline", "none")


def prefix_ids_for(name: str, tokenizer) -> tuple[int, ...]:
    """The prefix token ids called `name` (see the module docstring); ValueError otherwise."""
    if name == "eod":
        return (int(tokenizer.eod_id),)
    if name == "newline":
        return tuple(int(t) for t in tokenizer.encode("\n"))
    if name == "none":
        return ()
    raise ValueError(f"prefix: {name!r} is not one of {', '.join(PREFIXES)}")


def encode_pair(tokenizer, context: str, continuation: str,
                prefix_ids: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """`(context ids, continuation ids)`; the context ids start with `prefix_ids` and are never
    empty (an empty context with no prefix is the end-of-document id)."""
    if not isinstance(context, str) or not isinstance(continuation, str):
        raise TypeError(f"loglikelihood: context and continuation must be strings, got "
                        f"{type(context).__name__} and {type(continuation).__name__}")
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    context = stripped
    ctx = list(tokenizer.encode(context)) if context else []
    if not continuation:
        cont: list[int] = []
    elif not ctx:
        cont = list(tokenizer.encode(continuation))
    else:
        whole = list(tokenizer.encode(context + continuation))
        cont = whole[len(ctx):] if whole[: len(ctx)] == ctx else list(tokenizer.encode(continuation))
    head = list(prefix_ids) if (prefix_ids or ctx) else [int(tokenizer.eod_id)]
    return head + ctx, cont


def rolling_head(tokenizer, prefix_ids: Sequence[int] = ()) -> list[int]:
    """The tokens a rolling text is conditioned on: `prefix_ids`, else the end-of-document id."""
    return list(prefix_ids) if prefix_ids else [int(tokenizer.eod_id)]


def rolling_pairs(head: Sequence[int], tokens: Sequence[int],
                  max_len: int) -> list[tuple[list[int], list[int]]]:
    """Pairs `(context, continuation)` covering `tokens` for a model that sees at most `max_len`
    input tokens: each piece predicts up to `max_len` tokens, its context is the preceding
    `head + tokens` cut to leave `max_len` inputs in all (the piece's own inputs included)."""
    if max_len < 1:
        raise ValueError(f"max_len: must be >= 1, got {max_len}")
    if not head:
        raise ValueError("rolling: the head (prefix) must hold at least one token")
    full = list(head) + list(tokens)
    h = len(head)
    pairs = []
    for start in range(0, len(tokens), max_len):
        stop = min(start + max_len, len(tokens))
        # predicts full[h + start: h + stop]; inputs are full[first: h + stop - 1]
        first = max(0, h + stop - 1 - max_len)
        pairs.append((full[first: h + start], full[h + start: h + stop]))
    return pairs


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`(text before the earliest occurrence of any stop string, whether one occurred)`."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
