"""Old import path of the RWKV-7 model config, kept for users' code: the config now lives in
`lwm_jax.models.rwkv7.config` (also `lwm_jax.ModelConfig`), the runtime knobs in
`lwm_jax.runtime`."""
from lwm_jax.models.rwkv7.config import ModelConfig, default_lora_rank  # noqa: F401
from lwm_jax.runtime import WKV_IMPLS, Runtime  # noqa: F401

__all__ = ["ModelConfig", "Runtime", "WKV_IMPLS", "default_lora_rank"]
