"""Warming an initialised model before a precision report.

An initialisation is not a trained model: RWKV-7 zero-initialises its attention output, the
FFN value projection and the LoRA down projections, and starts every norm weight at a constant;
LLaMA keeps its Gaussian matrices but starts every RMSNorm weight at the constant 1. A zero
projection's product is exactly 0 in every precision, so a report on a fresh model shows those
ops as exact (and everything downstream of them as unperturbed) where a trained model loses the
policy's precision there (likewise a norm weight of exactly 1 multiplies without rounding).
`warm_params` (for any model class with a precision-report family: `RWKV7`, `Llama`) replaces
such degenerate values with random ones of a trained-like scale and leaves every other
parameter as initialised:

* which parameters, and the noise's standard deviation: the model family's `warm_std`
  (`lwm_jax.diagnostics.subops.Family`): a projection `[..., in, out]` whose rows are constant
  gets `N(0, 1/in)`, a constant vector (norm weight or bias, ...) `N(0, 0.1^2)` around its
  value, RWKV-7's near-zero embedding `N(0, 1)`;
* the noise: float64 NumPy from `seed`, drawn parameter by parameter in the sorted order of
  their paths, added in float64 and stored in the parameter's dtype, so one seed gives one
  model on every machine.

This is no substitute for a checkpoint (`lwm-jax precision-report --checkpoint RUN_DIR`): the
values are random, not learned; it only removes the zeros and constants that make an op look
exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.diagnostics.precision_report import family_of


def _path_name(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def warm_params(model: nnx.Module, seed: int) -> tuple[str, ...]:
    """Give `model`'s degenerate parameters random values of a trained-like scale, in place.

    Args:
      model: an `RWKV7` or `Llama` (a class with a precision-report family).
      seed: int in [0, 2**63): the noise's seed.
    Returns:
      the `/`-joined paths of the parameters changed (e.g. `blocks/ffn/value`), sorted.
    """
    family = family_of(model)
    rng = np.random.default_rng([seed, 0x5741524D])      # a stream apart from the batch's
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    leaves = sorted(jax.tree_util.tree_flatten_with_path(pure)[0],
                    key=lambda kv: _path_name(kv[0]))
    new, warmed = {}, []
    for path, value in leaves:
        x64 = np.asarray(value, np.float64)
        std = family.warm_std(_path_name(path), x64)
        if std is None:
            continue
        noisy = x64 + std * rng.standard_normal(x64.shape)
        new[_path_name(path)] = jnp.asarray(noisy.astype(np.dtype(value.dtype)))
        warmed.append("/".join(_path_name(path)))
    if warmed:
        pure = jax.tree_util.tree_map_with_path(
            lambda p, v: new.get(_path_name(p), v), pure)
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(model, state)
    return tuple(warmed)
