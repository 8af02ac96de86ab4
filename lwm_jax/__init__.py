"""lwm_jax: long-context language models (RWKV-7 first) in JAX / Flax NNX.

Light imports only here; the model, ops and interop load on first use:

    from lwm_jax import ModelConfig, parse_policy, load_pretrained
    from lwm_jax.models.rwkv7 import RWKV7
    from lwm_jax.ops import wkv7
"""
from lwm_jax.config import ModelConfig
from lwm_jax.precision import PRESETS, Policy, parse_policy

__version__ = "0.1.0"
__all__ = ["ModelConfig", "Policy", "PRESETS", "parse_policy", "load_pretrained", "__version__"]


def load_pretrained(path, format=None, policy="fp32", **runtime):
    """Load an official `.pth`, FLA/HF directory or lwm_jax checkpoint: `(model, config)`.

    See `lwm_jax.interop.load_pretrained` for the formats and arguments.
    """
    from lwm_jax.interop import load_pretrained as _load
    return _load(path, format=format, policy=policy, **runtime)
