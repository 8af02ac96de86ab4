"""RWKV-7 stacks with attention layers at chosen depths (`arch: rwkv7-hybrid`)."""
from lwm_jax.models.hybrid.config import HybridConfig
from lwm_jax.models.hybrid.model import RWKVHybrid, head_fn, probe_model_fn

__all__ = ["HybridConfig", "RWKVHybrid", "head_fn", "probe_model_fn"]
