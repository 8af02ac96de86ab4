"""Old import path of the RWKV-7 model config, kept for users' code: the config now lives in
`lwm_jax.models.rwkv7.config` (also `lwm_jax.ModelConfig`)."""
from lwm_jax.models.rwkv7.config import WKV_IMPLS, ModelConfig, default_lora_rank  # noqa: F401

__all__ = ["ModelConfig", "WKV_IMPLS", "default_lora_rank"]
