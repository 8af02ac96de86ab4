"""Model parameters as plain pytrees, plus the per-parameter metadata training needs.

Training keeps parameters as a nested dict of arrays (`nnx.to_pure_dict` of the model's
`nnx.Param` state): optax, orbax and `jax.jit` shardings all work on plain dicts. The model's
`GraphDef` rebuilds the module inside the jitted step (`nnx.merge(graphdef, params)`), and the
`logical_axes` metadata of every `nnx.Param` is read once, into a dict keyed by the parameter's
path string (`"blocks/att/w0"`), for sharding and optimizer groups.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

from lwm_jax.precision.fp8 import Fp8Meta


def path_str(keypath) -> str:
    """`(DictKey('blocks'), DictKey('w0'))` -> `"blocks/w0"`."""
    parts = []
    for k in keypath:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, dict, dict[str, tuple], dict | None]:
    """Split an (abstract or concrete) model into (graphdef, params pure dict, axes by path,
    FP8 metas pure dict or None).

    The model must hold only `nnx.Param` state and, under an FP8 policy, `Fp8Meta` state (the
    GEMMs' scaling state, trained by overwriting, checkpointed with the params); anything else
    is a one-line error rather than state silently dropped from checkpoints. `merge_model`
    rebuilds the module from the same pieces.
    """
    graphdef, params_state, metas, rest = nnx.split(model, nnx.Param, Fp8Meta, ...)
    if jax.tree.leaves(rest):
        raise ValueError(f"model: holds non-Param state {list(nnx.to_flat_state(rest))[:3]}...; "
                         "the trainer only trains and checkpoints nnx.Param (and Fp8Meta)")
    fp8 = nnx.to_pure_dict(metas) if jax.tree.leaves(metas) else None
    axes: dict[str, tuple] = {}
    for path, var in nnx.to_flat_state(params_state):
        name = "/".join(str(p) for p in path)
        logical = var.get_metadata().get("logical_axes")
        ndim = len(var.get_value().shape)
        if logical is None:
            logical = (None,) * ndim
        if len(logical) != ndim:
            raise ValueError(f"model parameter {name}: logical_axes {logical} has {len(logical)} "
                             f"names for a {ndim}-D array")
        axes[name] = tuple(logical)
    return graphdef, nnx.to_pure_dict(params_state), axes, fp8


def merge_model(graphdef: nnx.GraphDef, params: dict, fp8: dict | None) -> nnx.Module:
    """The module of `split_model`'s graphdef with these params (and FP8 metas, if any)."""
    if fp8 is None:
        return nnx.merge(graphdef, params, {}, {})
    return nnx.merge(graphdef, params, fp8, {})


def model_variables(params: dict, fp8: dict | None) -> dict:
    """One nested dict of every variable of the model: `params` with the FP8 metas (same
    nesting, `fp8_*` leaves) merged in; `params` itself when there are none. What
    `nnx.merge(nnx.split(model)[0], ...)` takes for a model that holds both."""
    if fp8 is None:
        return params

    def merge(a, b):
        out = dict(a)
        for key, value in b.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and key in out \
                else value
        return out
    return merge(params, fp8)


def map_with_names(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """`jax.tree.map` where `fn` also receives each leaf's path string."""
    return jax.tree_util.tree_map_with_path(lambda kp, x: fn(path_str(kp), x), tree)


def count_params(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
