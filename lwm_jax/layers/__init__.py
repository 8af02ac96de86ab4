"""NNX building blocks of RWKV-7: fp32-statistics norms, TimeMix, ChannelMix, the block, init.

Parameter holders are modules (`TimeMix`, `ChannelMix`, `Block`, `LayerNorm`, `GroupNorm`); the
math is in pure per-layer functions (`time_mix_forward`, `channel_mix_forward`, `block_forward`,
`layer_norm`, `group_norm`). Function names never shadow the submodules of this package.
"""
from lwm_jax.layers.block import Block, LayerState, block_forward
from lwm_jax.layers.channel_mix import ChannelMix, channel_mix_forward
from lwm_jax.layers.norms import GroupNorm, LayerNorm, group_norm, layer_norm
from lwm_jax.layers.shift import token_shift
from lwm_jax.layers.time_mix import TimeMix, decay_log, normalize_heads, time_mix_forward

__all__ = ["Block", "ChannelMix", "GroupNorm", "LayerNorm", "LayerState", "TimeMix",
           "block_forward", "channel_mix_forward", "decay_log", "group_norm", "layer_norm",
           "normalize_heads", "time_mix_forward", "token_shift"]
