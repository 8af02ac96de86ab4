"""Validation of a training run's config: each YAML value checked and converted against its
field's type (`coerce`), a section built from a mapping (`build_section`), the cross-field and
file checks of a whole `RunConfig` (`check_values`), and the mesh checks that need the device
count (`mesh_shape`, `check_against_mesh`). Every mistake is a one-line `ValueError` that starts
with the dotted key (`fail`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from typing import Any

from lwm_jax.data.prepare import binidx_prefix
from lwm_jax.train.config_sections import DataSection, MeshSection, RunConfig, yaml_key
from lwm_jax.user_input import short


def fail(key: str, msg: str):
    """Raise the one-line `ValueError` of a config mistake: `<dotted key>: <message>`."""
    raise ValueError(f"{key}: {msg}")


INT32_MAX = 2**31 - 1
MAX_LR = 1e30


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check/convert one YAML value against a field annotation (int, float, bool, str, tuples)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(key, value, inner)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:     # tuple[int, ...]
        if not isinstance(value, (list, tuple)):
            fail(key, f"expected a list, got {short(value)}")
        return tuple(coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            fail(key, f"expected a list of {len(args)} numbers, got {short(value)}")
        return tuple(coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            fail(key, f"expected true or false, got {short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, f"expected an integer, got {short(value)}")
        if abs(value) > INT32_MAX:      # step counters, seeds and sizes become int32 arrays
            fail(key, f"{short(value)} is out of range; config integers lie within "
                      f"+-{INT32_MAX} (int32 on the device)")
        return value
    if tp is float:
        if isinstance(value, str):           # YAML 1.1 reads `6e-4` as a string
            try:
                value = float(value)
            except ValueError:
                fail(key, f"expected a number, got {short(value)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            fail(key, f"expected a finite number, got {short(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(key, f"expected a string, got {short(value)}")
        return value
    raise TypeError(f"{key}: unsupported field type {tp!r}")   # programming error, not user input


def coerce_fields(cls, raw: dict[str, Any], where: str) -> dict[str, Any]:
    """`raw` with every value of a known field of dataclass `cls` checked/converted by
    `coerce`; a mapping given for a dataclass-typed field (e.g. `rope_scaling`) is coerced
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
            out[key] = coerce_fields(inner[0], value, f"{where}.{key}")
        else:
            out[key] = coerce(f"{where}.{key}", value, hint)
    return out


def build_section(cls, where: str, raw: Any):
    """Section dataclass `cls` from the mapping `raw` given at key `where`: unknown keys refused,
    each value checked by `coerce`."""
    if not isinstance(raw, dict):
        fail(where, f"expected a mapping of keys, got {short(raw)}")
    hints = typing.get_type_hints(cls)
    by_yaml = {yaml_key(f.name): f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, raw)) - set(by_yaml))
    if unknown:
        fail(f"{where}.{short_key(unknown[0])}",
             f"unknown key; valid keys: {', '.join(sorted(by_yaml))}")
    kwargs = {by_yaml[k]: coerce(f"{where}.{k}", v, hints[by_yaml[k]]) for k, v in raw.items()}
    return cls(**kwargs)


def short_key(name: str, limit: int = 60) -> str:
    """A (possibly user-typed, possibly huge) key name or path, cut for a message."""
    return name if len(name) <= limit else name[: limit - 3] + "..."


def check_values(cfg: RunConfig, data_files: bool = True) -> None:
    """The checks of a built `RunConfig` that span fields and sections: ranges, the data
    sources (and, with `data_files`, that their files exist), trackers, name and locations."""
    t, d, c, m = cfg.train, cfg.data, cfg.checkpoint, cfg.mesh
    positive = {"train.lr": t.lr, "train.eps": t.eps, "train.steps": t.steps,
                "train.batch_size": t.batch_size, "train.ctx_len": t.ctx_len,
                "train.grad_accum": t.grad_accum, "train.eval_batches": t.eval_batches,
                "train.log_every": t.log_every, "checkpoint.keep": c.keep}
    for key, v in positive.items():
        too_small = v < 1 if isinstance(v, int) else v <= 0
        if too_small:
            fail(key, f"must be {'>= 1' if isinstance(v, int) else '> 0'}, got {v}")
    non_negative = {"train.min_lr": t.min_lr, "train.warmup_steps": t.warmup_steps,
                    "train.weight_decay": t.weight_decay, "train.grad_clip": t.grad_clip,
                    "train.eval_every": t.eval_every, "train.seed": t.seed,
                    "train.max_consecutive_skips": t.max_consecutive_skips,
                    "train.loss_chunk": t.loss_chunk,
                    "checkpoint.every": c.every}
    for key, v in non_negative.items():
        if v < 0:
            fail(key, f"must be >= 0, got {v}")
    if t.lr > MAX_LR:
        # AdamW moves every weight by about lr per step: beyond ~3e38 one update leaves float32
        # (1e39 is inf there) and the parameters turn non-finite past the step's guard, which
        # checks the loss and gradient; up to MAX_LR a too-large rate diverges the ordinary
        # way: non-finite losses, skipped steps, exit 3 (tests/train/test_nonfinite_guard.py)
        fail("train.lr", f"{t.lr:g} is beyond {MAX_LR:g}: one AdamW update would move the "
                         "weights out of float32's range; use a learning rate below 1 (6e-4 is "
                         "RWKV-LM's)")
    if t.warmup_steps > t.steps:
        fail("train.warmup_steps", f"{t.warmup_steps} is larger than train.steps={t.steps}; "
                                   "lower train.warmup_steps or raise train.steps")
    if t.profile_steps is not None:
        start, stop = t.profile_steps
        if not 0 <= start < stop <= t.steps:
            fail("train.profile_steps", f"[{start}, {stop}] must satisfy 0 <= start < stop <= "
                                        f"train.steps={t.steps}, e.g. [10, 13]")
    _check_trackers(cfg.logging.trackers)
    if t.min_lr > t.lr:
        fail("train.min_lr", f"{t.min_lr} is larger than train.lr={t.lr}; lower train.min_lr too")
    for i, beta in enumerate(t.betas):
        if not 0.0 <= beta < 1.0:
            fail(f"train.betas[{i}]", f"must be in [0, 1), got {beta}")
    if t.batch_size % t.grad_accum:
        fail("train.batch_size", f"{t.batch_size} is not divisible by train.grad_accum="
                                 f"{t.grad_accum}")
    if not 0.0 <= d.val_fraction < 1.0:
        fail("data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    _check_data_sources(d, data_files)
    sizes = dataclasses.asdict(m)
    for axis, size in sizes.items():
        if size != -1 and size < 1:
            fail(f"mesh.{axis}", f"must be >= 1 or -1 (= the remaining devices), got {size}")
    if list(sizes.values()).count(-1) > 1:
        fail("mesh", "at most one axis may be -1")
    if not cfg.name or "/" in cfg.name:
        fail("name", f"must be a non-empty name without '/', got {short(cfg.name)}")
    _check_locations(cfg)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _check_locations(cfg: RunConfig) -> None:
    """run_dir is written with local file calls: no URL. checkpoint.dir goes to orbax, which
    writes local paths and gs:// (etils epath + gcsfs) here; any other scheme is refused."""
    if cfg.run_dir is not None and _URL.match(cfg.run_dir):
        fail("run_dir", f"{short_key(cfg.run_dir)!r} is a URL, but lwm-jax train writes the run "
                        "dir with local file calls; keep run_dir local and set "
                        "checkpoint.dir=gs://...")
    ckpt = cfg.checkpoint.dir
    if ckpt is not None and _URL.match(ckpt) and not ckpt.startswith("gs://"):
        fail("checkpoint.dir", f"{short_key(ckpt)!r}: only gs:// URLs are supported (unsupported "
                               f"URL scheme {ckpt.split('://')[0][:20]!r}); use a local path "
                               "or gs://BUCKET/PATH")


def _check_data_sources(d: DataSection, files: bool = True) -> None:
    from lwm_jax.data.text_sources import missing_binidx, source_kind
    if d.sources and d.path is not None:
        fail("data.sources", "set data.path or data.sources, not both (data.path=null)")
    if d.weights and len(d.weights) != len(d.sources):
        fail("data.weights", f"{len(d.weights)} weights for {len(d.sources)} data.sources; give "
                             "one per source, or none for equal weights")
    for i, w in enumerate(d.weights):
        if w <= 0:
            fail(f"data.weights[{i}]", f"must be > 0, got {w}")
    named = [("data.path", d.path)] if d.path is not None else []
    named += [(f"data.sources[{i}]", spec) for i, spec in enumerate(d.sources)]
    named += [("data.val_path", d.val_path)] if d.val_path is not None else []
    for key, spec in named if files else ():
        kind = source_kind(spec) if key != "data.val_path" else "binidx"
        if kind == "text" and not os.path.exists(spec):
            fail(key, f"{short_key(spec, 240)} not found; give a directory or a .jsonl, .parquet "
                      "or .txt file")
        if kind == "binidx":
            for ext in (".bin", ".idx"):
                if not os.path.isfile(binidx_prefix(spec) + ext):
                    fail(key, missing_binidx(key, binidx_prefix(spec) + ext, d.tokenizer))
    if d.val_path is not None and d.path is None and not d.sources:
        fail("data.val_path", "needs data.path too (the embedded corpus has its own split)")


def _check_trackers(names: tuple[str, ...]) -> None:
    known = ("jsonl", "tensorboard", "wandb")        # lwm_jax.train.trackers.TRACKERS
    for i, name in enumerate(names):
        if name not in known:
            fail(f"logging.trackers[{i}]", f"{short(name)} is not one of {', '.join(known)}")
        if name in names[:i]:
            fail(f"logging.trackers[{i}]", f"{name} is listed twice; list each tracker once")


def mesh_shape(mesh: MeshSection, n_devices: int) -> dict[str, int]:
    """Resolve -1 in the mesh section against the device count; one-line error on a mismatch."""
    sizes = dataclasses.asdict(mesh)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if -1 in sizes.values():
        if n_devices % fixed:
            fail("mesh", f"the fixed axis sizes {sizes} (product {fixed}) do not divide the "
                         f"{n_devices} available devices")
        sizes = {k: (n_devices // fixed if v == -1 else v) for k, v in sizes.items()}
    elif fixed != n_devices:
        fail("mesh", f"data*fsdp*tensor*sequence = {fixed} but {n_devices} devices are "
                     "available; set one axis to -1 to fill")
    return sizes


def check_against_mesh(cfg: RunConfig, sizes: dict[str, int]) -> None:
    """Batch/sequence divisibility by the mesh (needs the device count, so not in build_config)."""
    t = cfg.train
    dp = sizes["data"] * sizes["fsdp"]
    micro = t.batch_size // t.grad_accum
    if micro % dp:
        fail("train.batch_size", f"{t.batch_size} sequences ({micro} per micro-batch with "
                                 f"train.grad_accum={t.grad_accum}) is not divisible by "
                                 f"mesh data*fsdp = {dp} devices")
    if t.ctx_len % sizes["sequence"]:
        fail("train.ctx_len", f"{t.ctx_len} is not divisible by mesh.sequence="
                              f"{sizes['sequence']}")
