"""Text generation: chunked prefill, then decoding in on-device blocks. RWKV-7 runs in RNN
mode (its recurrent state); a LLaMA-style model runs on a KV cache (`lwm_jax.layers.attention`).

State protocol: the model's `init_state(B)` (RWKV-7) or `init_state(B, max_len)` (a KV cache,
sized for the call: the longest prompt plus `max_new_tokens`, rounded up to a power of two so
that calls of similar lengths share compilations, at most the model's `max_seq_len`) gives a
pytree whose every leaf has the layer axis first and the batch axis second;
`model(tokens_BT, state=..., return_state=True)` consumes tokens and returns the new state.
Everything below treats the state only through that protocol.

How a batch of prompts of different lengths is run exactly (no padding ever enters the state):
1. joint prefill: the first `P` tokens of every prompt, `P` = the largest multiple of
   `prefill_chunk` that is < the shortest prompt's length, go through the model's full-sequence
   path (its configured WKV, chunked on CPU) in `[B, prefill_chunk]` pieces, carrying the state;
2. stepping: each step feeds one token per row through the model with `wkv_impl="recurrent"`.
   A row whose prompt is not finished is fed its next prompt token ("forced"); a row past its
   prompt is fed the token it sampled at the previous step. Finished rows keep their state
   frozen (masked update) while the others go on.
3. blocks: `decode_block` steps run inside one compiled `lax.scan` with no host round trip.
   The per-row bookkeeping lives on the device too: the count of returned tokens (a row that
   already returned `max_new_tokens` finishes "length" at its next step, which consumes its
   last token), stop-token detection through a boolean `[V]` mask (finish "stop"), and the
   running flag. The carried state, token counts, last logits and key are donated, so the state
   buffers are updated in place (a caller's `initial_state` and `initial_logits` are copied
   first and stay valid). Per block the host gets tokens `[K, B]` int32 and event codes
   `[K, B]` int8 (0 nothing, 1 token returned, 2 finished "stop", 3 finished "length"), plus
   float32 logits `[K, B, V]` only when `return_logits` (a static flag). The next block is
   launched before the host reads the current one, so host work overlaps device work; a block
   the host already knows is not needed (every row has reached `max_new_tokens`) is never
   launched, and one launched in vain (all rows hit a stop token) changes nothing, since
   finished rows are frozen.
The forced prompt tokens of each block are host-built `[K, B]` arrays and every setting (sampling
knobs, `max_new_tokens`, stop mask) is a traced array, so the block compiles once per model
structure, batch size, block length and `return_logits` (the prefill once per model structure
and batch size), whatever the prompts, lengths or settings. Steps split the key exactly as a
one-token-at-a-time loop would, so tokens do not depend on `decode_block`.

The state returned at the end has consumed each row's prompt and every token returned for that
row (a stop token is not returned and not consumed), ready to continue the conversation; the
block carry also keeps each row's logits after its last consumed token (`last_logits`: the
step that finishes a row computes them, then the row is frozen), so that a later call can draw
the next token from them without new text.

Continuing without new text: with `initial_logits` (the `last_logits` that belong to
`initial_state`), a row may have an empty prompt. Its first step takes its token from those
logits instead of the model's output (the model still runs on the batch, but that row's state is
not updated), so the tokens are exactly those of one uninterrupted call under greedy decoding.
Sampled tokens follow the new call's seed, and penalties count only tokens generated in this call.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
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
    state: `RWKV7State` (a `Llama`'s `KVCache`) after each row's prompt and returned tokens.
    logits: per row, float32 `[n_generated, V]` raw (pre-penalty) logits each returned token
      was drawn from, when `return_logits=True`; else None.
    last_logits: float32 `[B, V]`, each row's raw logits after the last token `state` consumed
      (its next token is drawn from them; what `save_state` stores beside the state).
    """

    tokens: list[list[int]]
    finish_reasons: list[str]
    state: object
    logits: list[np.ndarray] | None = None
    last_logits: np.ndarray | None = None


def _as_prompts(prompts, vocab_size: int, allow_empty: bool = False) -> list[list[int]]:
    """Prompts as lists of ints (one flat list is one prompt); an empty one only when
    `allow_empty` (the caller gave the logits to start from)."""
    if len(prompts) and all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]
    out = [[int(t) for t in p] for p in prompts]
    if not out:
        raise ValueError("prompts: no prompt given")
    for i, p in enumerate(out):
        if not p and allow_empty:
            continue
        if not p:
            raise ValueError(f"prompts[{i}]: empty prompt; start it with at least one token "
                             "(RWKV models use 0, the end-of-document id, as a neutral start), "
                             "or continue a state with its initial_logits")
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


# Event codes per step and row in a block's output (also the finish codes carried on device).
NONE, EMIT, STOP, LENGTH = 0, 1, 2, 3


def _block_fn(graph, return_logits, params, rest, carry, forced_KB, is_forced_KB, stop_V,
              max_new, sp):
    """`K = forced_KB.shape[0]` decode steps on the device (see the module docstring).

    carry: `(state, counts_BV int32, key, feed_B int32, n_out_B int32, finish_B int32,
      last_BV float32, given_B bool)`, where `feed_B` is each row's next input token, `n_out_B`
      its count of returned tokens, `finish_B` NONE while it runs, else STOP or LENGTH,
      `last_BV` its logits after the last token its state consumed, and `given_B` marks rows
      whose next step uses `last_BV` instead of feeding `feed_B` (an empty prompt continuing a
      state: only ever at the first step).
    forced_KB / is_forced_KB: int32 / bool `[K, B]`, the prompt token each row must produce at
      each step, and whether it must. stop_V: bool `[V]`. max_new: int32 scalar.
    Returns `(carry, (tokens_KB int32, events_KB int8[, logits_KBV float32]))`.
    """
    TRACES["block"] += 1  # runs only while tracing
    L = jax.tree.leaves(carry[0])[0].shape[0]
    layers = _unstack(params, L, _is_block_param)   # once per block, not per step
    state, *rest_carry = carry
    carry = (_unstack(state, L), *rest_carry)

    def step(carry, xs):
        state_layers, counts_BV, key, feed_B, n_out_B, finish_B, last_BV, given_B = carry
        forced_B, is_forced_B = xs
        active_B = finish_B == NONE
        model = nnx.merge(graph, _restack(layers, _is_block_param), rest)
        state = _restack(state_layers)
        logits, new_state = model(feed_B[:, None], state=state, return_state=True)
        logits_BV = jnp.where(given_B[:, None], last_BV, logits[:, 0].astype(jnp.float32))
        fed_B = active_B & ~given_B                      # rows whose state consumes feed_B
        key, sub = jax.random.split(key)
        sampled = sample(apply_penalties(logits_BV, counts_BV, sp), sub, sp)
        nxt_B = jnp.where(is_forced_B, forced_B, sampled)
        made_B = active_B & ~is_forced_B                 # rows whose nxt_B was generated
        counts_BV = counts_BV.at[jnp.arange(nxt_B.shape[0]), nxt_B].add(made_B.astype(jnp.int32))
        full_B = made_B & (n_out_B >= max_new)           # feed_B was its last token
        stop_B = made_B & ~full_B & stop_V[nxt_B]
        emit_B = made_B & ~full_B & ~stop_B
        event_B = jnp.where(emit_B, EMIT, jnp.where(stop_B, STOP, jnp.where(full_B, LENGTH, NONE)))
        finish_B = jnp.where(stop_B, STOP, jnp.where(full_B, LENGTH, finish_B))
        n_out_B = n_out_B + emit_B.astype(jnp.int32)

        def keep(new, old):          # one layer's state: batch is the leading axis
            mask = fed_B.reshape((-1,) + (1,) * (new.ndim - 1))
            return jnp.where(mask, new, old)
        state_layers = jax.tree.map(keep, _unstack(new_state, L), state_layers)
        last_BV = jnp.where(active_B[:, None], logits_BV, last_BV)
        out = (nxt_B, event_B.astype(jnp.int8)) + ((logits_BV,) if return_logits else ())
        return (state_layers, counts_BV, key, nxt_B, n_out_B, finish_B, last_BV,
                jnp.zeros_like(given_B)), out

    (state_layers, *rest_carry), ys = jax.lax.scan(step, carry, (forced_KB, is_forced_KB))
    return (_restack(state_layers), *rest_carry), ys


# Inside a decode block the per-layer weights and states are separate arrays: the model's
# stacked `[L, ...]` layout is rebuilt (`jnp.stack`) right where the model slices it again, and
# XLA folds each slice-of-stack to the per-layer array. Without this, every step copies each
# layer's weight slice before its matmul and re-stacks the whole state (the measured step
# times are in benchmarks/RESULTS.md, inference section).
# Weights are split once per block (one extra copy of the block weights lives on the device
# while decoding).
def _is_block_param(path) -> bool:
    return getattr(path[0], "key", None) == "blocks"


def _unstack(tree, L: int, stacked=lambda path: True) -> list:
    """`L` trees, the l-th holding `leaf[l]` of every leaf `stacked(path)` accepts."""
    return [jax.tree_util.tree_map_with_path(
        lambda path, a: a[l] if stacked(path) else a, tree) for l in range(L)]


def _restack(layers: list, stacked=lambda path: True):
    """Inverse of `_unstack`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, *a: jnp.stack(a) if stacked(path) else a[0], *layers)


_prefill = jax.jit(_prefill_fn, static_argnums=0)
_block = jax.jit(_block_fn, static_argnums=(0, 1), donate_argnums=4)


class Generator:
    """Prefill + block-decode driver for one model.

    Args:
      model: an `RWKV7` or a `Llama` (its parameters are read now; later in-place changes are
        not seen).
      prefill_chunk: tokens per prefill call (a multiple of the model's chunk size is best).
      decode_block: decode steps per compiled call (host round trip); more amortises the host
        better, but up to `decode_block - 1` steps of the last block may be wasted.
    Compiled functions are shared (see `TRACES`): a second Generator for a model of the same
    structure (and the same `decode_block`) compiles nothing new.
    Memory: while a decode block runs, one extra copy of the block weights (split per layer)
    lives on the device next to the model's own.
    """

    def __init__(self, model, prefill_chunk: int = 256, decode_block: int = 16):
        from lwm_jax.interop.params import abstract_model
        for name, val in (("prefill_chunk", prefill_chunk), ("decode_block", decode_block)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: must be a positive integer, got {val!r}")
        self.cfg, self.policy = model.cfg, model.policy
        self.prefill_chunk, self.decode_block = prefill_chunk, decode_block
        self._prefill_graph, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        # Decode graph: recurrent WKV (one token) and layers unrolled, not `lax.scan`ned, so
        # that the per-layer split below applies (a layer scan slices the stacked weights
        # inside the loop whatever we pass in).
        step_rt = dataclasses.replace(model.runtime, wkv_impl="recurrent", scan_layers=False)
        self._step_graph = nnx.split(abstract_model(self.cfg, self.policy, step_rt),
                                     nnx.Param, ...)[0]
        self._init_state = model.init_state
        self._sized_state = "max_len" in inspect.signature(model.init_state).parameters
        self._max_len = getattr(self.cfg, "max_seq_len", None)

    # ------------------------------------------------------------------ driver
    def stream(self, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
               stop_tokens: Sequence[int] = (), seed: int = 0, initial_state=None,
               return_logits: bool = False,
               initial_logits=None) -> Iterator[tuple[int, int]]:
        """Yield `(row, token)` as each row produces a token (step by step, rows ascending);
        returns a `GenerationResult` (as the generator's return value; `generate` collects it).

        `initial_state` (one row, shared, or one per prompt) is the state to start from;
        `initial_logits` (float32 `[rows of initial_state, V]`, or `[V]` for one row: the
        `last_logits` that came with it) lets a prompt be empty: that row continues the state
        directly.
        """
        sp = (sampling or SamplingParams()).as_arrays()
        if (not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool)
                or not 0 <= max_new_tokens < 2**30):
            raise ValueError(f"max_new_tokens: must be an integer in [0, 2**30), "
                             f"got {max_new_tokens!r}")
        V = self.cfg.vocab_size
        if initial_logits is not None and initial_state is None:
            raise ValueError("initial_logits: given without the initial_state they belong to; "
                             "pass both (GenerationResult.state and .last_logits)")
        rows = _as_prompts(prompts, V, allow_empty=initial_logits is not None)
        stop_V = np.zeros(V, bool)
        for t in stop_tokens:
            if not isinstance(t, (int, np.integer)) or not 0 <= t < V:
                raise ValueError(f"stop_tokens: ids must be integers in [0, {V}), got {t!r}")
            stop_V[int(t)] = True
        B, lens = len(rows), np.array([len(p) for p in rows])
        prompt_BT = np.zeros((B, max(int(lens.max()), 1)), np.int32)
        for i, p in enumerate(rows):
            prompt_BT[i, : len(p)] = p
        if initial_state is None:
            state = self._fresh_state(B, int(lens.max()) + max_new_tokens)
        elif self._sized_state:
            raise ValueError("initial_state: not supported for KV-cache (llama) models; "
                             "prefill the prompt instead")
        else:   # a private float32 copy: the decode blocks donate (invalidate) their input state
            state = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True),
                                 broadcast_state(initial_state, B))
        last_BV = (jnp.zeros((B, V), jnp.float32) if initial_logits is None
                   else _given_logits(initial_logits, initial_state, B, V))
        chunk = self.prefill_chunk
        P = max(0, (int(lens.min()) - 1) // chunk * chunk)        # 0 when a prompt is empty
        for start in range(0, P, chunk):
            state = _prefill(self._prefill_graph, self._params, self._rest,
                             jnp.asarray(prompt_BT[:, start: start + chunk]), state)
        K = self.decode_block
        # Without stop tokens a row finishes ("length") by step len - P + max_new (an empty
        # prompt: by step 1 + max_new, its first step draws from the given logits).
        steps = int(np.where(lens > 0, lens - P, 1).max()) + max_new_tokens
        n_blocks = -(-steps // K)
        carry = (state, jnp.zeros((B, V), jnp.int32), jax.random.key(seed),
                 jnp.asarray(prompt_BT[:, P]), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32),
                 last_BV, jnp.asarray(lens == 0))
        consts = (jnp.asarray(stop_V), jnp.int32(max_new_tokens), sp)
        out: list[list[int]] = [[] for _ in range(B)]
        kept: list[list[np.ndarray]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        running = np.ones(B, bool)
        pending: collections.deque = collections.deque()
        launched, T = 0, prompt_BT.shape[1]
        free = (jnp.zeros((K, B), jnp.int32), jnp.zeros((K, B), bool))   # no forced token
        while running.any():
            while launched < n_blocks and len(pending) < 2:   # keep one block in flight
                next_pos_K = P + launched * K + np.arange(K) + 1   # position each step produces
                if next_pos_K[0] < T:                              # some prompt is not done
                    is_forced_KB = next_pos_K[:, None] < lens[None, :]
                    prompt_KB = prompt_BT.T[np.minimum(next_pos_K, T - 1)]
                    forced_KB = np.where(is_forced_KB, prompt_KB, 0)
                    forcing = (jnp.asarray(forced_KB, jnp.int32), jnp.asarray(is_forced_KB))
                else:
                    forcing = free
                carry, ys = _block(self._step_graph, bool(return_logits), self._params, self._rest,
                                   carry, *forcing, *consts)
                pending.append(ys)
                launched += 1
            if not pending:
                raise RuntimeError("Generator.stream: rows still running after the last block")
            tokens_KB, events_KB, *logits = jax.device_get(pending.popleft())
            for k, i in zip(*np.nonzero(events_KB)):          # step by step, rows ascending
                if events_KB[k, i] == EMIT:
                    out[i].append(int(tokens_KB[k, i]))
                    if return_logits:
                        kept[i].append(logits[0][k, i])
                    yield int(i), out[i][-1]
                else:
                    running[i] = False
                    reasons[i] = "stop" if events_KB[k, i] == STOP else "length"
        logits_out = ([np.stack(k) if k else np.zeros((0, V), np.float32) for k in kept]
                      if return_logits else None)
        return GenerationResult(out, reasons, carry[0], logits_out,
                                np.asarray(jax.device_get(carry[6]), np.float32))

    def _fresh_state(self, batch: int, positions: int):
        """Zero state for `batch` rows; a KV cache gets room for `positions` tokens (power of
        two >= 64, at most `max_seq_len`; more than `max_seq_len` is a one-line ValueError)."""
        if not self._sized_state:
            return self._init_state(batch)
        if self._max_len is not None and positions > self._max_len:
            raise ValueError(f"max_new_tokens: the longest prompt plus max_new_tokens is "
                             f"{positions} tokens, more than the model's max_seq_len="
                             f"{self._max_len}; shorten the prompt or lower max_new_tokens")
        size = max(64, 1 << (positions - 1).bit_length())
        return self._init_state(batch, max_len=min(size, self._max_len or size))

    def generate(self, prompts, max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop_tokens: Sequence[int] = (),
                 seed: int = 0, initial_state=None, return_logits: bool = False,
                 on_token: Callable[[int, int], None] | None = None,
                 initial_logits=None) -> GenerationResult:
        """Run `stream` to the end (calling `on_token(row, token)` for each token)."""
        it = self.stream(prompts, max_new_tokens, sampling, stop_tokens, seed, initial_state,
                         return_logits, initial_logits)
        while True:
            try:
                row, tok = next(it)
            except StopIteration as done:
                return done.value
            if on_token is not None:
                on_token(row, tok)

    def prefill_state(self, prompts, initial_state=None):
        """State after consuming `prompts` entirely (nothing generated), an `initial_state`.
        To save it, use `generate(prompts, max_new_tokens=0)` instead: `save_state` also needs
        that result's `last_logits`."""
        return self.generate(prompts, max_new_tokens=0, initial_state=initial_state).state


def _given_logits(logits, state, B: int, V: int) -> jax.Array:
    """`initial_logits` as a private float32 `[B, V]` copy (the blocks donate their carry).
    They must have one row per row of `state` (`[V]` for a one-row state), since each row's
    logits belong to that row's state; a one-row pair is shared by every prompt, as the state
    is. Wrong shape or NaN/inf: one-line ValueError."""
    rows = jax.tree.leaves(state)[0].shape[1]           # batch is axis 1 of every state leaf
    arr = np.asarray(jax.device_get(logits))
    arr = arr[None] if arr.ndim == 1 else arr
    if arr.shape != (rows, V) or arr.dtype.kind != "f":
        raise ValueError(f"initial_logits: shape {list(arr.shape)} ({arr.dtype}), expected float "
                         f"[{rows}, {V}] (one row per row of initial_state, vocab_size {V})")
    if not np.isfinite(arr).all():
        raise ValueError("initial_logits: hold NaN/inf; pass the last_logits of the run that "
                         "made the state")
    return jnp.array(np.broadcast_to(arr.astype(np.float32), (B, V)))


def generate(model, prompts, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
             **kwargs) -> GenerationResult:
    """`Generator(model).generate(...)` (compiled functions are shared between calls)."""
    return Generator(model).generate(prompts, max_new_tokens, sampling, **kwargs)
