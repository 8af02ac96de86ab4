"""Batched scoring of token pairs `(context ids, continuation ids)`: the log-likelihood of the
continuation after the context and whether greedy decoding would produce it.

Two strategies, picked from the model's state protocol (`lwm_jax.eval.scoring.model_context`):

Recurrent (RWKV-7), exact at any length, nothing truncated:
  1. pairs that share their context (multiple-choice answers) form a group; the group's first
     `shared` context tokens (the largest multiple of `granule` below the context's length) are
     consumed once per batch, `granule` tokens per call, every group of the batch in its own
     row; a row whose prefix is done keeps its state frozen (masked update) while longer ones go
     on, so every row's state is exactly the state after its own prefix;
  2. each pair's row starts from its group's state (gathered per row) and runs the rest of the
     context and the continuation in windows of at most `window` tokens, the state carried
     from window to window. Only a row's last window can be partial (right-padded), and a
     row's state is never used after its last window, so padding never reaches a score.
One window (LLaMA: KV cache, `max_len` = its `max_seq_len`; the hybrid: no carried state,
  `max_len` = `window`): every pair runs in one right-padded window of `context +
  continuation` (causal: padding does not reach earlier positions). A pair longer than
  `max_len` + 1 tokens loses context tokens from the left (`n_truncated` counts them, as
  lm-eval does); a continuation that alone does not fit is a one-line ValueError.

Rows are sorted by length so that a batch holds rows of similar length. Shapes are fixed per
call (`batch_size` rows; windows bucketed to powers of two >= 16), so compilations are few:
one per window bucket, plus one for the prefix step.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.eval.scoring import model_context

# Traces (= compilations) of the jitted functions, over all PairScorers.
TRACES: collections.Counter = collections.Counter()
MIN_BUCKET = 16


def _window_fn(graph, params, rest, state, inputs_BT, targets_BT):
    """`(nll [B, T] float32, hit [B, T] bool, state after the window or None)`."""
    TRACES["window"] += 1  # runs only while tracing
    model = nnx.merge(graph, params, rest)
    if state is None:
        logits, new = model(inputs_BT), None
    else:
        logits, new = model(inputs_BT, state=state, return_state=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
    hit = jnp.argmax(logits, axis=-1) == targets_BT
    return nll, hit, new


def _advance_fn(graph, params, rest, state, tokens_BT, active_B):
    """State after `tokens_BT` for rows where `active_B`, the old state elsewhere (every state
    leaf has the layer axis first and the batch axis second)."""
    TRACES["advance"] += 1
    model = nnx.merge(graph, params, rest)
    _, new = model(tokens_BT, state=state, return_state=True)

    def keep(n, o):
        return jnp.where(active_B.reshape((1, -1) + (1,) * (n.ndim - 2)), n, o)
    return jax.tree.map(keep, new, state)


def _gather_fn(state, rows_B):
    return jax.tree.map(lambda a: jnp.take(a, rows_B, axis=1), state)


_window = jax.jit(_window_fn, static_argnums=0)
_advance = jax.jit(_advance_fn, static_argnums=0)
_gather = jax.jit(_gather_fn)


@dataclasses.dataclass(frozen=True)
class _Row:
    """One pair to score: `seq` starts after the `shared` prefix tokens of its group's context;
    its last `n_cont` targets are the continuation."""

    index: int
    group: tuple[int, ...]
    shared: int
    seq: tuple[int, ...]
    n_cont: int


def bucket_width(n: int, cap: int) -> int:
    """Smallest power of two >= max(n, MIN_BUCKET), at most `cap`: the width of a window of
    `n` tokens (few distinct widths = few compilations)."""
    return min(cap, max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()))


def _check_int(name: str, value, low: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")


class PairScorer:
    """Scores `(context ids, continuation ids)` pairs for one model (see the module docstring).

    Args:
      model: an `RWKV7`, a `Llama` or an `RWKVHybrid` (parameters are read now).
      batch_size: rows per compiled call.
      window: most tokens per scoring call: a recurrent model carries its state from window to
        window, a model without carried state (the hybrid) sees at most this many tokens; a
        KV-cache model uses one window of up to its `max_seq_len` instead.
      granule: tokens per shared-prefix step (recurrent models): a group shares all but the
        last `< granule` tokens of its context.
    """

    def __init__(self, model, batch_size: int = 8, window: int = 1024, granule: int = 32):
        _check_int("batch_size", batch_size)
        _check_int("window", window)
        _check_int("granule", granule)
        self.batch_size, self.window, self.granule = batch_size, window, granule
        self.vocab_size = int(model.cfg.vocab_size)
        self._graph, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        self._init_state = model.init_state
        self.recurrent, bound = model_context(model)
        # most tokens a pair's window holds (None: any, the state is carried); what sets it
        self.max_len = None if self.recurrent else (bound or window)
        self.limit = "max_seq_len" if bound else "window"
        self.n_truncated = 0     # pairs whose context lost tokens (one-window models only)

    # ------------------------------------------------------------------ planning
    def _check(self, pairs) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        out = []
        for i, (ctx, cont) in enumerate(pairs):
            ctx, cont = tuple(int(t) for t in ctx), tuple(int(t) for t in cont)
            if not ctx:
                raise ValueError(f"pairs[{i}]: empty context; start it with at least one token "
                                 "(e.g. the end-of-document id)")
            ids = ctx + cont
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"pairs[{i}]: token ids must lie in [0, {self.vocab_size}), "
                                 f"got [{min(ids)}, {max(ids)}]; does the tokenizer match the "
                                 "model?")
            if self.max_len is not None and len(cont) > self.max_len:
                raise ValueError(f"pairs[{i}]: the continuation has {len(cont)} tokens, more "
                                 f"than one scoring window holds ({self.limit}={self.max_len}); it "
                                 "cannot be scored")
            out.append((ctx, cont))
        return out

    def _plan(self, pairs) -> list[_Row]:
        """Rows sorted longest first, pairs of one context adjacent."""
        members: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        for i, (ctx, cont) in enumerate(pairs):
            if cont:
                members[ctx].append(i)
        rows: list[_Row] = []
        for ctx, idx in members.items():
            share = (self.recurrent and len(idx) > 1)
            shared = (len(ctx) - 1) // self.granule * self.granule if share else 0
            for i in idx:
                seq = ctx[shared:] + pairs[i][1]
                if self.max_len is not None and len(seq) - 1 > self.max_len:
                    seq = seq[len(seq) - 1 - self.max_len:]
                    self.n_truncated += 1
                rows.append(_Row(i, ctx, shared, seq, len(pairs[i][1])))
        length: dict[tuple[int, ...], int] = collections.defaultdict(int)
        for r in rows:
            length[r.group] = max(length[r.group], r.shared + len(r.seq))
        order = {g: k for k, g in enumerate(members)}
        rows.sort(key=lambda r: (-length[r.group], order[r.group], r.index))
        return rows

    # ------------------------------------------------------------------ running
    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
              progress=None) -> list[tuple[float, bool]]:
        """`(sum of log p over the continuation (nats, summed in float64), whether every
        continuation token is the argmax)` per pair; an empty continuation gives `(0.0, True)`.

        `progress`: optional callable taking the number of pairs finished by each batch.
        """
        return [(-float(nll.sum()), bool(hit.all()))
                for nll, hit in self.token_scores(pairs, progress)]

    def token_scores(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                     progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per pair, `(nll, hit)` of each continuation token: float64 `[n_cont]` negative
        log-likelihood (nats) and bool `[n_cont]` argmax == token (empty for an empty
        continuation). `progress` as in `score`."""
        pairs = self._check(pairs)
        empty = (np.zeros(0, np.float64), np.zeros(0, bool))
        out: list[tuple[np.ndarray, np.ndarray]] = [empty] * len(pairs)
        rows = self._plan(pairs)
        for first in range(0, len(rows), self.batch_size):
            batch = rows[first: first + self.batch_size]
            for row, result in zip(batch, self._run(batch)):
                out[row.index] = result
            if progress is not None:
                progress(len(batch))
        return out

    def _fresh_state(self):
        return self._init_state(self.batch_size) if self.recurrent else None

    def _prefix_states(self, batch: list[_Row]):
        """Per-row state after its group's shared prefix (zeros where nothing is shared)."""
        state = self._fresh_state()
        longest = max(r.shared for r in batch)
        if longest == 0:
            return state
        groups = list(dict.fromkeys(r.group for r in batch))
        slot = {g: j for j, g in enumerate(groups)}
        B, G = self.batch_size, self.granule
        tokens = np.zeros((B, longest), np.int32)
        shared = np.zeros(B, np.int64)
        for r in batch:
            tokens[slot[r.group], : r.shared] = r.group[: r.shared]
            shared[slot[r.group]] = r.shared
        for start in range(0, longest, G):
            state = _advance(self._graph, self._params, self._rest, state,
                             jnp.asarray(tokens[:, start: start + G]),
                             jnp.asarray(shared > start))
        rows_B = np.zeros(B, np.int32)
        rows_B[: len(batch)] = [slot[r.group] for r in batch]
        return _gather(state, jnp.asarray(rows_B))

    def _run(self, batch: list[_Row]) -> list[tuple[np.ndarray, np.ndarray]]:
        state = self._prefix_states(batch) if self.recurrent else None
        n_in = [len(r.seq) - 1 for r in batch]
        cap = self.window if self.recurrent else self.max_len
        T = bucket_width(max(n_in), cap)
        nll_parts: list[list[np.ndarray]] = [[] for _ in batch]
        hit_parts: list[list[np.ndarray]] = [[] for _ in batch]
        for start in range(0, max(n_in), T):
            inputs = np.zeros((self.batch_size, T), np.int32)
            targets = np.zeros((self.batch_size, T), np.int32)
            for j, r in enumerate(batch):
                stop = min(start + T, n_in[j])
                if stop > start:
                    inputs[j, : stop - start] = r.seq[start: stop]
                    targets[j, : stop - start] = r.seq[start + 1: stop + 1]
            nll, hit, state = _window(self._graph, self._params, self._rest, state,
                                      jnp.asarray(inputs), jnp.asarray(targets))
            nll, hit = np.asarray(nll), np.asarray(hit)
            for j in range(len(batch)):
                stop = min(start + T, n_in[j])
                if stop > start:
                    nll_parts[j].append(nll[j, : stop - start])
                    hit_parts[j].append(hit[j, : stop - start])
        results = []
        for j, r in enumerate(batch):
            nll_j = np.concatenate(nll_parts[j])[-r.n_cont:]
            hit_j = np.concatenate(hit_parts[j])[-r.n_cont:]
            results.append((nll_j.astype(np.float64), hit_j.astype(bool)))
        return results
