"""lwm_jax: long-context language models (RWKV-7 first) in JAX / Flax NNX.

Light imports only here; the model, ops and interop load on first use:

    from lwm_jax import ModelConfig, parse_policy, load_pretrained
    from lwm_jax.models.rwkv7 import RWKV7
    from lwm_jax.ops import wkv7
"""
import importlib

__version__ = "0.1.0"
# Loaded on first use (PEP 562), so `import lwm_jax.cli` (argument parsing, --help) never
# imports jax.
_LAZY = {"ModelConfig": "lwm_jax.config", "Policy": "lwm_jax.precision",
         "PRESETS": "lwm_jax.precision", "parse_policy": "lwm_jax.precision"}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lwm_jax' has no attribute {name!r}")
__all__ = ["ModelConfig", "Policy", "PRESETS", "parse_policy", "load_pretrained", "__version__"]


def load_pretrained(path, format=None, policy="fp32", **runtime):
    """Load an official `.pth`, FLA/HF directory or lwm_jax checkpoint: `(model, config)`.

    See `lwm_jax.interop.load_pretrained` for the formats and arguments.
    """
    from lwm_jax.interop import load_pretrained as _load
    return _load(path, format=format, policy=policy, **runtime)
