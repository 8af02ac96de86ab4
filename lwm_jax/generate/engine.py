"""RNN-mode text generation for RWKV-7: chunked prefill, then one jitted O(1) step per token.

How a batch of prompts of different lengths is run exactly (no padding ever enters the state):
1. joint prefill: the first `P` tokens of every prompt, `P` = the largest multiple of
   `prefill_chunk` that is < the shortest prompt's length, go through the model's full-sequence
   path (its configured WKV, chunked on CPU) in `[B, prefill_chunk]` pieces, carrying the state;
2. stepping: each step feeds one token per row through the model with `wkv_impl="recurrent"`.
   A row whose prompt is not finished is fed its next prompt token ("forced"); a row past its
   prompt is fed the token it sampled at the previous step. Finished rows keep their state
   frozen (masked update) while the others go on.
Both compiled functions have fixed shapes, so the step compiles once per model structure and
batch size (and the prefill likewise), whatever the prompts, lengths or sampling settings.

The state returned at the end has consumed each row's prompt and every token returned for that
row (a stop token is not returned and not consumed), ready to continue the conversation.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.generate.sampling import SamplingParams, apply_penalties, sample
from lwm_jax.generate.state_io import broadcast_state


@dataclasses.dataclass
class GenerationResult:
    """Output of `Generator.generate`.

    tokens: generated ids per row (stop token excluded).
    finish_reasons: per row, "stop" (a stop token was sampled) or "length" (max_new_tokens).
    state: `RWKV7State` after each row's prompt and returned tokens.
    logits: per row, float32 `[n_generated, V]` raw (pre-penalty) logits each returned token
      was drawn from, when `return_logits=True`; else None.
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    state: object
    logits: list[np.ndarray] | None = None


def _as_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if len(prompts) and all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]
    out = [[int(t) for t in p] for p in prompts]
    if not out:
        raise ValueError("prompts: no prompt given")
    for i, p in enumerate(out):
        if not p:
            raise ValueError(f"prompts[{i}]: empty prompt; start it with at least one token "
                             "(RWKV models use 0, the end-of-document id, as a neutral start)")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompts[{i}]: token ids must lie in [0, {vocab_size}), "
                             f"got [{min(p)}, {max(p)}]")
    return out


# How often each compiled function has been traced (= compiled), over all Generators. The
# functions are module-level with the model's graph definition as a static argument, so every
# Generator of the same model structure shares one compiled step per batch size.
TRACES: collections.Counter = collections.Counter()


def _prefill_fn(graph, params, rest, tokens_BT, state):
    TRACES["prefill"] += 1  # runs only while tracing
    model = nnx.merge(graph, params, rest)
    _, state = model(tokens_BT, state=state, return_state=True)
    return state


def _step_fn(graph, params, rest, state, feed_B, forced_B, is_forced_B, active_B, counts_BV, key,
             sp):
    """One token per row: model step (recurrent WKV), penalties, sampling, forced prompt tokens,
    masked state update for rows that are already finished."""
    TRACES["step"] += 1  # runs only while tracing
    model = nnx.merge(graph, params, rest)
    logits, new_state = model(feed_B[:, None], state=state, return_state=True)
    logits_BV = logits[:, 0].astype(jnp.float32)
    key, sub = jax.random.split(key)
    sampled = sample(apply_penalties(logits_BV, counts_BV, sp), sub, sp)
    nxt_B = jnp.where(is_forced_B, forced_B, sampled)
    emit_B = (active_B & ~is_forced_B).astype(jnp.int32)
    counts_BV = counts_BV + jax.nn.one_hot(nxt_B, logits_BV.shape[-1], dtype=jnp.int32) \
        * emit_B[:, None]

    def keep(new, old):
        mask = active_B.reshape((1, -1) + (1,) * (new.ndim - 2))
        return jnp.where(mask, new, old)
    return nxt_B, jax.tree.map(keep, new_state, state), counts_BV, key, logits_BV


_prefill = jax.jit(_prefill_fn, static_argnums=0)
_step = jax.jit(_step_fn, static_argnums=0)


class Generator:
    """Prefill + step driver for one model.

    Args:
      model: an `RWKV7` (its parameters are read now; later in-place changes are not seen).
      prefill_chunk: tokens per prefill call (a multiple of the model's chunk size is best).
    Compiled functions are shared (see `TRACES`): a second Generator for a model of the same
    structure compiles nothing new.
    """

    def __init__(self, model, prefill_chunk: int = 256):
        from lwm_jax.interop.params import abstract_model
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: must be a positive integer, got {prefill_chunk!r}")
        self.cfg, self.policy = model.cfg, model.policy
        self.prefill_chunk = prefill_chunk
        self._prefill_graph, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        step_cfg = dataclasses.replace(self.cfg, wkv_impl="recurrent")
        self._step_graph = nnx.split(abstract_model(step_cfg, self.policy), nnx.Param, ...)[0]
        self._init_state = model.init_state

    # ------------------------------------------------------------------ driver
    def stream(self, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
               stop_tokens: Sequence[int] = (), seed: int = 0, initial_state=None,
               return_logits: bool = False) -> Iterator[tuple[int, int]]:
        """Yield `(row, token)` as each row produces a token; returns a `GenerationResult`
        (as the generator's return value; `generate` collects it)."""
        sp = (sampling or SamplingParams()).as_arrays()
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: must be an integer >= 0, got {max_new_tokens!r}")
        rows = _as_prompts(prompts, self.cfg.vocab_size)
        B, lens = len(rows), np.array([len(p) for p in rows])
        prompt_BT = np.zeros((B, lens.max()), np.int32)
        for i, p in enumerate(rows):
            prompt_BT[i, : len(p)] = p
        state = (self._init_state(B) if initial_state is None
                 else broadcast_state(initial_state, B))
        chunk = self.prefill_chunk
        P = (int(lens.min()) - 1) // chunk * chunk
        for start in range(0, P, chunk):
            state = _prefill(self._prefill_graph, self._params, self._rest,
                             jnp.asarray(prompt_BT[:, start: start + chunk]), state)
        stops = {int(t) for t in stop_tokens}
        out: list[list[int]] = [[] for _ in range(B)]
        kept: list[list[np.ndarray]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        running = np.ones(B, bool)
        counts = jnp.zeros((B, self.cfg.vocab_size), jnp.int32)
        key = jax.random.key(seed)
        feed, pos = prompt_BT[:, P].copy(), P
        while running.any():
            is_forced = pos + 1 < lens
            forced = np.where(is_forced, prompt_BT[:, np.minimum(pos + 1, lens.max() - 1)], 0)
            nxt, state, counts, key, logits = _step(
                self._step_graph, self._params, self._rest, state, jnp.asarray(feed, jnp.int32),
                jnp.asarray(forced, jnp.int32), jnp.asarray(is_forced), jnp.asarray(running),
                counts, key, sp)
            nxt = np.asarray(nxt)
            logits_host = np.asarray(logits) if return_logits else None
            for i in np.flatnonzero(running & ~is_forced):
                tok = int(nxt[i])
                if len(out[i]) == max_new_tokens:
                    running[i] = False            # its last token is now consumed
                elif tok in stops:
                    running[i], reasons[i] = False, "stop"
                else:
                    out[i].append(tok)
                    if return_logits:
                        kept[i].append(logits_host[i])
                    yield i, tok
            feed, pos = nxt, pos + 1
        logits_out = ([np.stack(k) if k else np.zeros((0, self.cfg.vocab_size), np.float32)
                       for k in kept] if return_logits else None)
        return GenerationResult(out, reasons, state, logits_out)

    def generate(self, prompts, max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop_tokens: Sequence[int] = (),
                 seed: int = 0, initial_state=None, return_logits: bool = False,
                 on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Run `stream` to the end (calling `on_token(row, token)` for each token)."""
        it = self.stream(prompts, max_new_tokens, sampling, stop_tokens, seed, initial_state,
                         return_logits)
        while True:
            try:
                row, tok = next(it)
            except StopIteration as done:
                return done.value
            if on_token is not None:
                on_token(row, tok)

    def prefill_state(self, prompts, initial_state=None):
        """State after consuming `prompts` entirely (nothing generated), for `save_state`."""
        return self.generate(prompts, max_new_tokens=0, initial_state=initial_state).state


def generate(model, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             **kwargs) -> GenerationResult:
    """`Generator(model).generate(...)` (compiled functions are shared between calls)."""
    return Generator(model).generate(prompts, max_new_tokens, sampling, **kwargs)
