"""Test helpers for RWKV-7: give every parameter a random, non-degenerate value.

At the official init `W_o = 0` and `ffn.value = 0`, so every block is the identity and tests of
state carry, scan-vs-loop or import/export would pass vacuously. `randomize_params` adds noise of
a sensible scale to every parameter (in place) so each path of the model matters.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# [..., in, out] matrices: noise ~ N(0, 1/in); vectors: noise ~ N(0, 0.1²); emb: N(0, 1).
MATRIX_NAMES = frozenset({"receptance", "key", "value", "output", "head",
                          "w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"})


def randomize_params(model: nnx.Module, seed: int = 0, scale: float = 1.0) -> nnx.Module:
    """Add deterministic Gaussian noise to every `nnx.Param` of `model` (in place; returns it).

    Matrices named in `MATRIX_NAMES` with shape `[..., in, out]` get `scale·N(0, 1/in)`, `emb`
    gets `scale·N(0, 1)`, everything else (mixes, norms, w0, r_k, ...) `0.1·scale·N(0, 1)`.
    Noise is drawn in float64 NumPy from `seed` and added in the parameter's dtype.
    """
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)

    def noisy(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        if name in MATRIX_NAMES and x.ndim >= 2:
            std = scale / np.sqrt(x.shape[-2])
        elif name == "emb":
            std = scale
        else:
            std = 0.1 * scale
        noise = rng.standard_normal(x.shape) * std
        return (jnp.asarray(x, jnp.float32) + jnp.asarray(noise, jnp.float32)).astype(x.dtype)

    new = jax.tree_util.tree_map_with_path(noisy, pure)
    nnx.replace_by_pure_dict(state, new)
    nnx.update(model, state)
    return model


def param_dict(model: nnx.Module) -> dict:
    """The model's parameters as a nested dict of arrays (the documented tree)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))
