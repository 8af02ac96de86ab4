"""Random but well-conditioned RWKV-7 parameter trees, built in NumPy (no JAX init, no compile).

For tests and examples that need "a real-looking checkpoint" quickly: the vector parameters
start from the RWKV-LM init formulas (`lwm_jax.models.rwkv7.init`) and get Gaussian noise, and every
matrix (including the ones the official init sets to zero: W_o, ffn.value, the first LoRA
matrices) is Gaussian with std `scale / sqrt(fan_in)`, so every path of the model contributes.
"""
from __future__ import annotations

import numpy as np

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.interop import params
from lwm_jax.models.rwkv7.init import channel_mix_vectors, stacked_vectors, time_mix_vectors

_ATT_VECTORS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a", "r_k")


def random_params(cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> dict:
    """A params tree for `cfg` (float32 NumPy) with init-like vectors plus noise (see module)."""
    cfg = cfg.resolved()
    rng = np.random.default_rng(seed)
    L, C, N = cfg.n_layer, cfg.n_embd, cfg.head_size
    shapes = params.flatten(params.param_shapes(cfg))
    tm = stacked_vectors(time_mix_vectors, L, C, N)
    cm = stacked_vectors(channel_mix_vectors, L, C)
    base = {f"blocks/att/{k}": tm[k] for k in _ATT_VECTORS}
    base["blocks/att/ln_x/weight"] = tm["ln_x_weight"]
    base["blocks/ffn/x_k"] = cm["x_k"]
    flat = {}
    for path, sds in shapes.items():
        shape = tuple(sds.shape)
        if path == "emb":
            value = rng.standard_normal(shape)
        elif len(shape) >= 2 and path.split("/")[-1] not in ("r_k",) and not (
                path.startswith("blocks/") and len(shape) == 2):
            value = rng.standard_normal(shape) * scale / np.sqrt(shape[-2])
        else:
            start = base.get(path, np.ones(shape) if path.endswith("weight") else np.zeros(shape))
            value = start + 0.1 * scale * rng.standard_normal(shape)
        flat[path] = value.astype(np.float32)
    return params.unflatten(flat)
