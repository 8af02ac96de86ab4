"""Family-neutral NNX building blocks.

Modules:
  * `norms`: LayerNorm and per-head GroupNorm parameter holders (their math is
    `lwm_jax.ops.layer_norm` / `lwm_jax.ops.group_norm`);
  * `rms_norm`: RMSNorm with float32 statistics;
  * `shift`: the token shift, fed by the carried state at t = 0;
  * `rope`: rotary position embedding whose angles stay accurate at long positions;
  * `attention`: grouped-query attention (XLA / cuDNN, splash on TPU) and its KV cache;
  * `attention_tpu`: the TPU path of `attention`, JAX's Pallas splash-attention kernel;
  * `embedding`: the token embedding lookup, its gradient reduced by gathering tokens;
  * `layout`: the activations' layout on a device mesh (`pin_activation`).

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
