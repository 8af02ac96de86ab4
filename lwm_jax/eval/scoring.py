"""A compiled teacher-forced scorer: per-token negative log-likelihood and greedy hits.

`Scorer(model).score(inputs_BT, targets_BT, state)` returns, for every position, the natural-log
loss of `targets` under the model's next-token distribution (float32 log-softmax of the float32
logits) and whether the argmax equals the target, plus the state after the window. It is jitted
once per input shape, so callers keep shapes fixed (full windows, padded batches).
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


# Traces (= compilations) of the scoring function, over all Scorers: it is module-level with
# the model's graph definition static, so Scorers of one model structure share compilations.
TRACES: collections.Counter = collections.Counter()


def _score_fn(graph, params, rest, state, inputs_BT, targets_BT):
    TRACES["score"] += 1  # runs only while tracing
    model = nnx.merge(graph, params, rest)
    logits, state = model(inputs_BT, state=state, return_state=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
    hit = jnp.argmax(logits, axis=-1) == targets_BT
    return nll, hit, state


_score = jax.jit(_score_fn, static_argnums=0)


class Scorer:
    """Scoring of fixed-shape windows for one model (compiled once per input shape)."""

    def __init__(self, model):
        self.cfg = model.cfg
        self._graph, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        self._init_state = model.init_state

    def init_state(self, batch_size: int):
        return self._init_state(batch_size)

    def score(self, inputs_BT, targets_BT, state=None):
        """`(nll [B, T] float32 NumPy, hit [B, T] bool NumPy, state after the window)`."""
        inputs_BT = np.asarray(inputs_BT, np.int32)
        targets_BT = np.asarray(targets_BT, np.int32)
        if inputs_BT.shape != targets_BT.shape or inputs_BT.ndim != 2:
            raise ValueError(f"score: inputs {inputs_BT.shape} and targets {targets_BT.shape} "
                             "must both be [B, T]")
        V = self.cfg.vocab_size
        for name, arr in (("inputs", inputs_BT), ("targets", targets_BT)):
            if arr.size and (arr.min() < 0 or arr.max() >= V):
                raise ValueError(f"score: {name} hold ids outside [0, {V}) "
                                 f"([{arr.min()}, {arr.max()}]); does the tokenizer match the model?")
        if state is None:
            state = self._init_state(inputs_BT.shape[0])
        nll, hit, state = _score(self._graph, self._params, self._rest, state,
                                 jnp.asarray(inputs_BT), jnp.asarray(targets_BT))
        return np.asarray(nll), np.asarray(hit), state
