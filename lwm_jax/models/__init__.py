"""Language models: RWKV-7 (`RWKV7`, `RWKV7State`)."""
from lwm_jax.models.rwkv7 import RWKV7, RWKV7State

__all__ = ["RWKV7", "RWKV7State"]
