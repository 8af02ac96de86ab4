"""lwm_jax: long-context language models (RWKV-7 first) in JAX / Flax NNX.

Light imports only here; the model, ops and interop load on first use:

    from lwm_jax import ModelConfig, parse_policy, load_pretrained
    from lwm_jax.models.rwkv7 import RWKV7
    from lwm_jax.ops.wkv7 import wkv7
"""
from lwm_jax._lazy import lazy_getattr

__version__ = "0.1.0"
# Loaded on first use (PEP 562), so `import lwm_jax.cli` (argument parsing, --help) never
# imports jax.
__getattr__ = lazy_getattr(__name__, {
    "ModelConfig": "lwm_jax.models.rwkv7.config", "Policy": "lwm_jax.precision",
    "PRESETS": "lwm_jax.precision", "parse_policy": "lwm_jax.precision"})
__all__ = ["ModelConfig", "Policy", "PRESETS", "parse_policy", "load_pretrained", "__version__"]


def load_pretrained(path, format=None, policy="fp32", **runtime):
    """Load an official `.pth`, FLA/HF directory or lwm_jax checkpoint: `(model, config)`.

    See `lwm_jax.interop.load_pretrained` for the formats and arguments.
    """
    from lwm_jax.interop import load_pretrained as _load
    return _load(path, format=format, policy=policy, **runtime)
