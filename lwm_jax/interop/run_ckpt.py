"""Reading the parameters out of a training run directory (`lwm_jax.train`).

A run directory holds `config.yaml` (the resolved `RunConfig`, with its `model:` section) and
step directories `<checkpoint dir>/<step>/state` written by `lwm_jax.train.checkpoint` (orbax,
the whole `TrainState`). Only the `params` subtree is restored (orbax partial restore), as
float32 NumPy, so the Adam moments are never loaded. The checkpoint directory is
`checkpoint.dir` from the config when that exists, else `<run dir>/checkpoints`.

The step read is the newest complete one. When its metadata files are damaged
(`orbax_files.step_damage`, the same test `lwm-jax train` applies before it resumes) or orbax
cannot restore it, the error is one line naming the step directory and the previous complete
step, which is read once the damaged directory is removed or restored: a reader never falls
back to an older step on its own, since that would silently give other weights than the
newest. (`lwm-jax train` does resume from the newest intact step, with a warning:
`lwm_jax.train.checkpoint`.)
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import numpy as np

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import params
from lwm_jax.interop.native import model_config_from
from lwm_jax.interop.orbax_files import restore_detail, step_damage, utf8_path
from lwm_jax.user_input import load_yaml_file, quote_path

CONFIG = "config.yaml"


def _run_config(run_dir: Path) -> dict | None:
    """The run's config mapping, or None when there is no `config.yaml` with a `model:`
    mapping. Raises ValueError (one line naming the file) for bad or refused YAML."""
    file = run_dir / CONFIG
    if not file.is_file():
        if os.path.lexists(file) and not file.is_dir():
            raise ValueError(f"{quote_path(file)}: not a regular file (a FIFO, device or "
                             "socket); give a training run directory whose config.yaml is a file")
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
    """Steps with a finished `state` item (orbax's temporary directories are not numbers, and
    only ASCII digit names count: `²` is a digit to `str.isdigit` but not to `int`)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    def done(step_dir: Path) -> bool:
        state = step_dir / "state"
        return (state / "commit_success.txt").exists() or (state / "_METADATA").exists()
    return sorted(int(p.name) for p in root.iterdir()
                  if re.fullmatch(r"[0-9]+", p.name) and done(p))


def is_run_dir(path: str | os.PathLike) -> bool:
    return _run_config(Path(path)) is not None and bool(complete_steps(path))


def read_run_params(path: str | os.PathLike, step: int | None = None) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, params tree)` of `step` (default: the newest complete one) of a run.

    Raises ValueError (one line) for a missing or damaged `config.yaml`, no complete step, a
    step whose metadata is damaged or that orbax cannot restore (naming the step directory and
    the previous complete step: see the module docstring) and NaN/inf parameters.
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
    step_dir = (checkpoint_dir(run_dir) / str(step)).absolute()
    state_dir = step_dir / "state"
    problem = step_damage(step_dir)
    if problem is not None:
        raise ValueError(f"checkpoint {quote_path(step_dir)}: {problem}; the step is damaged: "
                         f"{_damaged_fix(run_dir, steps, step)}")
    with utf8_path(state_dir, "checkpoint") as view:
        try:
            out = ocp.PyTreeCheckpointer().restore(
                view, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                  partial_restore=True))
            tree = jax.tree.map(lambda x: np.asarray(x, np.float32), out["params"])
        except Exception as err:     # orbax/tensorstore raise many types for a damaged directory
            raise ValueError(f"checkpoint {quote_path(step_dir)}: orbax cannot restore it "
                             f"({restore_detail(err)}); if the step is damaged, "
                             f"{_damaged_fix(run_dir, steps, step)}") from None
    params.check_tree(cfg, tree, f"checkpoint {str(state_dir)!r}")
    params.check_finite(tree, f"checkpoint {quote_path(state_dir)}")
    return cfg, tree


def _damaged_fix(run_dir: Path, steps: list[int], step: int) -> str:
    """What to do about damaged step `step` of a run whose complete steps are `steps`."""
    older = [s for s in steps if s < step]
    if not older:
        return ("restore that directory from a copy, or train again (it is the run's only "
                "checkpoint)")
    previous = checkpoint_dir(run_dir) / str(older[-1])
    return (f"remove or restore that directory (the previous complete checkpoint, step "
            f"{older[-1]} in {quote_path(previous)}, is read once it is gone)")
