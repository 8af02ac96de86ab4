"""Our own checkpoint directory: `config.yaml` + an orbax checkpoint of the params tree.

Layout of `<dir>`:
  config.yaml   `format: lwm_jax-params/1`, `arch:` (only when not rwkv7), `model:` (the
                config fields of that family: `ModelConfig`, `LlamaConfig`), `source:`
  params/       orbax `StandardCheckpointer` save of the params tree (float32, stacked blocks)

This is what `lwm-jax convert` writes and what `load_pretrained(dir)` reads back. Training runs
(`lwm_jax.train.checkpoint`) keep full train states in their own step directories; their params
subtree is read by `api.load_pretrained` through `read_run_params`.

Before orbax restores `params/`, its metadata files are checked (`orbax_files.pytree_damage`),
so a truncated or overwritten one is a one-line error naming it. A directory whose path is not
valid UTF-8 is written and read through a UTF-8 alias (`orbax_files.utf8_path`): tensorstore
takes no other path.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import yaml

from lwm_jax.models.rwkv7.config import ModelConfig, upgrade_saved_model
from lwm_jax.interop import params
from lwm_jax.interop.orbax_files import pytree_damage, restore_detail, utf8_path
from lwm_jax.models.registry import DEFAULT_ARCH, arch_of_config, get_arch
from lwm_jax.user_input import check_output_dir, load_yaml_file, quote_path

FORMAT = "lwm_jax-params/1"
CONFIG = "config.yaml"
PARAMS = "params"


def is_native(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and (p / PARAMS).is_dir()


def model_config_from(doc: dict, file: Path) -> ModelConfig:
    """The model config (of the family named by the file's `arch:` key, default rwkv7) from
    the `model:` mapping of a loaded YAML file; ValueError (one line naming `file`) for a
    missing section, an unknown family or key, or an invalid value."""
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise ValueError(f"{file}: expected a mapping with a 'model:' section of model sizes; "
                         "restore the file or re-create the checkpoint")
    try:
        config_cls = get_arch(doc.get("arch", DEFAULT_ARCH)).config_cls
        return config_cls.from_dict(upgrade_saved_model(doc["model"]), where=f"{file}: model")
    except (ValueError, TypeError) as err:
        text = str(err)
        raise ValueError(text if text.startswith(str(file)) else f"{file}: {text}") from None


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` stored in `<path>/config.yaml`; ValueError (one line naming the file)
    for bad or refused YAML (`lwm_jax.user_input.load_yaml`) or an invalid model section."""
    file = Path(path) / CONFIG
    return model_config_from(load_yaml_file(file), file)


def restore_failed(ckpt_dir: str | os.PathLike, err: Exception) -> ValueError:
    """The one-line error for an orbax restore of our `params/` at `ckpt_dir` that raised
    `err`."""
    return ValueError(f"checkpoint {quote_path(ckpt_dir)}: cannot restore the orbax checkpoint "
                      f"({restore_detail(err)}); it is damaged or incomplete: re-create it "
                      "(lwm-jax convert) or use another checkpoint")


def save_native(cfg: ModelConfig, tree: dict, out_dir: str | os.PathLike, source: str = "") -> Path:
    """Write `config.yaml` and `params/` under `out_dir` (which must not hold a checkpoint yet).

    Raises ValueError (one line) when `out_dir` is unusable (`check_target`) or the tree does
    not fit `cfg`.
    """
    import orbax.checkpoint as ocp
    params.check_tree(cfg, tree, "convert")
    root = check_target(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    values = jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    checkpointer = ocp.StandardCheckpointer()
    with utf8_path(root, "output_dir") as view:
        checkpointer.save(view / PARAMS, values)
        checkpointer.wait_until_finished()
    arch = arch_of_config(cfg).name
    doc = {"format": FORMAT, **({} if arch == DEFAULT_ARCH else {"arch": arch}),
           "model": cfg.to_dict(), "source": str(source)}
    (root / CONFIG).write_text(yaml.safe_dump(doc, sort_keys=False))
    return root


def check_target(out_dir: str | os.PathLike) -> Path:
    """The absolute output directory for `save_native`; ValueError (one line) when it is a
    file, cannot be written or already holds a params/ checkpoint. Creates nothing."""
    root = check_output_dir(Path(out_dir).absolute(), "output_dir")
    if (root / PARAMS).exists():
        raise ValueError(f"output_dir: {str(root)!r} already holds a params/ checkpoint; "
                         "choose an empty directory")
    return root


def restore_params(ckpt_dir: str | os.PathLike, cfg: ModelConfig) -> dict:
    """Restore a params tree saved by orbax at `ckpt_dir`, shaped for `cfg` (float32 NumPy).

    Raises ValueError (one line naming the directory) for a damaged metadata file
    (`pytree_damage`), when orbax cannot read it (`restore_failed`), and when a parameter holds
    NaN/inf.
    """
    import orbax.checkpoint as ocp
    problem = pytree_damage(ckpt_dir)
    if problem is not None:
        raise ValueError(f"checkpoint {quote_path(ckpt_dir)}: cannot restore the orbax "
                         f"checkpoint ({problem}); it is damaged or incomplete: re-create it "
                         "(lwm-jax convert) or restore it from a copy")
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32),
                          params.param_shapes(cfg))
    with utf8_path(Path(ckpt_dir).absolute(), "checkpoint") as view:
        try:
            tree = ocp.StandardCheckpointer().restore(view, target)
        except Exception as err:     # orbax/tensorstore raise many types for a damaged directory
            raise restore_failed(ckpt_dir, err) from None
    tree = jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    params.check_finite(tree, f"checkpoint {quote_path(ckpt_dir)}")
    return tree


def load_native(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Read a directory written by `save_native` -> `(cfg, params tree)`.

    Raises ValueError (one line naming the directory and `config.yaml`) when the stored params
    do not have the shapes `config.yaml`'s model section gives."""
    cfg = read_config(path)
    tree = restore_params(Path(path) / PARAMS, cfg)
    try:
        params.check_tree(cfg, tree, f"checkpoint {quote_path(path)}")
    except ValueError as err:
        raise ValueError(f"{err}; {CONFIG}'s model: section does not match the params/ stored "
                         f"next to it: restore {quote_path(Path(path) / CONFIG)} or re-create the "
                         "checkpoint (lwm-jax convert)") from None
    return cfg, tree
