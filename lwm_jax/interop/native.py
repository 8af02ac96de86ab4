"""Our own checkpoint directory: `config.yaml` + an orbax checkpoint of the params tree.

Layout of `<dir>`:
  config.yaml   `format: lwm_jax-params/1`, `model:` (the `ModelConfig` fields), `source:`
  params/       orbax `StandardCheckpointer` save of the params tree (float32, stacked blocks)

This is what `lwm-jax convert` writes and what `load_pretrained(dir)` reads back. Training runs
(`lwm_jax.train.checkpoint`) keep full train states in their own step directories; their params
subtree is read by `api.load_pretrained` through `read_run_params`.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import yaml

from lwm_jax.config import ModelConfig
from lwm_jax.interop import params

FORMAT = "lwm_jax-params/1"
CONFIG = "config.yaml"
PARAMS = "params"


def is_native(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and (p / PARAMS).is_dir()


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` stored in `<path>/config.yaml`."""
    file = Path(path) / CONFIG
    doc = yaml.safe_load(file.read_text())
    if not isinstance(doc, dict) or "model" not in doc:
        raise ValueError(f"{file}: expected a mapping with a 'model:' section")
    return ModelConfig.from_dict(doc["model"], where=f"{file}: model")


def save_native(cfg: ModelConfig, tree: dict, out_dir: str | os.PathLike, source: str = "") -> Path:
    """Write `config.yaml` and `params/` under `out_dir` (which must not hold a checkpoint yet)."""
    import orbax.checkpoint as ocp
    params.check_tree(cfg, tree, "convert")
    root = Path(out_dir).absolute()
    if (root / PARAMS).exists():
        raise ValueError(f"output_dir: {str(root)!r} already holds a params/ checkpoint; "
                         "choose an empty directory")
    root.mkdir(parents=True, exist_ok=True)
    values = jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(root / PARAMS, values)
    checkpointer.wait_until_finished()
    doc = {"format": FORMAT, "model": cfg.to_dict(), "source": str(source)}
    (root / CONFIG).write_text(yaml.safe_dump(doc, sort_keys=False))
    return root


def restore_params(ckpt_dir: str | os.PathLike, cfg: ModelConfig) -> dict:
    """Restore a params tree saved by orbax at `ckpt_dir`, shaped for `cfg` (float32 NumPy)."""
    import orbax.checkpoint as ocp
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32),
                          params.param_shapes(cfg))
    tree = ocp.StandardCheckpointer().restore(Path(ckpt_dir).absolute(), target)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def load_native(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Read a directory written by `save_native` -> `(cfg, params tree)`."""
    cfg = read_config(path)
    return cfg, restore_params(Path(path) / PARAMS, cfg)
