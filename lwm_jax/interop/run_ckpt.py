"""Reading the parameters out of a training run directory (`lwm_jax.train`).

A run directory holds `config.yaml` (the resolved `RunConfig`, with its `model:` section) and
step directories `<checkpoint dir>/<step>/state` written by `lwm_jax.train.checkpoint` (orbax,
the whole `TrainState`). Only the `params` subtree is restored (orbax partial restore), as
float32 NumPy, so the Adam moments are never loaded. The checkpoint directory is
`checkpoint.dir` from the config when that exists, else `<run dir>/checkpoints`.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import params
from lwm_jax.interop.native import model_config_from, restore_failed
from lwm_jax.user_input import load_yaml_file, quote_path

CONFIG = "config.yaml"


def _run_config(run_dir: Path) -> dict | None:
    """The run's config mapping, or None when there is no `config.yaml` with a `model:`
    mapping. Raises ValueError (one line naming the file) for bad or refused YAML."""
    file = run_dir / CONFIG
    if not file.is_file():
        return None
    doc = load_yaml_file(file)
    return doc if isinstance(doc, dict) and isinstance(doc.get("model"), dict) else None


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    """Where the run's step directories live (see module docstring)."""
    run_dir = Path(run_dir)
    doc = _run_config(run_dir) or {}
    section = doc.get("checkpoint")
    configured = section.get("dir") if isinstance(section, dict) else None
    if isinstance(configured, str) and configured and Path(configured).is_dir():
        return Path(configured)
    return run_dir / "checkpoints"


def complete_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps with a finished `state` item (orbax's temporary directories are not numbers)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    def done(step_dir: Path) -> bool:
        state = step_dir / "state"
        return (state / "commit_success.txt").exists() or (state / "_METADATA").exists()
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and done(p))


def is_run_dir(path: str | os.PathLike) -> bool:
    return _run_config(Path(path)) is not None and bool(complete_steps(path))


def read_run_params(path: str | os.PathLike, step: int | None = None) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params tree)` of `step` (default: the newest complete one) of a run.

    Raises ValueError (one line) for a missing or damaged `config.yaml`, no complete step, an
    orbax checkpoint that cannot be restored (`native.restore_failed`) and NaN/inf parameters.
    """
    import orbax.checkpoint as ocp
    run_dir = Path(path)
    doc = _run_config(run_dir)
    if doc is None:
        raise ValueError(f"checkpoint {str(run_dir)!r}: no config.yaml with a model: section "
                         "(not a training run directory)")
    cfg = model_config_from(doc, run_dir / CONFIG).resolved()
    steps = complete_steps(run_dir)
    if not steps:
        raise ValueError(f"checkpoint {str(run_dir)!r}: no complete checkpoint under "
                         f"{checkpoint_dir(run_dir)}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"step: {step} is not among the run's checkpoints {steps}")
    shapes = params.param_shapes(cfg)
    target = {"params": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), shapes)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32),
                                target)
    state_dir = (checkpoint_dir(run_dir) / str(step) / "state").absolute()
    try:
        out = ocp.PyTreeCheckpointer().restore(
            state_dir, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                   partial_restore=True))
        tree = jax.tree.map(lambda x: np.asarray(x, np.float32), out["params"])
    except Exception as err:     # orbax/tensorstore raise many types for a damaged directory
        raise restore_failed(state_dir, err) from None
    params.check_tree(cfg, tree, f"checkpoint {str(state_dir)!r}")
    params.check_finite(tree, f"checkpoint {quote_path(state_dir)}")
    return cfg, tree
