"""Saving and loading an `RWKV7State` (e.g. after a long system prompt) for later reuse.

File format: safetensors (no pickle) with tensors `tmix_shift [L, B, C]`, `cmix_shift [L, B, C]`,
`wkv [L, B, H, N, N]` (float32) and string metadata `format`, `n_layer`, `n_embd`, `head_size`,
`n_tokens` (tokens the state has consumed, per row, comma-separated; informational).
"""
from __future__ import annotations

import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lwm_jax.config import ModelConfig

FORMAT = "lwm_jax-rwkv7-state/1"
FIELDS = ("tmix_shift", "cmix_shift", "wkv")


def _state_cls():
    from lwm_jax.models.rwkv7 import RWKV7State
    return RWKV7State


def save_state(path: str | os.PathLike, state, cfg: ModelConfig,
               n_tokens: Sequence[int] | None = None) -> None:
    """Write `state` (an `RWKV7State`) to `path` (.safetensors), tagged with the model shape."""
    from safetensors.numpy import save_file
    tensors = {f: np.ascontiguousarray(np.asarray(jax.device_get(getattr(state, f)), np.float32))
               for f in FIELDS}
    meta = {"format": FORMAT, "n_layer": str(cfg.n_layer), "n_embd": str(cfg.n_embd),
            "head_size": str(cfg.head_size),
            "n_tokens": ",".join(str(int(n)) for n in (n_tokens or []))}
    save_file(tensors, os.fspath(path), metadata=meta)


def load_state(path: str | os.PathLike, cfg: ModelConfig):
    """Read a state written by `save_state`, checked against `cfg` -> `RWKV7State` (float32)."""
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise ValueError(f"state file {os.fspath(path)!r}: no such file")
    with safe_open(os.fspath(path), framework="np") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"state file {os.fspath(path)!r}: format {meta.get('format')!r}, "
                             f"expected {FORMAT!r} (write it with lwm_jax.generate.save_state)")
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    for key, want in (("n_layer", cfg.n_layer), ("n_embd", cfg.n_embd), ("head_size", cfg.head_size)):
        if int(meta.get(key, -1)) != want:
            raise ValueError(f"state file {os.fspath(path)!r}: saved for {key}={meta.get(key)}, "
                             f"but this model has {key}={want}")
    missing = [f for f in FIELDS if f not in arrays]
    if missing:
        raise ValueError(f"state file {os.fspath(path)!r}: tensor {missing[0]!r} is missing")
    return _state_cls()(*(jnp.asarray(arrays[f], jnp.float32) for f in FIELDS))


def state_rows(state, rows: Sequence[int]):
    """A state holding only batch rows `rows` (in that order)."""
    idx = jnp.asarray(rows, jnp.int32)
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=1), state)


def broadcast_state(state, batch_size: int):
    """Repeat a batch-1 state to `batch_size` rows (a state that already has them is returned)."""
    B = state.wkv.shape[1]
    if B == batch_size:
        return state
    if B != 1:
        raise ValueError(f"initial_state: has {B} rows but there are {batch_size} prompts; "
                         "give one row (shared) or one per prompt")
    return jax.tree.map(lambda a: jnp.repeat(a, batch_size, axis=1), state)
