"""Family-neutral NNX building blocks: fp32-statistics norms and the token shift.

Model-specific blocks live with their family (`lwm_jax.models.rwkv7`: TimeMix, ChannelMix, the
block and its init). Parameter holders are modules (`LayerNorm`, `GroupNorm`); the math is in
pure functions (`layer_norm`, `group_norm`, `token_shift`).
"""
from lwm_jax.layers.norms import GroupNorm, LayerNorm, group_norm, layer_norm
from lwm_jax.layers.shift import token_shift

__all__ = ["GroupNorm", "LayerNorm", "group_norm", "layer_norm", "token_shift"]
