"""LAMBADA-style last-word prediction from a local JSONL file (no downloads).

Each line is a JSON object with a `"text"` string. The target is the last word: the text after
the last space, tokenized WITH its leading space (`" word"`), the context is everything before
that space. An example is correct when greedy decoding after the context reproduces every token
of the target; because greedy decoding feeds back its own argmax, that is the same as the argmax
matching the target at every target position under teacher forcing, which is how it is computed
(batched, one pass). Also reported: perplexity = exp(mean over examples of the target's total
negative log-likelihood), the usual LAMBADA perplexity.

Scoring is lm-eval's `loglikelihood` (`lwm_jax.eval.batched.PairScorer`), so every model family
works as it does under `--tasks`: a recurrent model (RWKV-7) sees the whole context at any
length; a model with a bounded window (LLaMA's `max_seq_len`, the hybrid's `window`) loses
context tokens from the left when an example does not fit, and `n_truncated` counts those
examples.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import TYPE_CHECKING, Sequence

import numpy as np

from lwm_jax.user_input import check_encodable

if TYPE_CHECKING:           # imported when scoring: reading examples stays light (no jax)
    from lwm_jax.eval.batched import PairScorer


@dataclasses.dataclass(frozen=True)
class LambadaResult:
    """n: examples; n_correct: greedy hits; target_nats: per-example target NLL (nats);
    n_truncated: examples whose context was cut from the left to fit the scoring window."""

    n: int
    n_correct: int
    target_nats: tuple[float, ...]
    n_truncated: int = 0

    @property
    def accuracy(self) -> float:
        return self.n_correct / self.n

    @property
    def perplexity(self) -> float:
        """exp(mean target nats); inf when that overflows a float."""
        try:
            return math.exp(float(np.mean(self.target_nats)))
        except OverflowError:
            return math.inf

    def to_dict(self) -> dict:
        return {"n": self.n, "n_correct": self.n_correct, "accuracy": self.accuracy,
                "perplexity": self.perplexity, "n_truncated": self.n_truncated}


def split_last_word(text: str) -> tuple[str, str]:
    """`"the cat sat"` -> `("the cat", " sat")` (trailing whitespace dropped first)."""
    body = text.rstrip()
    cut = body.rfind(" ")
    if cut <= 0 or cut == len(body) - 1:
        raise ValueError(f"lambada: text {body[-60:]!r} has no 'context last-word' split at a space")
    return body[:cut], body[cut:]


def read_jsonl(path: str | os.PathLike, max_examples: int | None = None) -> list[str]:
    """The `"text"` field of each non-empty line of a JSONL file (at most `max_examples`).

    Raises ValueError naming `file:line` for a line that is not UTF-8, not JSON, has no string
    `"text"`, a text holding a lone surrogate or without a last word (`split_last_word`), for a
    path that is not a regular file (a FIFO would block) and for a file without examples;
    OSError when it cannot be opened.
    """
    texts: list[str] = []
    name = os.fspath(path)
    if os.path.exists(name) and not os.path.isfile(name):   # a FIFO would block open()
        kind = "a directory" if os.path.isdir(name) else "a FIFO, device or socket"
        raise ValueError(f"--lambada: {name!r} is not a regular file ({kind}); give a JSONL file")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{os.fspath(path)}:{lineno}: not UTF-8 text (byte {err.start} "
                                 "of the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{os.fspath(path)}:{lineno}: not JSON ({err.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise ValueError(f"{os.fspath(path)}:{lineno}: expected an object with a "
                                 "string 'text' field")
            text = obj["text"]
            check_encodable(text, f"{name}:{lineno}")
            try:
                split_last_word(text)
            except ValueError:
                raise ValueError(f"{name}:{lineno}: 'text' has no 'context last-word' split at "
                                 "a space (LAMBADA needs context, a space, then the last "
                                 "word)") from None
            texts.append(text)
            if max_examples is not None and len(texts) >= max_examples:
                break
    if not texts:
        raise ValueError(f"{os.fspath(path)}: no examples")
    return texts


def encode_examples(tokenizer, texts: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    """`(context ids, target ids)` per text (context and `" word"` tokenized separately)."""
    out = []
    for text in texts:
        context, target = split_last_word(text)
        out.append((list(tokenizer.encode(context)), list(tokenizer.encode(target))))
    return out


def last_word_accuracy(scorer: PairScorer,
                       examples: Sequence[tuple[Sequence[int], Sequence[int]]],
                       progress=None) -> LambadaResult:
    """Score `(context ids, target ids)` pairs with `scorer` (its `batch_size` rows per call).

    `progress`: optional callable told the number of examples finished by each batch."""
    from lwm_jax.eval.batched import PairScorer
    if not isinstance(scorer, PairScorer):
        raise TypeError(f"last_word_accuracy: scorer must be a PairScorer, got "
                        f"{type(scorer).__name__}")
    if not examples:
        raise ValueError("lambada: no examples")
    for i, (ctx, tgt) in enumerate(examples):
        if not ctx or not tgt:
            raise ValueError(f"lambada: example {i} has an empty context or target")
    before = scorer.n_truncated
    scores = scorer.score(examples, progress)
    return LambadaResult(n=len(examples), n_correct=sum(hit for _, hit in scores),
                         target_nats=tuple(-logp for logp, _ in scores),
                         n_truncated=scorer.n_truncated - before)
