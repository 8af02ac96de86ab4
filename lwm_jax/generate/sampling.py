"""Logit processing and sampling, written so one compiled step serves every setting.

All knobs are traced scalars (not static arguments): changing the temperature or top-p between
calls reuses the compiled function. Order of operations (per row, float32 logits `[B, V]`):

1. penalties on tokens already generated in this row (`counts_BV`, prompt tokens excluded):
   repetition (CTRL/HF rule: positive logits divided by `repetition_penalty`, negative ones
   multiplied), then `presence_penalty` once per seen token and `frequency_penalty` per occurrence
   (OpenAI rule, as in ChatRWKV), subtracted from the logit;
2. `temperature` (<= 0 means greedy: argmax of the penalised logits, no randomness);
3. `top_k` (0 = off): keep the k largest; ties at the k-th value are all kept;
4. `top_p` (1 = off): keep the smallest set of largest-probability tokens whose mass reaches p
   (computed after top-k); the most likely token is always kept;
5. draw from the renormalised distribution.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


INT32_MAX = 2**31 - 1      # top_k is an int32 on the device


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (see module docstring). Defaults = plain sampling at temperature 1."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
        checks = [
            ("temperature", finite(self.temperature) and self.temperature >= 0,
             "a finite number >= 0 (0 = greedy)"),
            ("top_p", finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
            ("top_k", isinstance(self.top_k, int) and 0 <= self.top_k <= INT32_MAX,
             f"an integer in [0, {INT32_MAX}] (0 = off)"),
            ("repetition_penalty", finite(self.repetition_penalty)
             and self.repetition_penalty > 0, "a finite number > 0 (1 = off)"),
            ("presence_penalty", finite(self.presence_penalty), "a finite number (0 = off)"),
            ("frequency_penalty", finite(self.frequency_penalty), "a finite number (0 = off)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"sampling.{name}: must be {rule}, got {getattr(self, name)!r}")

    def as_arrays(self) -> dict[str, jax.Array]:
        """The settings as 0-d arrays (fixed dtypes, so jit sees the same signature every time)."""
        return {"temperature": jnp.float32(self.temperature), "top_p": jnp.float32(self.top_p),
                "top_k": jnp.int32(self.top_k),
                "repetition_penalty": jnp.float32(self.repetition_penalty),
                "presence_penalty": jnp.float32(self.presence_penalty),
                "frequency_penalty": jnp.float32(self.frequency_penalty)}


def apply_penalties(logits_BV, counts_BV, sp: dict):
    """Repetition, presence and frequency penalties from per-row token counts (float32)."""
    logits_BV = logits_BV.astype(jnp.float32)
    counts = counts_BV.astype(jnp.float32)
    seen = counts > 0
    rep = sp["repetition_penalty"]
    repeated = jnp.where(logits_BV > 0, logits_BV / rep, logits_BV * rep)
    out = jnp.where(seen, repeated, logits_BV)
    return out - sp["presence_penalty"] * seen - sp["frequency_penalty"] * counts


def filter_logits(logits_BV, top_k, top_p):
    """Mask (to -inf) everything outside top-k and then outside the top-p nucleus."""
    V = logits_BV.shape[-1]
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)                      # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_BV, jnp.full((logits_BV.shape[0], 1), k - 1), axis=-1)
    logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    sorted_BV = jnp.where(jnp.arange(V) < k, sorted_BV, -jnp.inf)
    probs = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p) | (jnp.arange(V) == 0)
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_BV, n_keep - 1, axis=-1)
    return jnp.where(logits_BV < cutoff, -jnp.inf, logits_BV)


def sample(logits_BV, key, sp: dict):
    """One token id per row (int32 `[B]`) from penalised logits; greedy when temperature <= 0.

    The branches are `lax.cond`s on the traced settings, so the compiled step only pays for what
    is switched on: no categorical draw when greedy, no sort over the vocabulary when top-k and
    top-p are both off (same tokens as filtering with them off, minus float rounding in top-p).
    """
    def greedy(logits_BV):
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    def draw(logits_BV):
        scaled_BV = logits_BV / jnp.maximum(sp["temperature"], 1e-6)
        filtering = (sp["top_k"] > 0) | (sp["top_p"] < 1)
        scaled_BV = jax.lax.cond(filtering, lambda x: filter_logits(x, sp["top_k"], sp["top_p"]),
                                 lambda x: x, scaled_BV)
        return jax.random.categorical(key, scaled_BV, axis=-1).astype(jnp.int32)

    return jax.lax.cond(sp["temperature"] > 0, draw, greedy, logits_BV)
