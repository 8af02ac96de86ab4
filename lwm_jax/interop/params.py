"""Moving parameter trees in and out of a model of any family (`RWKV7`, `Llama`: the family
comes from the config's type, `lwm_jax.models.registry.arch_of_config`).

A "params tree" here is the plain nested dict `nnx.state(model, nnx.Param).to_pure_dict()`:
string keys, NumPy/JAX array leaves (float32), block leaves stacked with a leading `[L]` axis.
Building a model from a tree never runs the random initialiser (the skeleton comes from
`nnx.eval_shape`), so loading a large checkpoint costs only the copy.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.precision import Policy, parse_policy


def _model_cls(cfg):
    from lwm_jax.models.registry import arch_of_config
    return arch_of_config(cfg).model_cls


def abstract_model(cfg: ModelConfig, policy: Policy | str = "fp32", runtime=None):
    """A model of `cfg`'s family (`RWKV7` for a `ModelConfig`, `Llama` for a `LlamaConfig`)
    whose arrays are `jax.ShapeDtypeStruct`s (no memory, no init compute); `runtime`: a
    `lwm_jax.runtime.Runtime` or None (defaults)."""
    pol = parse_policy(policy)
    cls = _model_cls(cfg)
    return nnx.eval_shape(lambda: cls(cfg, pol, runtime=runtime, rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=8)
def _shapes(cfg: ModelConfig) -> tuple:
    flat = flatten(nnx.state(abstract_model(cfg), nnx.Param).to_pure_dict())
    return tuple((k, jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in flat.items())


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Our params tree with `ShapeDtypeStruct` leaves, for `cfg` (cached per config)."""
    return unflatten(dict(_shapes(cfg)))


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": x}}` -> `{"a/b": x}`."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "/"))
        else:
            out[path] = value
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    """Inverse of `flatten`."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, last = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def check_tree(cfg: ModelConfig, tree: dict, where: str) -> None:
    """Raise ValueError (one line) unless `tree` has exactly the leaves and shapes `cfg` needs."""
    want = flatten(param_shapes(cfg))
    have = flatten(tree)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        raise ValueError(f"{where}: parameter {missing[0]} is missing ({len(missing)} missing)")
    if extra:
        raise ValueError(f"{where}: unexpected parameter {extra[0]} ({len(extra)} unexpected)")
    for path, sds in want.items():
        if tuple(np.shape(have[path])) != tuple(sds.shape):
            raise ValueError(f"{where}: parameter {path} has shape {tuple(np.shape(have[path]))}, "
                             f"expected {tuple(sds.shape)}")


def check_finite_array(arr, name: str, where: str) -> None:
    """Raise ValueError (one line naming `where` and tensor `name`) when the floating-point
    array `arr` holds a NaN or an infinity; other dtypes pass."""
    arr = np.asarray(arr)
    if arr.dtype.kind != "f" or bool(np.isfinite(arr).all()):
        return
    n_nan = int(np.isnan(arr).sum())
    n_inf = int(np.isinf(arr).sum())
    raise ValueError(f"{where}: tensor {name!r} holds {n_nan} NaN and {n_inf} inf values (of "
                     f"{arr.size}); the checkpoint is corrupt or from a diverged run: use "
                     "another one")


def check_finite(tree: dict, where: str) -> None:
    """`check_finite_array` for every leaf of a params tree (named by its "/" path)."""
    for path, value in flatten(tree).items():
        check_finite_array(value, path, where)


def model_from_params(cfg: ModelConfig, tree: dict, policy: Policy | str = "fp32",
                      runtime=None):
    """Build a model of `cfg`'s family holding `tree` (checked against `cfg`; cast to the
    policy's param dtype),
    run with `runtime` (a `lwm_jax.runtime.Runtime`; None = defaults)."""
    pol = parse_policy(policy)
    check_tree(cfg, tree, "params")
    model = abstract_model(cfg, pol, runtime)
    state = nnx.state(model, nnx.Param)
    values = jax.tree.map(lambda x: jnp.asarray(x, dtype=pol.param_dtype), tree)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(model, state)
    return model


def params_from_model(model) -> dict:
    """The model's parameters as a nested dict of float32 NumPy arrays."""
    tree = nnx.state(model, nnx.Param).to_pure_dict()
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x), dtype=np.float32), tree)
