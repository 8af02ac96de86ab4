"""The three request kinds of an evaluation harness, on text, for any of our models, without
depending on lm-eval (`lwm_jax.eval.lm_eval_adapter` wraps this class in lm-eval's `LM`).

    hm = HarnessModel(model, tokenizer, batch_size=8)
    hm.loglikelihood([("The cat sat on the", " mat")])      # [(log p, is_greedy)]
    hm.loglikelihood_rolling(["A whole document."])         # [log p of every token]
    hm.generate_until([("Q: 2+2?\\nA:", {"until": ["\\n"], "max_gen_toks": 16})])   # [text]

Token conventions (prefix, pair split, rolling windows): `lwm_jax.eval.requests`. Scoring:
`lwm_jax.eval.batched.PairScorer` (an RWKV-7 carries its state through long contexts and shares
a context between the answers of a question). Generation: `lwm_jax.generate.Generator`;
the text is cut at the first `until` string, and a batch stops early once every row has
produced one (or the end-of-document token).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from lwm_jax.eval.batched import PairScorer
from lwm_jax.eval.requests import (cut_at_stop, encode_pair, prefix_ids_for, rolling_head,
                                   rolling_pairs)

GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")
DEFAULT_MAX_GEN_TOKS = 256


def _gen_settings(kwargs: Any, i: int) -> tuple[tuple[str, ...], int, Any]:
    """`(until strings, max_gen_toks, SamplingParams)` from lm-eval's generation kwargs."""
    from lwm_jax.generate.sampling import SamplingParams
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - set(GEN_KEYS))
    if unknown:
        raise ValueError(f"generate_until: request {i} sets {unknown[0]!r}, which is not "
                         f"supported (supported: {', '.join(GEN_KEYS)})")
    until = kwargs.get("until") or ()
    until = (until,) if isinstance(until, str) else tuple(until)
    if not all(isinstance(s, str) for s in until):
        raise ValueError(f"generate_until: request {i}: 'until' must be a string or a list of "
                         f"strings, got {until!r}")
    max_gen = kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
    if not isinstance(max_gen, int) or isinstance(max_gen, bool) or max_gen < 1:
        raise ValueError(f"generate_until: request {i}: max_gen_toks must be a positive "
                         f"integer, got {max_gen!r}")
    temperature = float(kwargs.get("temperature", 0.0 if not kwargs.get("do_sample") else 1.0))
    if not kwargs.get("do_sample") or temperature == 0.0:
        return until, max_gen, SamplingParams(temperature=0.0)
    return until, max_gen, SamplingParams(temperature=temperature,
                                          top_p=float(kwargs.get("top_p", 1.0)),
                                          top_k=int(kwargs.get("top_k", 0)))


class HarnessModel:
    """Text-level `loglikelihood`, `loglikelihood_rolling` and `generate_until` for one model.

    Args:
      model: an `RWKV7`, a `Llama` or an `RWKVHybrid` (the hybrid: scoring only, it has no
        state for `generate_until`).
      tokenizer: its tokenizer (`lwm_jax.tokenizers`).
      batch_size, window, granule: see `PairScorer` (also the generation batch).
      prefix: "eod" | "newline" | "none" (`lwm_jax.eval.requests`).
      prefill_chunk, decode_block: see `Generator`.
      seed: sampling seed (only used by requests with `do_sample`).
      progress: optional callable `progress(kind, n_total)` returning an updater
        `update(n_done)`, or None (silent).
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 8, window: int = 1024,
                 granule: int = 32, prefix: str = "eod", prefill_chunk: int = 256,
                 decode_block: int = 16, seed: int = 0,
                 progress: Callable[[str, int], Callable[[int], None]] | None = None):
        if tokenizer.vocab_size > model.cfg.vocab_size:
            raise ValueError(f"tokenizer: {tokenizer.name!r} has {tokenizer.vocab_size} ids but "
                             f"the model only {model.cfg.vocab_size}")
        self.model, self.tokenizer = model, tokenizer
        self.scorer = PairScorer(model, batch_size=batch_size, window=window, granule=granule)
        self.prefix_ids = prefix_ids_for(prefix, tokenizer)
        self.batch_size, self.seed = batch_size, seed
        self._gen_args = (prefill_chunk, decode_block)
        self._generator = None
        self._progress = progress
        self.n_truncated_prompts = 0   # generation prompts cut from the left (KV cache models)

    @property
    def n_truncated(self) -> int:
        """Requests whose context lost tokens to a bounded context window (KV cache models)."""
        return self.scorer.n_truncated + self.n_truncated_prompts

    def _updater(self, kind: str, total: int) -> Callable[[int], None] | None:
        return None if self._progress is None or total == 0 else self._progress(kind, total)

    # ------------------------------------------------------------------ scoring
    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """`(log p(continuation | context) in nats, is_greedy)` per `(context, continuation)`."""
        pairs = [encode_pair(self.tokenizer, c, x, self.prefix_ids) for c, x in requests]
        return self.scorer.score(pairs, self._updater("loglikelihood", len(pairs)))

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """log p of every token of each text (nats), the first conditioned on the prefix."""
        head = rolling_head(self.tokenizer, self.prefix_ids)
        pairs, owner = [], []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"loglikelihood_rolling: texts[{i}] must be a string, got "
                                f"{type(text).__name__}")
            tokens = list(self.tokenizer.encode(text))
            if self.scorer.recurrent:
                pieces = [(head, tokens)] if tokens else []
            else:
                pieces = rolling_pairs(head, tokens, self.scorer.max_len)
            pairs += pieces
            owner += [i] * len(pieces)
        totals = [0.0] * len(texts)
        scores = self.scorer.score(pairs, self._updater("loglikelihood_rolling", len(pairs)))
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        return totals

    # ------------------------------------------------------------------ generation
    def _prompt(self, context: str, max_gen: int, i: int) -> list[int]:
        if not isinstance(context, str):
            raise TypeError(f"generate_until: request {i}'s context must be a string, got "
                            f"{type(context).__name__}")
        ids = list(self.prefix_ids) + list(self.tokenizer.encode(context))
        ids = ids or [int(self.tokenizer.eod_id)]
        limit = getattr(self.model.cfg, "max_seq_len", None) if not self.scorer.recurrent else None
        if limit is not None:
            if max_gen >= limit:
                raise ValueError(f"generate_until: request {i}: max_gen_toks={max_gen} leaves no "
                                 f"room for a prompt in the model's max_seq_len={limit}")
            if len(ids) > limit - max_gen:
                ids = ids[len(ids) - (limit - max_gen):]
                self.n_truncated_prompts += 1
        return ids

    def generate_until(self, requests: Sequence[tuple[str, Any]]) -> list[str]:
        """Generated text per `(context, gen_kwargs)`, cut before the first `until` string.

        `gen_kwargs` (lm-eval's): `until` (str or list), `max_gen_toks` (default 256),
        `do_sample` (default False = greedy), `temperature`, `top_p`, `top_k`; any other key is
        a one-line ValueError. Generation also stops at the tokenizer's end-of-document id.
        """
        jobs: dict[str, list[tuple[int, list[int]]]] = {}
        settings = {}
        for i, (context, kwargs) in enumerate(requests):
            until, max_gen, sampling = _gen_settings(kwargs, i)
            key = json.dumps([until, max_gen, repr(sampling)])
            settings[key] = (until, max_gen, sampling)
            jobs.setdefault(key, []).append((i, self._prompt(context, max_gen, i)))
        out = [""] * len(requests)
        update = self._updater("generate_until", len(requests))
        for key, items in jobs.items():
            items.sort(key=lambda item: -len(item[1]))
            for first in range(0, len(items), self.batch_size):
                batch = items[first: first + self.batch_size]
                texts = self._generate_batch([p for _, p in batch], *settings[key])
                for (i, _), text in zip(batch, texts):
                    out[i] = text
                if update is not None:
                    update(len(batch))
        return out

    def _generate_batch(self, prompts: list[list[int]], until, max_gen: int,
                        sampling) -> list[str]:
        """Texts of `prompts` (padded to `batch_size` rows with copies of the last, so the
        decode step compiles once), each cut at its first `until` string."""
        from lwm_jax.generate.engine import Generator
        if self._generator is None:
            self._generator = Generator(self.model, *self._gen_args)
        n = len(prompts)
        rows = prompts + [prompts[-1]] * (self.batch_size - n)
        tokens: list[list[int]] = [[] for _ in rows]
        done = [j >= n for j in range(len(rows))]
        stream = self._generator.stream(rows, max_gen, sampling,
                                        stop_tokens=[int(self.tokenizer.eod_id)], seed=self.seed)
        for row, token in stream:
            if done[row]:
                continue
            tokens[row].append(token)
            if until and cut_at_stop(self.tokenizer.decode(tokens[row]), until)[1]:
                done[row] = True
                if all(done):
                    break           # the remaining decode blocks are not needed
        return [cut_at_stop(self.tokenizer.decode(t), until)[0] for t in tokens[:n]]
