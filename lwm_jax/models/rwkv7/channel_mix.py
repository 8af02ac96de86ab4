"""RWKV-7 ChannelMix (the feed-forward mixer), parameters stacked over layers.

`out = relu(k @ W_key)² @ W_value` with `k = x + (shift(x) - x) * mu_k`, hidden size
`ffn_mult * C` (4C in RWKV-7). Everything in `policy.compute_dtype`. The MLP is the op
`lwm_jax.ops.squared_relu_mlp`: `Policy.einsum` products (its float16 form scales the squares
so they cannot overflow) or, on one GPU under bf16 (`Runtime.ffn_impl`), Pallas GEMMs with the
square and its gradient inside.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lwm_jax.layers.shift import token_shift
from lwm_jax.models.rwkv7 import init
from lwm_jax.ops.squared_relu_mlp import squared_relu_mlp
from lwm_jax.precision import param_mul
from lwm_jax.precision.fp8 import Fp8Meta, init_meta


class ChannelMix(nnx.Module):
    """ChannelMix parameters of all L layers (dtype `policy.param_dtype`).

    Attributes (logical axes in brackets):
      x_k: `[L, C]` token-shift mix, init `1 - (n / C) ** (ratio1 ** 4)` (layers, embed).
      key: `[L, C, F]` (layers, embed, mlp), orthogonal gain 1.
      value: `[L, F, C]` (layers, mlp, embed), init 0.
      fp8_key, fp8_value: under an FP8 policy only, `Fp8Meta` `[L, 3, 1 + history]`, the
        delayed-scaling state of the two GEMMs (`lwm_jax.precision.fp8`; not parameters).
    """

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs):
        L, C, F = cfg.n_layer, cfg.n_embd, cfg.ffn_dim
        pd = policy.param_dtype
        vec = init.stacked_vectors(init.channel_mix_vectors, L, C)
        self.x_k = nnx.Param(jnp.asarray(vec["x_k"], pd), logical_axes=("layers", "embed"))
        self.key = nnx.Param(init.orthogonal(rngs.params(), (L, C, F), init.GAINS["ffn_key"], pd),
                             logical_axes=("layers", "embed", "mlp"))
        self.value = nnx.Param(jnp.zeros((L, F, C), pd), logical_axes=("layers", "mlp", "embed"))
        if policy.fp8:
            for name in ("key", "value"):
                setattr(self, f"fp8_{name}", Fp8Meta(init_meta(stack=(L,)),
                                                     logical_axes=("layers", None, None)))


@jax.named_scope("channel_mix")
def channel_mix_forward(p: dict, x_BTC, shift_BC, *, policy, segment_ids_BT=None, probe=None,
                        ffn_impl: str = "xla", mesh=None, platform: str | None = None):
    """One layer's ChannelMix.

    Args:
      p: this layer's parameters (`x_k [C]`, `key [C, F]`, `value [F, C]`).
      x_BTC: `[B, T, C]` LayerNorm'd input (cast to `policy.compute_dtype`).
      shift_BC: `[B, C]` previous token's `x` (zeros for a fresh sequence).
      segment_ids_BT: optional int `[B, T]`; the shift sees zeros where a document starts.
      probe: optional `probe(name, x)` tap; sees the squared-ReLU hidden layer and the output.
      ffn_impl: `Runtime.ffn_impl`, the `impl` of `lwm_jax.ops.squared_relu_mlp`: "xla"
        (`Policy.einsum` + `squared_relu`), "pallas" / "interpret" (the square inside the key
        GEMM, its gradient inside the value weight's input-gradient GEMM) or "auto" ("pallas"
        on one GPU under a bf16 compute dtype when the shapes tile, no probe; else "xla").
      mesh: the device mesh the activations are split over (None: one device); "pallas" runs
        the kernels per device on it.
      platform: the platform the program is compiled for (None: JAX's default devices').
    Returns:
      `[B, T, C]` in `policy.compute_dtype`.
    """
    cd = policy.compute_dtype
    x = x_BTC.astype(cd)
    xx = token_shift(x, shift_BC, segment_ids_BT) - x
    k = x + param_mul(xx, p["x_k"])       # x_k's gradient summed in float32
    fp8 = (p["fp8_key"], p["fp8_value"]) if "fp8_key" in p else None
    return squared_relu_mlp(k, p["key"], p["value"], policy=policy, impl=ffn_impl,
                            platform=platform, mesh=mesh, probe=probe, fp8_metas=fp8)
