"""Saving and loading an `RWKV7State` (e.g. after a long system prompt) for later reuse.

File format: safetensors (no pickle) with tensors `tmix_shift [L, B, C]`, `cmix_shift [L, B, C]`,
`wkv [L, B, H, N, N]` (float32) and string metadata `format`, `n_layer`, `n_embd`, `head_size`,
`n_tokens` (tokens the state has consumed, per row, comma-separated; informational).
Loading checks everything before the state is used: a truncated or garbled file, foreign or
damaged metadata, missing or misshapen tensors and NaN/inf values are one-line ValueErrors
naming the file.
"""
from __future__ import annotations

import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.user_input import check_output_file, one_line, quote_path, short

FORMAT = "lwm_jax-rwkv7-state/1"
FIELDS = ("tmix_shift", "cmix_shift", "wkv")


def _state_cls():
    from lwm_jax.models.rwkv7 import RWKV7State
    return RWKV7State


def check_state_target(path: str | os.PathLike, key: str = "state file") -> None:
    """Refuse (ValueError, one line) a state output path that is a directory, lies below a
    file, or exists as something other than a regular file: safetensors writes a temporary file
    and renames it over the target, which would replace a device node or pipe."""
    check_output_file(path, key)
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ValueError(f"{key}: {quote_path(path)} exists and is not a regular file (a device, "
                         "pipe or broken link); give a new file name")


def save_state(path: str | os.PathLike, state, cfg: ModelConfig,
               n_tokens: Sequence[int] | None = None) -> None:
    """Write `state` (an `RWKV7State`) to `path` (.safetensors), tagged with the model shape.

    Raises ValueError when `path` is a directory (or below a file) and OSError (with the file
    name) when writing fails, e.g. on a full disk.
    """
    from safetensors.numpy import save_file
    check_state_target(path)
    tensors = {f: np.ascontiguousarray(np.asarray(jax.device_get(getattr(state, f)), np.float32))
               for f in FIELDS}
    meta = {"format": FORMAT, "n_layer": str(cfg.n_layer), "n_embd": str(cfg.n_embd),
            "head_size": str(cfg.head_size),
            "n_tokens": ",".join(str(int(n)) for n in (n_tokens or []))}
    try:
        save_file(tensors, os.fspath(path), metadata=meta)
    except Exception as err:       # safetensors reports I/O failures as its own error type
        if isinstance(err, OSError) and err.filename is not None:
            raise
        text = str(err)
        if "No space left" in text or "os error 28" in text:
            import errno
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path)) from None
        raise ValueError(f"state file {quote_path(path)}: cannot be written "
                         f"({one_line(text, 200)}); choose another path") from None


def load_state(path: str | os.PathLike, cfg: ModelConfig):
    """Read a state written by `save_state`, checked against `cfg` -> `RWKV7State` (float32).

    Raises ValueError (one line naming the file) when it is missing, not a readable safetensors
    file, written by something else or for another model shape, lacks a tensor, has a tensor of
    the wrong shape, or holds NaN/inf.
    """
    from safetensors import safe_open
    where = f"state file {quote_path(path)}"
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            arrays = {k: f.get_tensor(k) for k in names if k in FIELDS}
    except Exception as err:       # SafetensorError, OSError, ... for a damaged file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{where}: not a readable safetensors file ({one_line(first, 160)}); "
                         "save the state again with --save-state") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{where}: format {short(meta.get('format'))}, expected {FORMAT!r} "
                         "(write it with lwm_jax.generate.save_state)")
    for key, want in (("n_layer", cfg.n_layer), ("n_embd", cfg.n_embd), ("head_size", cfg.head_size)):
        got = meta.get(key, "")
        if not got.isdigit():
            raise ValueError(f"{where}: metadata {key}={short(got)} is not a number; the file is "
                             "damaged, save the state again")
        if int(got) != want:
            raise ValueError(f"{where}: saved for {key}={got}, but this model has {key}={want}")
    missing = [f for f in FIELDS if f not in arrays]
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]!r} is missing")
    L, C, N = cfg.n_layer, cfg.n_embd, cfg.head_size
    B = arrays["wkv"].shape[1] if arrays["wkv"].ndim == 5 else -1
    want_shapes = {"tmix_shift": ((L, B, C), f"[{L}, B, {C}]"),
                   "cmix_shift": ((L, B, C), f"[{L}, B, {C}]"),
                   "wkv": ((L, B, C // N, N, N), f"[{L}, B, {C // N}, {N}, {N}]")}
    for name, (shape, text) in want_shapes.items():
        arr = arrays[name]
        if B < 1 or tuple(arr.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(arr.shape)}, expected "
                             f"{text}; the file is damaged")
        if arr.dtype.kind != "f" or not bool(np.isfinite(arr).all()):
            raise ValueError(f"{where}: tensor {name!r} holds NaN/inf or non-float values; the "
                             "state is unusable, save it again")
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
