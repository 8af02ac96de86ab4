"""Family-neutral NNX building blocks: fp32-statistics norms (LayerNorm, GroupNorm, RMSNorm),
the token shift, rotary position embedding (`rope`) and grouped-query attention with its KV
cache (`attention`).

Model-specific blocks live with their family (`lwm_jax.models.rwkv7`: TimeMix, ChannelMix, the
block and its init; `lwm_jax.models.llama`: its block). Parameter holders are modules
(`LayerNorm`, `GroupNorm`, `RMSNorm`); the math is in pure functions (`layer_norm`,
`group_norm`, `rms_norm`, `token_shift`, `apply_rope`, `self_attention`, ...).
"""
from lwm_jax.layers.norms import GroupNorm, LayerNorm, group_norm, layer_norm
from lwm_jax.layers.rms_norm import RMSNorm, rms_norm
from lwm_jax.layers.shift import token_shift

__all__ = ["GroupNorm", "LayerNorm", "RMSNorm", "group_norm", "layer_norm", "rms_norm",
           "token_shift"]
