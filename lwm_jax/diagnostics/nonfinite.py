"""Where did the first NaN/inf come from? A probed forward with per-tap statistics.

`tap_stats` re-runs the forward (one `jax.jit`) with a probe on every layer piece and reduces
each tapped value to a few numbers (count of non-finite entries, first sequence position that
holds one, largest finite magnitude). `first_nonfinite` walks the taps in execution order and
names the first that holds a non-finite value: the op that produced it sits between that tap
and the previous one. The trainer calls this when it stops a diverging run; the same statistics
are the per-op half of a precision report (fp32-vs-shadow errors can be added as more columns).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lwm_jax.probe import Probe

# What each tap measures, for the one-line message.
_TAP_MEANING = {
    "emb": "embedding lookup", "ln0": "ln0 LayerNorm", "logits": "final LayerNorm + head",
    "att/r": "TimeMix receptance", "att/w": "TimeMix log-decay", "att/k": "TimeMix key",
    "att/v": "TimeMix value (with value residual)", "att/a_in": "TimeMix kk (WKV a input)",
    "att/b_in": "TimeMix kk*a (WKV b input)", "att/a": "TimeMix in-context rate a",
    "att/g": "TimeMix gate", "att/wkv_out": "WKV7 output", "att/wkv_state": "WKV7 final state",
    "att/ln_x": "TimeMix GroupNorm", "att/out": "TimeMix output projection",
    "x_att": "residual after TimeMix", "ffn/hidden": "ChannelMix relu(k W)^2",
    "ffn/out": "ChannelMix output", "x_out": "residual after ChannelMix",
}


@dataclasses.dataclass(frozen=True)
class TapStats:
    """Statistics of one tapped value.

    nonfinite: number of NaN/inf entries. first_position: smallest sequence index (axis 1 of a
    `[B, T, ...]` value) holding one, or None (none, or the value has no time axis).
    max_abs: largest finite magnitude (0 if none).
    """

    name: str
    nonfinite: int
    first_position: int | None
    max_abs: float

    @property
    def meaning(self) -> str:
        short = self.name.split("/", 1)[1] if self.name.startswith("layer") else self.name
        return _TAP_MEANING.get(short, short)


def _reduce(T: int):
    def reduce(name, x):
        del name
        bad = ~jnp.isfinite(x)
        finite_abs = jnp.where(bad, 0.0, jnp.abs(x.astype(jnp.float32)))
        if x.ndim >= 2 and x.shape[1] == T:
            bad_t = jnp.any(bad.reshape(x.shape[0], T, -1), axis=(0, 2))
            first = jnp.where(jnp.any(bad_t), jnp.argmax(bad_t), -1).astype(jnp.int32)
        else:
            first = jnp.asarray(-1, jnp.int32)
        return (jnp.sum(bad, dtype=jnp.int32), first, jnp.max(finite_abs))
    return reduce


def probed_forward(model_fn, params: dict, tokens_BT, *, reduce, segment_ids=None,
                   compiler_options: dict | None = None):
    """Run a model forward on `params` with a `Probe(reduce)`; returns `(logits, records)`.

    model_fn: `() -> nnx.Module` building the model whose parameter tree `params` is (called
    under `nnx.eval_shape`; nothing is allocated), callable as
    `model(tokens_BT, segment_ids=..., probe=...)` — e.g. `lwm_jax.models.rwkv7.probe_model_fn`.
    params: the model's parameter pure dict (as the trainer holds it).
    compiler_options: XLA options for this compilation only (e.g.
    `{"xla_allow_excess_precision": False}`: every value rounded to its dtype, as the precision
    report needs), or None.
    Jitted; `records` is a list of `(name, reduce(name, x))` in execution order.
    """
    abstract = nnx.eval_shape(model_fn)
    graphdef, _ = nnx.split(abstract)

    names: list[str] = []

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def run(params, tokens_BT, segment_ids):
        probe = Probe(reduce)
        logits = nnx.merge(graphdef, params)(tokens_BT, segment_ids=segment_ids, probe=probe)
        names[:] = [name for name, _ in probe.records]
        return logits, [value for _, value in probe.records]

    logits, values = run(params, jnp.asarray(tokens_BT), segment_ids)
    return logits, list(zip(names, values))


def tap_stats(model_fn, params: dict, tokens_BT, *, segment_ids=None) -> list[TapStats]:
    """Per-tap statistics of one forward, in execution order (see `TapStats`; `model_fn` as in
    `probed_forward`)."""
    T = int(jnp.shape(tokens_BT)[1])
    _, records = probed_forward(model_fn, params, tokens_BT, reduce=_reduce(T),
                                segment_ids=segment_ids)
    records = jax.device_get(records)
    return [TapStats(name, int(count), None if int(first) < 0 else int(first), float(max_abs))
            for name, (count, first, max_abs) in records]


def first_nonfinite(stats: list[TapStats]) -> TapStats | None:
    """The first tap (execution order) holding a non-finite value, or None."""
    return next((s for s in stats if s.nonfinite), None)


def nonfinite_params(tree: Any) -> list[str]:
    """Paths (`"blocks/att/w0"`) of floating leaves holding a NaN/inf, in tree order."""
    bad = jax.tree_util.tree_map_with_path(
        lambda kp, x: (jax.tree_util.keystr(kp, simple=True, separator="/"),
                       jnp.logical_not(jnp.all(jnp.isfinite(x))))
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact) else None, tree)
    flat = [v for v in jax.tree.leaves(bad, is_leaf=lambda v: isinstance(v, tuple)) if v]
    return [name for name, flag in flat if bool(flag)]


def describe(stats: list[TapStats], T: int) -> str:
    """One line naming the first non-finite tap and what its input looked like."""
    first = first_nonfinite(stats)
    if first is None:
        return "the forward pass is finite on this batch (the non-finite value is in the backward)"
    i = stats.index(first)
    prev = stats[i - 1] if i > 0 else None
    where = "" if first.first_position is None else f" from position {first.first_position} of {T}"
    before = "" if prev is None else (f"; the value before it ({prev.name}) was finite, max "
                                      f"|x| {_fmt(prev.max_abs)}")
    return (f"first non-finite value at {first.name} ({first.meaning}){where}, "
            f"{first.nonfinite} entries{before}")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)
