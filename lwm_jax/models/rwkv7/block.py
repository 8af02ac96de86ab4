"""RWKV-7 block = LayerNorm ln1 -> TimeMix, LayerNorm ln2 -> ChannelMix, both residual.

`Block` holds the parameters of ALL layers stacked along a leading `layers` axis; `block_forward`
is the pure per-layer function (one layer's parameter slice in, new residual stream and layer
state out) that the model's Python loop and its `lax.scan` both call.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lwm_jax.hardware import platform_of
from lwm_jax.layers.norms import LayerNorm
from lwm_jax.probe import scoped
from lwm_jax.models.rwkv7.channel_mix import ChannelMix, channel_mix_forward
from lwm_jax.models.rwkv7.time_mix import TimeMix, time_mix_forward
from lwm_jax.ops.layer_norm import layer_norm


class LayerState(NamedTuple):
    """Recurrent state of one layer (or, stacked, of all layers with a leading L axis).

    tmix_shift: `[B, C]` float32, last token's ln1 output.
    cmix_shift: `[B, C]` float32, last token's ln2 output.
    wkv: `[B, H, N, N]` float32 WKV state, indexed [key, value].
    """

    tmix_shift: jax.Array
    cmix_shift: jax.Array
    wkv: jax.Array


class Block(nnx.Module):
    """Parameters of all L blocks: `ln1`, `ln2` (LayerNorm `[L, C]`), `att` (TimeMix), `ffn`
    (ChannelMix). See `TimeMix` / `ChannelMix` for the shapes and logical axes."""

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs):
        stack = (cfg.n_layer,)
        self.ln1 = LayerNorm(cfg.n_embd, param_dtype=policy.param_dtype, stack=stack)
        self.ln2 = LayerNorm(cfg.n_embd, param_dtype=policy.param_dtype, stack=stack)
        self.att = TimeMix(cfg, policy, rngs=rngs)
        self.ffn = ChannelMix(cfg, policy, rngs=rngs)


def block_forward(p: dict, x_BTC, v_first_BTC, state: LayerState, *, first: bool, cfg, policy,
                  runtime, segment_ids_BT=None, probe=None, wkv_op=None, platform=None,
                  mesh=None):
    """One layer: `x += TimeMix(ln1(x)); x += ChannelMix(ln2(x))`.

    Args:
      p: one layer's parameters `{"ln1", "ln2", "att", "ffn"}` (plain dict of arrays).
      x_BTC: `[B, T, C]` residual stream in `policy.compute_dtype`.
      v_first_BTC: `[B, T, C]` layer 0's value (None when `first` is True).
      state: this layer's `LayerState` (float32).
      first: True for layer 0 only (a Python bool: it changes the traced program), or a
        traced bool scalar inside a layer scan (`time_mix_forward`).
      cfg, policy, runtime: `ModelConfig`, `Policy`, `Runtime` (WKV implementation and chunk).
      probe: optional `probe(name, x)` tap: `att/...` and `ffn/...` inside the mixers, and the
        residual stream after each (`x_att`, `x_out`).
      wkv_op: the WKV7 function TimeMix calls (None: `lwm_jax.ops.wkv7.wkv7`).
      platform: "cpu" | "gpu" | "tpu", the platform the program is compiled for (the model's
        mesh's, `lwm_jax.hardware.platform_of`; None: JAX's default devices'): it decides
        which kernels "auto" picks.
      mesh: the device mesh the activations are split over (None: one device); the fused
        LayerNorm, GroupNorm and ChannelMix kernels run per device on it when the runtime
        asks for them ("pallas").
    Returns:
      `(x_BTC, v_first_BTC, new_state)`; x and v_first in compute dtype, state float32.
    """
    cd = policy.compute_dtype
    platform = platform or platform_of()

    def norm(x, ln):
        """LayerNorm `ln` in compute dtype, as the kernels where `runtime.norm_impl` says."""
        return layer_norm(x, ln["weight"], ln["bias"], out_dtype=cd, impl=runtime.norm_impl,
                          platform=platform, mesh=mesh)

    with jax.named_scope("block_norm"):
        xn = norm(x_BTC, p["ln1"])
    att, v_first_BTC, wkv = time_mix_forward(
        p["att"], xn, state.tmix_shift, state.wkv, v_first_BTC, first=first, policy=policy,
        head_size=cfg.head_size, wkv_impl=runtime.wkv_impl, chunk_size=runtime.chunk_size or None,
        segment_ids_BT=segment_ids_BT, probe=scoped(probe, "att"), wkv_op=wkv_op,
        ln_x_impl=runtime.ln_x_impl, platform=platform, mesh=mesh)
    x_BTC = x_BTC + att
    if probe is not None:
        probe("x_att", x_BTC)
    with jax.named_scope("block_norm"):
        xn2 = norm(x_BTC, p["ln2"])
    x_BTC = x_BTC + channel_mix_forward(p["ffn"], xn2, state.cmix_shift, policy=policy,
                                        segment_ids_BT=segment_ids_BT,
                                        probe=scoped(probe, "ffn"), ffn_impl=runtime.ffn_impl,
                                        mesh=mesh, platform=platform)
    if probe is not None:
        probe("x_out", x_BTC)
    new_state = LayerState(xn[:, -1].astype(jnp.float32), xn2[:, -1].astype(jnp.float32), wkv)
    return x_BTC, v_first_BTC, new_state

