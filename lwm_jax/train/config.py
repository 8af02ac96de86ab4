"""Typed run configuration for `lwm-jax train`: YAML file + dotted overrides -> `RunConfig`.

A run config has a few top-level keys (`name`, `run_dir`, `precision`, `arch`) and seven sections:

| section      | type              | what                                                        |
|--------------|-------------------|-------------------------------------------------------------|
| `model`      | per `arch`        | architecture: `ModelConfig` / `LlamaConfig` / `HybridConfig` |
| `runtime`    | `Runtime`         | WKV implementation, chunk, remat, layer scan (`lwm_jax.runtime`) |
| `train`      | `TrainSection`    | optimiser, schedule, batch, loop cadence                    |
| `data`       | `DataSection`     | data (`path` or `sources`), tokenizer, validation split     |
| `checkpoint` | `CheckpointSection` | where/how often to save, how many to keep, async or not   |
| `mesh`       | `MeshSection`     | device-mesh axis sizes (data, fsdp, tensor, sequence)       |
| `logging`    | `LoggingSection`  | trackers (metrics.jsonl, TensorBoard, Weights & Biases)     |

`data.path`, and each entry of `data.sources` (a weighted mixture in its place), names a binidx
prefix, a directory or `.jsonl` / `.parquet` / `.txt` file of text tokenised on the fly, or
`hf:<dataset>[:<config>[:<split>]]` (streamed `datasets`); `path: null` with no `sources` trains
on the embedded corpus (`lwm_jax.data.corpus`).

Every key a YAML file leaves out takes its built-in default, and the built-in defaults ARE the
tiny run (`configs/tiny.yaml` mirrors them; a test keeps the two equal), so `lwm-jax train` with
no `--config` works from any directory. Values in YAML and in overrides (`train.lr=3e-4`) are
parsed with `yaml.safe_load`; numbers written like `6e-4` (a string to YAML 1.1) are accepted for
float keys. Every mistake is a one-line `ValueError` that starts with the dotted key; values
quoted in messages are cut to ~80 characters. YAML is read with `lwm_jax.user_input.load_yaml`:
duplicate keys, alias bombs and absurd nesting are refused, not expanded.

This module reads the YAML, applies the overrides and builds the `RunConfig`; the section
dataclasses are defined in `lwm_jax.train.config_sections` and the value checks in
`lwm_jax.train.config_validation`. Import all of them from here.
"""
from __future__ import annotations

import os
import typing
from typing import Any, Sequence

from lwm_jax.models.registry import get_arch
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.precision import parse_policy
from lwm_jax.runtime import RUNTIME_FIELDS
from lwm_jax.train.config_sections import (SECTIONS, TINY_MODEL, TOP_SCALARS, CheckpointSection,
                                           DataSection, LoggingSection, MeshSection, RunConfig,
                                           TrainSection)
from lwm_jax.train.config_validation import (INT32_MAX, MAX_LR, binidx_prefix, build_section,
                                             check_against_mesh, check_values, coerce,
                                             coerce_fields, fail, mesh_shape, short_key)
from lwm_jax.user_input import load_yaml, load_yaml_file, short

__all__ = ["CheckpointSection", "DataSection", "INT32_MAX", "LoggingSection", "MAX_LR",
           "MeshSection", "RunConfig", "TINY_MODEL", "TrainSection", "apply_overrides",
           "binidx_prefix", "build_config", "check_against_mesh", "load_config", "mesh_shape"]


def build_config(raw: dict[str, Any], data_files: bool = True) -> RunConfig:
    """Validate a plain dict (YAML contents, overrides applied) into a `RunConfig`.

    Keys missing from `raw` take the defaults of `RunConfig()` (the tiny run). `data_files=False`
    skips the existence checks of the data files (commands that build only the model).
    """
    if not isinstance(raw, dict):
        raise ValueError(f"config: expected a mapping at the top level, got {type(raw).__name__}")
    valid = sorted([*TOP_SCALARS, "model", *SECTIONS])
    unknown = sorted(set(map(str, raw)) - set(valid))
    if unknown:
        fail(short_key(unknown[0]), f"unknown key; valid keys: {', '.join(valid)}")
    base = RunConfig().to_dict()
    hints = typing.get_type_hints(RunConfig)
    top = {k: coerce(k, raw.get(k, base[k]), hints[k]) for k in TOP_SCALARS}
    parse_policy(top["precision"])            # raises "precision: ..." on a bad string
    arch = get_arch(top["arch"])              # raises "arch: ..." for an unknown family
    model_raw = raw.get("model", {})
    if not isinstance(model_raw, dict):
        fail("model", f"expected a mapping of keys, got {short(model_raw)}")
    raw, model_raw = _move_legacy_runtime_keys(raw, model_raw)
    model_cls = arch.config_cls
    model_raw = coerce_fields(model_cls, model_raw, "model")   # typed here: short messages
    defaults = base["model"] if model_cls is ModelConfig else model_cls().to_dict()
    try:
        model = model_cls.from_dict({**defaults, **model_raw}, where="model")
    except ValueError as err:         # say which family's keys these are
        if "unknown key" not in str(err):
            raise
        raise ValueError(f"{err} (model keys of arch {arch.name})") from None
    sections = {}
    for sec, cls in SECTIONS.items():
        given = raw.get(sec, {})
        if not isinstance(given, dict):
            fail(sec, f"expected a mapping of keys, got {short(given)}")
        sections[sec] = build_section(cls, sec, {**base[sec], **given})
    cfg = RunConfig(**top, model=model, **sections)
    check_values(cfg, data_files)
    return cfg


def _move_legacy_runtime_keys(raw: dict[str, Any], model_raw: dict[str, Any]):
    """Configs written before the `runtime:` section kept `wkv_impl`, `chunk_size`, `remat` and
    `scan_layers` under `model:`; they still load, moved to `runtime:` (a key set in both
    places is a one-line error)."""
    legacy = {k: v for k, v in model_raw.items() if k in RUNTIME_FIELDS}
    if not legacy:
        return raw, model_raw
    runtime_raw = raw.get("runtime", {})
    if not isinstance(runtime_raw, dict):
        fail("runtime", f"expected a mapping of keys, got {short(runtime_raw)}")
    both = sorted(set(legacy) & set(runtime_raw))
    if both:
        fail(f"model.{both[0]}", f"is a runtime key, also set as runtime.{both[0]}; keep only "
                                 f"runtime.{both[0]}")
    rest = {k: v for k, v in model_raw.items() if k not in RUNTIME_FIELDS}
    return {**raw, "runtime": {**runtime_raw, **legacy}}, rest


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b=value` strings to a nested dict (value parsed by `yaml.safe_load`)."""
    out = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            raise ValueError(f"override {short(item)}: expected key=value, e.g. train.lr=3e-4")
        bad = next((i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff"), None)
        if bad is not None:           # a byte of a non-UTF-8 command-line argument
            fail(short_key(key), f"the value holds byte 0x{ord(text[bad]) - 0xdc00:02x}, which "
                                 "is not UTF-8; config values (paths included) must be UTF-8 "
                                 "text: rename the file or directory")
        value = load_yaml(text, f"{short_key(key)}: value {short(text)}") if text.strip() else None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                fail(".".join(parts[:i + 1]), f"is a value, not a section; cannot set "
                                              f"{short_key(key)}")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(d: Any) -> Any:
    return {k: _deep_copy(v) for k, v in d.items()} if isinstance(d, dict) else d


def load_config(path: str | None = None, overrides: Sequence[str] = (),
                data_files: bool = True) -> RunConfig:
    """Read a YAML run config (None = the built-in tiny defaults), apply overrides, validate
    (`data_files=False`: without the data files' existence checks, for model-only commands).

    Without a `name:` key the run is named after the file (`configs/rwkv7-0.1b.yaml` ->
    `rwkv7-0.1b`). Raises ValueError (one line, naming the file or the dotted key) for a missing
    file, bad or refused YAML (`lwm_jax.user_input.load_yaml`) and every invalid value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        if os.path.isdir(path):
            raise ValueError(f"--config: {path} is a directory; give a YAML file")
        if not os.path.isfile(path):
            raise ValueError(f"--config: {path} not found")
        loaded = load_yaml_file(path, f"--config: {path}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"--config: {path} must hold a mapping at the top level, "
                             f"got {type(loaded).__name__}")
        raw = loaded or {}
        raw.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    return build_config(apply_overrides(raw, overrides), data_files)
