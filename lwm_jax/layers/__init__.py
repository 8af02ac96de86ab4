"""Family-neutral NNX building blocks: the norms' parameter holders (LayerNorm, GroupNorm:
their math is `lwm_jax.ops.layer_norm` / `lwm_jax.ops.group_norm`; RMSNorm), the token shift,
rotary position embedding (`rope`) and grouped-query attention with its KV cache
(`attention`).

Model-specific blocks live with their family (`lwm_jax.models.rwkv7`: TimeMix, ChannelMix, the
block and its init; `lwm_jax.models.llama`: its block). Parameter holders are modules
(`LayerNorm`, `GroupNorm`, `RMSNorm`); the math is in pure functions (`rms_norm`,
`token_shift`, `apply_rope`, `self_attention`, ...) and, for the ops with kernels, in
`lwm_jax.ops`.
"""
from lwm_jax.layers.norms import GroupNorm, LayerNorm
from lwm_jax.layers.rms_norm import RMSNorm, rms_norm
from lwm_jax.layers.shift import token_shift

__all__ = ["GroupNorm", "LayerNorm", "RMSNorm", "rms_norm", "token_shift"]
