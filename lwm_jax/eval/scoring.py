"""A compiled teacher-forced scorer: per-token negative log-likelihood and greedy hits.

`Scorer(model).score(inputs_BT, targets_BT, state)` returns, for every position, the natural-log
loss of `targets` under the model's next-token distribution (float32 log-softmax of the float32
logits) and whether the argmax equals the target, plus the state after the window. It is jitted
once per input shape, so callers keep shapes fixed (full windows, padded batches).

How far a model sees (`model_context`), by its state protocol:
- recurrent (RWKV-7: `init_state(B)`): a state is carried from window to window, so a window
  of any length continues the text before it and nothing is ever cut;
- bounded (LLaMA: `init_state(B, max_len=)`, a KV cache): at most `cfg.max_seq_len` tokens in
  one window, scored without a carried cache;
- stateless (the RWKV-7/attention hybrid, whose `init_state` refuses with a ValueError): one
  window of whatever length the caller picks (its attention has no cache to carry).
A bounded or stateless model scores a long text in separate windows (`lwm_jax.eval.requests.
rolling_pairs`), each conditioned only on the text inside it.
"""
from __future__ import annotations

import collections
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


# Traces (= compilations) of the scoring function, over all Scorers: it is module-level with
# the model's graph definition static, so Scorers of one model structure share compilations.
TRACES: collections.Counter = collections.Counter()


def model_context(model) -> tuple[bool, int | None]:
    """`(recurrent, max_len)`: whether `model` carries a state across windows, and the most
    tokens one window may hold (`cfg.max_seq_len` of a KV-cache model; None = any number).

    A model whose `init_state` takes `max_len` has a KV cache bounded by `max_seq_len`; one
    whose `init_state(1)` raises ValueError has no carried state; any other is recurrent.
    The check traces `init_state` abstractly (`jax.eval_shape`): nothing is allocated."""
    if "max_len" in inspect.signature(model.init_state).parameters:
        return False, int(model.cfg.max_seq_len)
    try:
        jax.eval_shape(lambda: model.init_state(1))
    except ValueError:
        return False, None
    return True, None


def _score_fn(graph, params, rest, state, inputs_BT, targets_BT):
    TRACES["score"] += 1  # runs only while tracing
    model = nnx.merge(graph, params, rest)
    if state is None:
        logits, state = model(inputs_BT), None
    else:
        logits, state = model(inputs_BT, state=state, return_state=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
    hit = jnp.argmax(logits, axis=-1) == targets_BT
    return nll, hit, state


_score = jax.jit(_score_fn, static_argnums=0)


class Scorer:
    """Scoring of fixed-shape windows for one model (compiled once per input shape).

    Attributes: `recurrent` and `max_len` (`model_context`)."""

    def __init__(self, model):
        self.cfg = model.cfg
        self._graph, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        self._init_state = model.init_state
        self.recurrent, self.max_len = model_context(model)

    def init_state(self, batch_size: int):
        """A fresh state of a recurrent model; ValueError for any other model."""
        if not self.recurrent:
            raise ValueError("Scorer: this model carries no state across windows; score each "
                             "window on its own (state=None)")
        return self._init_state(batch_size)

    def score(self, inputs_BT, targets_BT, state=None):
        """`(nll [B, T] float32 NumPy, hit [B, T] bool NumPy, state after the window)`.

        A recurrent model starts from `state` (None = fresh) and returns the state after the
        window; any other model scores the window alone (`state` must be None, the state
        returned is None) and a KV-cache model takes at most `max_len` tokens."""
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
        if not self.recurrent:
            if state is not None:
                raise ValueError("score: this model carries no state across windows; pass "
                                 "state=None")
            if self.max_len is not None and inputs_BT.shape[1] > self.max_len:
                raise ValueError(f"score: a window of {inputs_BT.shape[1]} tokens exceeds the "
                                 f"model's max_seq_len={self.max_len}")
        elif state is None:
            state = self._init_state(inputs_BT.shape[0])
        nll, hit, state = _score(self._graph, self._params, self._rest, state,
                                 jnp.asarray(inputs_BT), jnp.asarray(targets_BT))
        return np.asarray(nll), np.asarray(hit), state
