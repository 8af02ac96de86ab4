"""Language model families: `rwkv7` (`RWKV7`, `RWKV7State`, `ModelConfig`), `llama`
(`Llama`, `LlamaConfig`) and `hybrid` (`RWKVHybrid`, `HybridConfig`: RWKV-7 with attention
layers at chosen depths, `arch: rwkv7-hybrid`); `registry` maps a run config's `arch` name to a
family.

Loaded on first use, so that a family's `config` module imports without jax or flax.
"""
from lwm_jax._lazy import lazy_getattr

_SOURCES = {"RWKV7": "lwm_jax.models.rwkv7.model", "RWKV7State": "lwm_jax.models.rwkv7.model",
            "Llama": "lwm_jax.models.llama.model", "RWKVHybrid": "lwm_jax.models.hybrid.model"}
__all__ = list(_SOURCES)
__getattr__ = lazy_getattr(__name__, _SOURCES)
