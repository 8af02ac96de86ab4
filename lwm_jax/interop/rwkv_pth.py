"""Official RWKV-LM checkpoint layout (`.pth`, one flat dict of per-layer tensors) <-> our tree.

Reading accepts the `_forward_module.` prefix (DeepSpeed/Lightning), files with or without
`blocks.0.att.v0/v1/v2` (layer 0 never uses them; missing ones are filled with the init `v0` and
zero matrices), and reads every size from the tensor shapes: V and C from `emb.weight [V, C]`,
heads and head size from `att.r_k [H, N]`, the low-rank sizes from `att.{w,a,v,g}1 [C, D]`, the
ChannelMix width from `ffn.key.weight [F, C]`, L from the highest block index.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

import numpy as np

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import layout, params
from lwm_jax.models.rwkv7.init import time_mix_vectors

PREFIX = "_forward_module."


def strip_prefix(sd: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop a `_forward_module.` prefix from every key that has one."""
    return {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in sd.items()}


def _need(sd: Mapping[str, np.ndarray], name: str, where: str) -> np.ndarray:
    if name not in sd:
        raise ValueError(f"{where}: tensor {name!r} is missing; is this an RWKV-7 (x070) checkpoint?")
    return sd[name]


def _shape(sd: Mapping[str, np.ndarray], name: str, where: str, ndim: int = 2) -> tuple[int, ...]:
    """The shape of tensor `name`, which must exist and have `ndim` dimensions (sizes are read
    from shapes, so a wrong rank must not reach an unpacking or an index)."""
    _need(sd, name, where)
    shape = tuple(int(d) for d in np.shape(sd[name]))
    if len(shape) != ndim:
        raise ValueError(f"{where}: tensor {name!r} has shape {shape}, expected {ndim} "
                         "dimensions; re-save the checkpoint")
    return shape


def config_from_official(sd: Mapping[str, np.ndarray], where: str = "checkpoint") -> ModelConfig:
    """`ModelConfig` from the shapes of an official state dict (prefix already stripped)."""
    V, C = _shape(sd, "emb.weight", where)
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not layers:
        raise ValueError(f"{where}: no 'blocks.N.' tensors; is this an RWKV checkpoint?")
    L = max(layers) + 1
    if layers != set(range(L)):
        raise ValueError(f"{where}: block indices {sorted(layers)} are not 0..{L - 1}")
    if "blocks.0.att.w0" not in sd or "blocks.0.att.r_k" not in sd:
        raise ValueError(f"{where}: blocks.0.att.w0 / r_k missing: not an RWKV-7 (x070) "
                         "checkpoint (RWKV-4/5/6 files are not supported)")
    H, N = _shape(sd, "blocks.0.att.r_k", where)
    if H * N != C:
        raise ValueError(f"{where}: blocks.0.att.r_k has shape [{H}, {N}] but n_embd is {C}")
    F = _shape(sd, "blocks.0.ffn.key.weight", where)[0]
    if F % C:
        raise ValueError(f"{where}: ffn.key.weight has {F} rows, not a multiple of n_embd={C}")
    v1 = next((_shape(sd, f"blocks.{i}.att.v1", where) for i in (1, 0)
               if f"blocks.{i}.att.v1" in sd), None)
    cfg = ModelConfig(
        vocab_size=int(V), n_layer=L, n_embd=int(C), head_size=int(N),
        decay_lora=int(_shape(sd, "blocks.0.att.w1", where)[1]),
        a_lora=int(_shape(sd, "blocks.0.att.a1", where)[1]),
        v_lora=int(v1[1]) if v1 is not None else None,   # one layer: the rule
        gate_lora=int(_shape(sd, "blocks.0.att.g1", where)[1]),
        ffn_mult=int(F // C))
    return cfg.resolved()


def layer0_value_fill(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Stand-ins for layer 0's unused `v0 [C], v1 [C, D], v2 [D, C]` keyed by our path
    (init `v0`, zero matrices)."""
    C, D = cfg.n_embd, cfg.v_lora
    v0 = time_mix_vectors(0, cfg.n_layer, C, cfg.head_size)["v0"].astype(np.float32)
    return {layout.ATT + "v0": v0, layout.ATT + "v1": np.zeros((C, D), np.float32),
            layout.ATT + "v2": np.zeros((D, C), np.float32)}


def read_official(state: Mapping[str, np.ndarray],
                  where: str = "checkpoint") -> tuple[ModelConfig, dict]:
    """Official state dict (NumPy arrays) -> `(cfg, params tree)` with float32 leaves.

    Every tensor must be consumed: unknown names are an error (they would be silently dropped
    weights, e.g. a DeepEmbed variant this model does not implement).
    """
    sd = strip_prefix(state)
    cfg = config_from_official(sd, where)
    return cfg, gather_params(sd, cfg, layout.OFFICIAL_TOP, layout.OFFICIAL_BLOCK, "blocks.{i}.",
                              layout.LAYER0_OPTIONAL, where)


def gather_params(sd: Mapping[str, np.ndarray], cfg: ModelConfig, top, block, block_prefix: str,
                  layer0_optional, where: str) -> dict:
    """External state dict -> our params tree (float32), for any layout table in `layout`.

    `top` / `block`: `(our path, external name or suffix, kind)` rows; block tensors are named
    `block_prefix.format(i=layer) + suffix` and stacked over layers. Layer 0's value-residual
    tensors listed in `layer0_optional` may be absent (filled with `layer0_value_fill`). Every
    tensor must be consumed: an unknown name is an error, never a silently dropped weight.
    Raises ValueError (one line naming the tensor) for a missing, unexpected, misshapen,
    complex or non-finite (NaN/inf) tensor.
    """
    shapes = params.flatten(params.param_shapes(cfg))
    used: set[str] = set()
    flat: dict[str, np.ndarray] = {}

    def take(name: str, expected: tuple[int, ...], kind: str) -> np.ndarray:
        used.add(name)
        value = np.asarray(_need(sd, name, where))
        if value.dtype.kind == "c":
            raise ValueError(f"{where}: tensor {name!r} is complex ({value.dtype}); RWKV weights "
                             "are real and the imaginary part would be lost")
        value = value.astype(np.float32)
        params.check_finite_array(value, name, where)
        return layout.from_external(value, kind, expected, name)

    for path, name, kind in top:
        flat[path] = take(name, shapes[path].shape, kind)
    fill = layer0_value_fill(cfg)
    for path, suffix, kind in block:
        per_layer = []
        for i in range(cfg.n_layer):
            name = block_prefix.format(i=i) + suffix
            if i == 0 and name not in sd and suffix in layer0_optional:
                per_layer.append(fill[path])
            else:
                per_layer.append(take(name, shapes[path].shape[1:], kind))
        flat[path] = np.stack(per_layer)
    unknown = sorted(set(sd) - used)
    if unknown:
        raise ValueError(f"{where}: unexpected tensor {unknown[0]!r} ({len(unknown)} not "
                         "understood); this RWKV-7 variant is not supported")
    return params.unflatten(flat)


def scatter_params(cfg: ModelConfig, tree: dict, top, block, block_prefix: str,
                   layer0_absent=()) -> dict[str, np.ndarray]:
    """Inverse of `gather_params`: our params tree -> external state dict (float32 NumPy).

    Block suffixes listed in `layer0_absent` are not written for layer 0.
    """
    params.check_tree(cfg, tree, "export")
    flat = params.flatten(tree)
    out: dict[str, np.ndarray] = {}
    for path, name, kind in top:
        out[name] = layout.to_external(np.asarray(flat[path], np.float32), kind)
    for i in range(cfg.n_layer):
        for path, suffix, kind in block:
            if i == 0 and suffix in layer0_absent:
                continue
            out[block_prefix.format(i=i) + suffix] = layout.to_external(
                np.asarray(flat[path][i], np.float32), kind)
    return out


def write_official(cfg: ModelConfig, tree: dict) -> dict[str, np.ndarray]:
    """Our params tree -> official state dict (float32 NumPy, official shapes and names).

    Layer 0's `v0, v1, v2` are written too (current RWKV-LM files carry them).
    """
    return scatter_params(cfg, tree, layout.OFFICIAL_TOP, layout.OFFICIAL_BLOCK, "blocks.{i}.")


def load_pth(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Read an official `.pth` file (safe unpickling) -> `(cfg, params tree)`."""
    from lwm_jax.interop.torch_io import load_state_dict
    return read_official(load_state_dict(path), where=f"checkpoint {os.fspath(path)!r}")


def save_pth(cfg: ModelConfig, tree: dict, path: str | os.PathLike, dtype: str = "bf16") -> None:
    """Write our params tree as an official `.pth` (`dtype`: "bf16" as released, or "f32")."""
    from lwm_jax.interop.torch_io import save_state_dict
    save_state_dict(write_official(cfg, tree), path, dtype=dtype)
