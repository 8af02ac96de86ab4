"""Typed run configuration for `lwm-jax train`: YAML file + dotted overrides -> `RunConfig`.

A run config has a few top-level keys (`name`, `run_dir`, `precision`, `arch`) and seven sections:

| section      | type              | what                                                        |
|--------------|-------------------|-------------------------------------------------------------|
| `model`      | per `arch`        | architecture: `ModelConfig` (rwkv7) or `LlamaConfig` (llama) |
| `runtime`    | `Runtime`         | WKV implementation, chunk, remat, layer scan (`lwm_jax.runtime`) |
| `train`      | `TrainSection`    | optimiser, schedule, batch, loop cadence                    |
| `data`       | `DataSection`     | binidx prefix (or null = embedded corpus), tokenizer        |
| `checkpoint` | `CheckpointSection` | where/how often to save, how many to keep, async or not   |
| `mesh`       | `MeshSection`     | device-mesh axis sizes (data, fsdp, tensor, sequence)       |
| `logging`    | `LoggingSection`  | trackers (metrics.jsonl, TensorBoard, Weights & Biases)     |

Every key a YAML file leaves out takes its built-in default, and the built-in defaults ARE the
tiny run (`configs/tiny.yaml` mirrors them; a test keeps the two equal), so `lwm-jax train` with
no `--config` works from any directory. Values in YAML and in overrides (`train.lr=3e-4`) are
parsed with `yaml.safe_load`; numbers written like `6e-4` (a string to YAML 1.1) are accepted for
float keys. Every mistake is a one-line `ValueError` that starts with the dotted key; values
quoted in messages are cut to ~80 characters. YAML is read with `lwm_jax.user_input.load_yaml`:
duplicate keys, alias bombs and absurd nesting are refused, not expanded.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from typing import Any, Sequence

import yaml

from lwm_jax.models.registry import DEFAULT_ARCH, get_arch
from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.runtime import RUNTIME_FIELDS, Runtime
from lwm_jax.precision import parse_policy
from lwm_jax.user_input import load_yaml, load_yaml_file, short

# The tiny model: L4 D256 byte-level, 3.6M parameters.
TINY_MODEL = ModelConfig(vocab_size=256, n_layer=4, n_embd=256, head_size=64)


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """Optimiser and loop settings.

    lr / min_lr: peak and final learning rate (cosine from lr to min_lr after warmup).
    warmup_steps: steps of the RWKV-LM warmup multiplier 0.01 + 0.99·step/warmup_steps.
    steps: optimizer steps in the run.
    batch_size: sequences per optimizer step (global, across devices and micro-batches).
    ctx_len: tokens per sequence (the model sees ctx_len tokens and predicts the next ctx_len).
    grad_accum: micro-batches per step (batch_size / grad_accum sequences each, summed exactly).
    weight_decay: decoupled AdamW decay, applied to projection/embedding/head matrices only.
    betas, eps: AdamW moment decay rates and epsilon (moments are always float32).
    grad_clip: global-norm clip threshold (0 = no clipping).
    l2wrap: add RWKV-LM's L2Wrap gradient on each position's max logit.
    seed: initialisation / data-order seed.
    eval_every: validation every this many steps (0 = only at the end).
    eval_batches: batches of `batch_size` sequences per validation.
    log_every: steps between metric records.
    loss_chunk: tokens (summed over the batch rows) whose logits exist at once in the loss: the
      fused loss computes logits, cross-entropy and their gradient chunk by chunk, so
      `[B, T, V]` float32 logits never exist. 0 = unfused (all logits at once).
    max_consecutive_skips: stop the run after this many optimizer steps in a row were skipped
      because the loss or a gradient was non-finite (their update is never applied; under
      fp16 loss scaling only skips at the minimum loss scale count). 0 = never stop.
    profile_steps: `[start, stop]`: write a `jax.profiler` trace of optimizer steps
      start..stop-1 (0-based; a call's first step includes compilation) to
      `<run_dir>/profile/` (`lwm_jax.train.profiling`); null = no trace.
    """

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    steps: int = 150
    batch_size: int = 16
    ctx_len: int = 128
    grad_accum: int = 1
    weight_decay: float = 0.001
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-18
    grad_clip: float = 1.0
    l2wrap: bool = True
    seed: int = 0
    eval_every: int = 25
    eval_batches: int = 4
    log_every: int = 5
    loss_chunk: int = 4096
    max_consecutive_skips: int = 8
    profile_steps: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Training data.

    path: prefix of a binidx pair (`<path>.bin` + `<path>.idx`), or null for the embedded default
      corpus (Python standard-library sources, byte-level tokenised, with a held-out split), or
      text tokenised on the fly (`lwm_jax.data.text_sources`): a directory of / a `.jsonl`,
      `.parquet` or `.txt` file, or `hf:<dataset>[:<config>[:<split>]]` (streamed `datasets`).
    val_path: prefix of a separate validation binidx pair; null = hold out `val_fraction` of
      `path`'s documents.
    tokenizer: "byte", "world[:vocab_path]" or "hf:path/to/tokenizer.json"; it must match the
      tokenizer the binidx was written with (only its vocabulary size is used in training).
    val_fraction: fraction of the documents held out for validation when `val_path` is null
      (0 = no validation): a binidx `path` gives its last documents; text and `hf:` sources
      each document whose text hashes below the fraction (`lwm_jax.data.text_sources`: the
      same split in every run and resume); in a mixture every source holds out its own.
    sources / weights: a weighted mixture instead of `path`: any of the `path` forms above, and
      one positive weight each (empty = equal weights); each batch row picks a source by a
      seeded draw (`lwm_jax.data.mixture`).
    text_key: the field (`.jsonl`, `datasets`) or column (`.parquet`) holding the text.
    reset_at_document_boundary: restart the model's state at every document inside a training
      window: segment ids from the end-of-document token (the tokenizer's `eod_id`, 0 for byte
      and World) reset the RWKV-7 state and token shift, and confine Llama attention and RoPE
      positions, so no document sees the one before it. False (default) trains as RWKV-LM
      does: documents concatenated, separated by the EOD token, state flowing across it.
    """

    path: str | None = None
    val_path: str | None = None
    tokenizer: str = "byte"
    val_fraction: float = 0.05
    reset_at_document_boundary: bool = False
    sources: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    text_key: str = "text"


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Checkpoints (orbax). dir: null = `<run_dir>/checkpoints`. every: steps between saves
    (0 = only at the end). keep: newest checkpoints kept. async: save in a background thread."""

    dir: str | None = None
    every: int = 50
    keep: int = 3
    async_: bool = True


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device-mesh axis sizes; exactly one may be -1 (= all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Where training records go (`lwm_jax.train.trackers`); only process 0 writes.

    trackers: any of `jsonl` (`metrics.jsonl`, which also draws `loss_curve.png`),
      `tensorboard` (tensorboardX events in `<run_dir>/tb`; without tensorboardX the run says
      so in one line and goes on), `wandb` (Weights & Biases; needs `wandb`;
      `WANDB_MODE=offline` keeps it on disk in `<run_dir>/wandb/`).
    wandb_project / wandb_entity: the W&B project, and entity (null = your default entity).
    """

    trackers: tuple[str, ...] = ("jsonl", "tensorboard")
    wandb_project: str = "lwm-jax"
    wandb_entity: str | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole training run. name: run name (default run dir `runs/<name>`); run_dir: null =
    `runs/<name>` relative to the working directory; precision: a `parse_policy` string;
    arch: the model family (`lwm_jax.models.registry.ARCHS`), which decides the `model` type
    (a `ModelConfig` for rwkv7, a `LlamaConfig` for llama)."""

    name: str = "tiny"
    run_dir: str | None = None
    precision: str = "fp32"
    arch: str = DEFAULT_ARCH
    model: Any = TINY_MODEL
    runtime: Runtime = Runtime()
    train: TrainSection = TrainSection()
    data: DataSection = DataSection()
    checkpoint: CheckpointSection = CheckpointSection()
    mesh: MeshSection = MeshSection()
    logging: LoggingSection = LoggingSection()

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join("runs", self.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.resolved_run_dir, "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able dict (the inverse of `build_config`)."""
        out: dict[str, Any] = {"name": self.name, "run_dir": self.run_dir,
                               "precision": self.precision, "arch": self.arch,
                               "model": self.model.to_dict()}
        for sec in _SECTIONS:
            d = dataclasses.asdict(getattr(self, sec))
            out[sec] = {_yaml_key(k): list(v) if isinstance(v, tuple) else v for k, v in d.items()}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_SECTIONS = {"runtime": Runtime, "train": TrainSection, "data": DataSection, "checkpoint": CheckpointSection,
             "mesh": MeshSection, "logging": LoggingSection}
_TOP_SCALARS = ("name", "run_dir", "precision", "arch")


def _yaml_key(field_name: str) -> str:
    return field_name.rstrip("_")          # `async_` is spelled `async` in YAML


def _fail(key: str, msg: str):
    raise ValueError(f"{key}: {msg}")


INT32_MAX = 2**31 - 1
MAX_LR = 1e30


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check/convert one YAML value against a field annotation (int, float, bool, str, tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:     # tuple[int, ...]
        if not isinstance(value, (list, tuple)):
            _fail(key, f"expected a list, got {short(value)}")
        return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            _fail(key, f"expected a list of {len(args)} numbers, got {short(value)}")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            _fail(key, f"expected true or false, got {short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, f"expected an integer, got {short(value)}")
        if abs(value) > INT32_MAX:      # step counters, seeds and sizes become int32 arrays
            _fail(key, f"{short(value)} is out of range; config integers lie within "
                       f"+-{INT32_MAX} (int32 on the device)")
        return value
    if tp is float:
        if isinstance(value, str):           # YAML 1.1 reads `6e-4` as a string
            try:
                value = float(value)
            except ValueError:
                _fail(key, f"expected a number, got {short(value)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            _fail(key, f"expected a finite number, got {short(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(key, f"expected a string, got {short(value)}")
        return value
    raise TypeError(f"{key}: unsupported field type {tp!r}")   # programming error, not user input


def _coerce_fields(cls, raw: dict[str, Any], where: str) -> dict[str, Any]:
    """`raw` with every value of a known field of dataclass `cls` checked/converted by
    `_coerce`; a mapping given for a dataclass-typed field (e.g. `rope_scaling`) is coerced
    field by field. Unknown keys pass through (the config's `from_dict` reports them)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in raw.items():
        hint = hints.get(key)
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)] or (
            [hint] if dataclasses.is_dataclass(hint) else [])
        if hint is None or (inner and not isinstance(value, dict)):
            out[key] = value
        elif inner:
            out[key] = _coerce_fields(inner[0], value, f"{where}.{key}")
        else:
            out[key] = _coerce(f"{where}.{key}", value, hint)
    return out


def _build_section(cls, where: str, raw: Any):
    if not isinstance(raw, dict):
        _fail(where, f"expected a mapping of keys, got {short(raw)}")
    hints = typing.get_type_hints(cls)
    by_yaml = {_yaml_key(f.name): f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, raw)) - set(by_yaml))
    if unknown:
        _fail(f"{where}.{_key(unknown[0])}",
              f"unknown key; valid keys: {', '.join(sorted(by_yaml))}")
    kwargs = {by_yaml[k]: _coerce(f"{where}.{k}", v, hints[by_yaml[k]]) for k, v in raw.items()}
    return cls(**kwargs)


def _key(name: str, limit: int = 60) -> str:
    """A (possibly user-typed, possibly huge) key name or path, cut for a message."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _check_values(cfg: RunConfig, data_files: bool = True) -> None:
    t, d, c, m = cfg.train, cfg.data, cfg.checkpoint, cfg.mesh
    positive = {"train.lr": t.lr, "train.eps": t.eps, "train.steps": t.steps,
                "train.batch_size": t.batch_size, "train.ctx_len": t.ctx_len,
                "train.grad_accum": t.grad_accum, "train.eval_batches": t.eval_batches,
                "train.log_every": t.log_every, "checkpoint.keep": c.keep}
    for key, v in positive.items():
        too_small = v < 1 if isinstance(v, int) else v <= 0
        if too_small:
            _fail(key, f"must be {'>= 1' if isinstance(v, int) else '> 0'}, got {v}")
    non_negative = {"train.min_lr": t.min_lr, "train.warmup_steps": t.warmup_steps,
                    "train.weight_decay": t.weight_decay, "train.grad_clip": t.grad_clip,
                    "train.eval_every": t.eval_every, "train.seed": t.seed,
                    "train.max_consecutive_skips": t.max_consecutive_skips,
                    "train.loss_chunk": t.loss_chunk,
                    "checkpoint.every": c.every}
    for key, v in non_negative.items():
        if v < 0:
            _fail(key, f"must be >= 0, got {v}")
    if t.lr > MAX_LR:
        # AdamW moves every weight by about lr per step: beyond ~3e38 one update leaves float32
        # (1e39 is inf there) and the parameters turn non-finite past the step's guard, which
        # checks the loss and gradient; up to MAX_LR a too-large rate diverges the ordinary
        # way: non-finite losses, skipped steps, exit 3 (tests/train/test_nonfinite_guard.py)
        _fail("train.lr", f"{t.lr:g} is beyond {MAX_LR:g}: one AdamW update would move the "
                          "weights out of float32's range; use a learning rate below 1 (6e-4 is "
                          "RWKV-LM's)")
    if t.warmup_steps > t.steps:
        _fail("train.warmup_steps", f"{t.warmup_steps} is larger than train.steps={t.steps}; "
                                    "lower train.warmup_steps or raise train.steps")
    if t.profile_steps is not None:
        start, stop = t.profile_steps
        if not 0 <= start < stop <= t.steps:
            _fail("train.profile_steps", f"[{start}, {stop}] must satisfy 0 <= start < stop <= "
                                         f"train.steps={t.steps}, e.g. [10, 13]")
    _check_trackers(cfg.logging.trackers)
    if t.min_lr > t.lr:
        _fail("train.min_lr", f"{t.min_lr} is larger than train.lr={t.lr}; lower train.min_lr too")
    for i, beta in enumerate(t.betas):
        if not 0.0 <= beta < 1.0:
            _fail(f"train.betas[{i}]", f"must be in [0, 1), got {beta}")
    if t.batch_size % t.grad_accum:
        _fail("train.batch_size", f"{t.batch_size} is not divisible by train.grad_accum="
                                  f"{t.grad_accum}")
    if not 0.0 <= d.val_fraction < 1.0:
        _fail("data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    _check_data_sources(d, data_files)
    sizes = dataclasses.asdict(m)
    for axis, size in sizes.items():
        if size != -1 and size < 1:
            _fail(f"mesh.{axis}", f"must be >= 1 or -1 (= the remaining devices), got {size}")
    if list(sizes.values()).count(-1) > 1:
        _fail("mesh", "at most one axis may be -1")
    if not cfg.name or "/" in cfg.name:
        _fail("name", f"must be a non-empty name without '/', got {short(cfg.name)}")
    _check_locations(cfg)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _check_locations(cfg: RunConfig) -> None:
    """run_dir is written with local file calls: no URL. checkpoint.dir goes to orbax, which
    writes local paths and gs:// (etils epath + gcsfs) here; any other scheme is refused."""
    if cfg.run_dir is not None and _URL.match(cfg.run_dir):
        _fail("run_dir", f"{_key(cfg.run_dir)!r} is a URL, but lwm-jax train writes the run "
                         "dir with local file calls; keep run_dir local and set "
                         "checkpoint.dir=gs://...")
    ckpt = cfg.checkpoint.dir
    if ckpt is not None and _URL.match(ckpt) and not ckpt.startswith("gs://"):
        _fail("checkpoint.dir", f"{_key(ckpt)!r}: only gs:// URLs are supported (unsupported "
                                f"URL scheme {ckpt.split('://')[0][:20]!r}); use a local path "
                                "or gs://BUCKET/PATH")


def _check_data_sources(d: DataSection, files: bool = True) -> None:
    from lwm_jax.data.text_sources import missing_binidx, source_kind
    if d.sources and d.path is not None:
        _fail("data.sources", "set data.path or data.sources, not both (data.path=null)")
    if d.weights and len(d.weights) != len(d.sources):
        _fail("data.weights", f"{len(d.weights)} weights for {len(d.sources)} data.sources; give "
                              "one per source, or none for equal weights")
    for i, w in enumerate(d.weights):
        if w <= 0:
            _fail(f"data.weights[{i}]", f"must be > 0, got {w}")
    named = [("data.path", d.path)] if d.path is not None else []
    named += [(f"data.sources[{i}]", spec) for i, spec in enumerate(d.sources)]
    named += [("data.val_path", d.val_path)] if d.val_path is not None else []
    for key, spec in named if files else ():
        kind = source_kind(spec) if key != "data.val_path" else "binidx"
        if kind == "text" and not os.path.exists(spec):
            _fail(key, f"{_key(spec, 240)} not found; give a directory or a .jsonl, .parquet or "
                       ".txt file")
        if kind == "binidx":
            for ext in (".bin", ".idx"):
                if not os.path.isfile(binidx_prefix(spec) + ext):
                    _fail(key, missing_binidx(key, binidx_prefix(spec) + ext, d.tokenizer))
    if d.val_path is not None and d.path is None and not d.sources:
        _fail("data.val_path", "needs data.path too (the embedded corpus has its own split)")


def _check_trackers(names: tuple[str, ...]) -> None:
    known = ("jsonl", "tensorboard", "wandb")        # lwm_jax.train.trackers.TRACKERS
    for i, name in enumerate(names):
        if name not in known:
            _fail(f"logging.trackers[{i}]", f"{short(name)} is not one of {', '.join(known)}")
        if name in names[:i]:
            _fail(f"logging.trackers[{i}]", f"{name} is listed twice; list each tracker once")


def binidx_prefix(path: str) -> str:
    """`data/x.bin`, `data/x.idx` and `data/x` all name the binidx pair `data/x`."""
    root, ext = os.path.splitext(path)
    return root if ext in (".bin", ".idx") else path


def build_config(raw: dict[str, Any], data_files: bool = True) -> RunConfig:
    """Validate a plain dict (YAML contents, overrides applied) into a `RunConfig`.

    Keys missing from `raw` take the defaults of `RunConfig()` (the tiny run). `data_files=False`
    skips the existence checks of the data files (commands that build only the model).
    """
    if not isinstance(raw, dict):
        raise ValueError(f"config: expected a mapping at the top level, got {type(raw).__name__}")
    valid = sorted([*_TOP_SCALARS, "model", *_SECTIONS])
    unknown = sorted(set(map(str, raw)) - set(valid))
    if unknown:
        _fail(_key(unknown[0]), f"unknown key; valid keys: {', '.join(valid)}")
    base = RunConfig().to_dict()
    hints = typing.get_type_hints(RunConfig)
    top = {k: _coerce(k, raw.get(k, base[k]), hints[k]) for k in _TOP_SCALARS}
    parse_policy(top["precision"])            # raises "precision: ..." on a bad string
    arch = get_arch(top["arch"])              # raises "arch: ..." for an unknown family
    model_raw = raw.get("model", {})
    if not isinstance(model_raw, dict):
        _fail("model", f"expected a mapping of keys, got {short(model_raw)}")
    raw, model_raw = _move_legacy_runtime_keys(raw, model_raw)
    model_cls = arch.config_cls
    model_raw = _coerce_fields(model_cls, model_raw, "model")   # typed here: short messages
    defaults = base["model"] if model_cls is ModelConfig else model_cls().to_dict()
    try:
        model = model_cls.from_dict({**defaults, **model_raw}, where="model")
    except ValueError as err:         # say which family's keys these are
        if "unknown key" not in str(err):
            raise
        raise ValueError(f"{err} (model keys of arch {arch.name})") from None
    sections = {}
    for sec, cls in _SECTIONS.items():
        given = raw.get(sec, {})
        if not isinstance(given, dict):
            _fail(sec, f"expected a mapping of keys, got {short(given)}")
        sections[sec] = _build_section(cls, sec, {**base[sec], **given})
    cfg = RunConfig(**top, model=model, **sections)
    _check_values(cfg, data_files)
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
        _fail("runtime", f"expected a mapping of keys, got {short(runtime_raw)}")
    both = sorted(set(legacy) & set(runtime_raw))
    if both:
        _fail(f"model.{both[0]}", f"is a runtime key, also set as runtime.{both[0]}; keep only "
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
            _fail(_key(key), f"the value holds byte 0x{ord(text[bad]) - 0xdc00:02x}, which is not "
                             "UTF-8; config values (paths included) must be UTF-8 text: rename "
                             "the file or directory")
        value = load_yaml(text, f"{_key(key)}: value {short(text)}") if text.strip() else None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                _fail(".".join(parts[:i + 1]), f"is a value, not a section; cannot set "
                                               f"{_key(key)}")
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


def mesh_shape(mesh: MeshSection, n_devices: int) -> dict[str, int]:
    """Resolve -1 in the mesh section against the device count; one-line error on a mismatch."""
    sizes = dataclasses.asdict(mesh)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if n_devices % fixed:
            _fail("mesh", f"the fixed axis sizes {sizes} (product {fixed}) do not divide the "
                          f"{n_devices} available devices")
        sizes = {k: (n_devices // fixed if v == -1 else v) for k, v in sizes.items()}
    elif fixed != n_devices:
        _fail("mesh", f"data*fsdp*tensor*sequence = {fixed} but {n_devices} devices are "
                      "available; set one axis to -1 to fill")
    return sizes


def check_against_mesh(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """Batch/sequence divisibility by the mesh (needs the device count, so not in build_config)."""
    t = cfg.train
    dp = sizes["data"] * sizes["fsdp"]
    micro = t.batch_size // t.grad_accum
    if micro % dp:
        _fail("train.batch_size", f"{t.batch_size} sequences ({micro} per micro-batch with "
                                  f"train.grad_accum={t.grad_accum}) is not divisible by "
                                  f"mesh data*fsdp = {dp} devices")
    if t.ctx_len % sizes["sequence"]:
        _fail("train.ctx_len", f"{t.ctx_len} is not divisible by mesh.sequence="
                               f"{sizes['sequence']}")
