"""lwm_jax: long-context language models (RWKV-7 first) in JAX / Flax NNX."""
from lwm_jax.config import ModelConfig
from lwm_jax.precision import PRESETS, Policy, parse_policy

__version__ = "0.1.0"
__all__ = ["ModelConfig", "Policy", "PRESETS", "parse_policy", "__version__"]
