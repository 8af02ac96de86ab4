"""Saving and loading a continuation point of an RWKV-7: its `RWKV7State` (e.g. after a long
system prompt, or after generated text) and the logits of the last position it consumed.

File format 2 (`lwm_jax-rwkv7-state/2`): safetensors (no pickle, no code) with float32 tensors
`tmix_shift [L, B, C]`, `cmix_shift [L, B, C]`, `wkv [L, B, H, N, N]` and `logits [B, V]` (the
raw, pre-sampling logits each row's next token is drawn from; with them a loaded state can
continue without new text) and string metadata `format`, `n_layer`, `n_embd`, `head_size`,
`n_tokens` (tokens the state has consumed, per row, comma-separated; informational).
Format 1 (`lwm_jax-rwkv7-state/1`) is the same without `logits`: it still loads, but it can
only continue after new text (the next token needs a forward step of some token).
Loading checks everything before the state is used: a truncated or garbled file, foreign or
damaged metadata, missing or misshapen tensors, logits that are not float32, and NaN/inf values
are one-line ValueErrors naming the file.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.user_input import check_output_file, one_line, quote_path, short

FORMAT = "lwm_jax-rwkv7-state/2"
FORMAT_V1 = "lwm_jax-rwkv7-state/1"      # no logits: loads, continues only after new text
FIELDS = ("tmix_shift", "cmix_shift", "wkv")
LOGITS = "logits"


class SavedState(NamedTuple):
    """What a state file holds.

    state: `RWKV7State` (float32).
    logits: float32 `[B, V]`, each row's raw logits after its last consumed token; None for a
      format-1 file (which predates them).
    n_tokens: tokens consumed per row as recorded in the file (informational; empty when the
      file does not say).
    """

    state: object
    logits: np.ndarray | None
    n_tokens: list[int]


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
               n_tokens: Sequence[int] | None = None, *, logits) -> None:
    """Write `state` (an `RWKV7State`, B rows) and `logits` (float32 `[B, V]`, or `[V]` for
    one row: the logits after each row's last consumed token, `GenerationResult.last_logits`)
    to `path` (.safetensors, format 2), tagged with the model shape.

    Raises ValueError when `path` is a directory (or below a file), when `logits` does not fit
    the state and `cfg.vocab_size`, or when the state or logits hold NaN/inf (such a file could
    not be loaded; nothing is written); OSError (with the file name) when writing fails, e.g. on
    a full disk.
    """
    from safetensors.numpy import save_file
    check_state_target(path)
    tensors = {f: np.ascontiguousarray(np.asarray(jax.device_get(getattr(state, f)), np.float32))
               for f in FIELDS}
    B, V = tensors["wkv"].shape[1], cfg.vocab_size
    arr = np.asarray(jax.device_get(logits))
    if arr.ndim == 1:
        arr = arr[None]
    if arr.shape != (B, V) or arr.dtype.kind != "f":
        raise ValueError(f"save_state: logits has shape {list(arr.shape)} ({arr.dtype}), "
                         f"expected float [{B}, {V}] (rows of the state, vocab_size); pass "
                         "GenerationResult.last_logits of the run that made the state")
    tensors[LOGITS] = np.ascontiguousarray(arr, np.float32)
    for name, t in tensors.items():
        if not np.isfinite(t).all():
            raise ValueError(f"save_state: {name} holds NaN/inf (the model's output is not "
                             f"finite); nothing was written to {quote_path(path)}")
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
    """The `RWKV7State` (float32) of a state file (`load_state_file(path, cfg).state`)."""
    return load_state_file(path, cfg).state


def load_state_file(path: str | os.PathLike, cfg: ModelConfig) -> SavedState:
    """Read a file written by `save_state` (format 2, or format 1 without logits), checked
    against `cfg` -> `SavedState`.

    Raises ValueError (one line naming the file) when it is missing, not a readable safetensors
    file, written by something else or for another model shape, lacks a tensor, has a tensor of
    the wrong shape, has logits that are not float32, or holds NaN/inf.
    """
    from safetensors import safe_open
    where = f"state file {quote_path(path)}"
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise ValueError(f"{where}: not a regular file (a FIFO, device or socket); give the file "
                         "--save-state wrote")
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    wanted = FIELDS + (LOGITS,)
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            arrays = {k: f.get_tensor(k) for k in names if k in wanted}
    except Exception as err:       # SafetensorError, OSError, ... for a damaged file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{where}: not a readable safetensors file ({one_line(first, 160)}); "
                         "save the state again with --save-state") from None
    version = meta.get("format")
    if version not in (FORMAT, FORMAT_V1):
        raise ValueError(f"{where}: format {short(version)}, expected {FORMAT!r} (or the older "
                         f"{FORMAT_V1!r}; write it with lwm_jax.generate.save_state)")
    for key, want in (("n_layer", cfg.n_layer), ("n_embd", cfg.n_embd), ("head_size", cfg.head_size)):
        got = meta.get(key, "")
        if not re.fullmatch("[0-9]{1,18}", got):
            raise ValueError(f"{where}: metadata {key}={short(got)} is not a number; the file is "
                             "damaged, save the state again")
        if int(got) != want:
            raise ValueError(f"{where}: saved for {key}={got}, but this model has {key}={want}")
    fields = FIELDS + ((LOGITS,) if version == FORMAT else ())
    missing = [f for f in fields if f not in arrays]
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]!r} is missing")
    L, C, N, V = cfg.n_layer, cfg.n_embd, cfg.head_size, cfg.vocab_size
    B = arrays["wkv"].shape[1] if arrays["wkv"].ndim == 5 else -1
    want_shapes = {"tmix_shift": ((L, B, C), f"[{L}, B, {C}]"),
                   "cmix_shift": ((L, B, C), f"[{L}, B, {C}]"),
                   "wkv": ((L, B, C // N, N, N), f"[{L}, B, {C // N}, {N}, {N}]"),
                   LOGITS: ((B, V), f"[B, {V}] (B = the state's rows, {V} = vocab_size)")}
    for name in fields:
        arr, (shape, text) = arrays[name], want_shapes[name]
        if B < 1 or tuple(arr.shape) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(arr.shape)}, expected "
                             f"{text}; the file is damaged")
        if name == LOGITS and arr.dtype != np.float32:
            raise ValueError(f"{where}: tensor 'logits' has dtype {arr.dtype}, expected float32; "
                             "the file is damaged, save the state again")
        if arr.dtype.kind != "f" or not bool(np.isfinite(arr).all()):
            raise ValueError(f"{where}: tensor {name!r} holds NaN/inf or non-float values; the "
                             "state is unusable, save it again")
    state = _state_cls()(*(jnp.asarray(arrays[f], jnp.float32) for f in FIELDS))
    logits = np.array(arrays[LOGITS], np.float32) if version == FORMAT else None
    return SavedState(state, logits, _counts(meta.get("n_tokens", ""), B))


def _counts(text: str, rows: int) -> list[int]:
    """`n_tokens` metadata as integers, one per row; [] when absent or malformed (it is only
    informational, so a bad value is dropped rather than refused)."""
    parts = text.split(",") if text else []
    if len(parts) != rows or not all(re.fullmatch("[0-9]{1,18}", p) for p in parts):
        return []
    return [int(p) for p in parts]


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
