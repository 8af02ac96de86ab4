"""RWKV-7 ChannelMix (the feed-forward mixer), parameters stacked over layers.

`out = relu(k @ W_key)² @ W_value` with `k = x + (shift(x) - x) * mu_k`, hidden size
`ffn_mult * C` (4C in RWKV-7). Everything in `policy.compute_dtype`; matmuls via `policy.einsum`,
or, on one GPU under bf16 (`Runtime.ffn_impl`), `layers.squared_relu_mlp` with the square and its
gradient inside the GEMMs.

fp16 (`fp16-mixed`): the square overflows float16 (max 65504) once a pre-activation passes 256,
which trained RWKV-7 models reach. Under a float16 compute dtype the squared activations are
therefore formed from a power-of-two-scaled copy, `(relu(k W) / s)²` with `s = 2^n` chosen from
the tensor's peak so that every entry stays <= 128² (scaling by a power of two is exact), and
`s²` is multiplied back after the value matmul, in float32. The result equals the unscaled
formula wherever that one is finite; bf16 and fp32 (no overflow below 3e38) are untouched.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.hardware import platform_of
from lwm_jax.models.rwkv7 import init
from lwm_jax.layers.shift import token_shift
from lwm_jax.layers.squared_relu_mlp import squared_relu_mlp_fused
from lwm_jax.ops.relu2_matmul import kernel_applies
from lwm_jax.precision import MATMUL_OUTPUT_NAME, param_mul
from lwm_jax.runtime import kernel_chosen


class ChannelMix(nnx.Module):
    """ChannelMix parameters of all L layers (dtype `policy.param_dtype`).

    Attributes (logical axes in brackets):
      x_k: `[L, C]` token-shift mix, init `1 - (n / C) ** (ratio1 ** 4)` (layers, embed).
      key: `[L, C, F]` (layers, embed, mlp), orthogonal gain 1.
      value: `[L, F, C]` (layers, mlp, embed), init 0.
    """

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs):
        L, C, F = cfg.n_layer, cfg.n_embd, cfg.ffn_dim
        pd = policy.param_dtype
        vec = init.stacked_vectors(init.channel_mix_vectors, L, C)
        self.x_k = nnx.Param(jnp.asarray(vec["x_k"], pd), logical_axes=("layers", "embed"))
        self.key = nnx.Param(init.orthogonal(rngs.params(), (L, C, F), init.GAINS["ffn_key"], pd),
                             logical_axes=("layers", "embed", "mlp"))
        self.value = nnx.Param(jnp.zeros((L, F, C), pd), logical_axes=("layers", "mlp", "embed"))


@jax.named_scope("channel_mix")
def channel_mix_forward(p: dict, x_BTC, shift_BC, *, policy, segment_ids_BT=None, probe=None,
                        ffn_impl: str = "xla", one_device: bool = True,
                        platform: str | None = None):
    """One layer's ChannelMix.

    Args:
      p: this layer's parameters (`x_k [C]`, `key [C, F]`, `value [F, C]`).
      x_BTC: `[B, T, C]` LayerNorm'd input (cast to `policy.compute_dtype`).
      shift_BC: `[B, C]` previous token's `x` (zeros for a fresh sequence).
      segment_ids_BT: optional int `[B, T]`; the shift sees zeros where a document starts.
      probe: optional `probe(name, x)` tap; sees the squared-ReLU hidden layer and the output.
      ffn_impl: `Runtime.ffn_impl`: "xla" (`Policy.einsum` + `squared_relu`), "pallas" /
        "interpret" (`layers.squared_relu_mlp`: the square inside the key GEMM, its gradient
        inside the value weight's input-gradient GEMM) or "auto" ("pallas" on one GPU under a
        bf16 compute dtype when the shapes tile, no probe; else "xla").
      one_device: False on a device mesh (the kernels have no sharding rule).
      platform: the platform the program is compiled for (None: JAX's default devices').
    Returns:
      `[B, T, C]` in `policy.compute_dtype`.
    """
    cd = policy.compute_dtype
    x = x_BTC.astype(cd)
    xx = token_shift(x, shift_BC, segment_ids_BT) - x
    k = x + param_mul(xx, p["x_k"])       # x_k's gradient summed in float32
    if _use_kernel(ffn_impl, one_device, platform or platform_of(), policy, probe, k.shape,
                   p["key"].shape):
        B, T, C = k.shape
        out = squared_relu_mlp_fused(k.reshape(B * T, C), p["key"], p["value"], jnp.dtype(cd),
                                     policy.lax_precision, ffn_impl == "interpret")
        return checkpoint_name(out.astype(cd).reshape(B, T, C), MATMUL_OUTPUT_NAME)
    pre = policy.einsum("btc,cf->btf", k, p["key"])
    if jnp.dtype(cd) == jnp.float16:
        hidden, out = _squared_relu_fp16(policy, jax.nn.relu(pre), p["value"])
    else:
        hidden = squared_relu(pre)
        out = policy.einsum("btf,fc->btc", hidden, p["value"])
    if probe is not None:
        probe("hidden", hidden)
        probe("out", out)
    return out


def _use_kernel(impl, one_device, platform, policy, probe, shape_BTC, shape_CF) -> bool:
    """Whether ChannelMix runs `squared_relu_mlp_fused` (see `channel_mix_forward`)."""
    B, T, C = shape_BTC
    F = shape_CF[-1]
    return kernel_chosen(
        "ffn_impl", impl, one_device=one_device, on_gpu=platform == "gpu",
        fits=(jnp.dtype(policy.compute_dtype) == jnp.bfloat16 and probe is None
              and kernel_applies(B * T, C, F)),
        kernel="the Pallas ChannelMix GEMMs",
        needs=f"a bf16 compute dtype, no probe and tokens x channels x hidden {B * T} x {C} x "
              f"{F} in multiples of the kernel tiles (ops.relu2_matmul.kernel_applies)")


FP16_HIDDEN_PEAK = 128.0   # scaled activations stay <= 128, so their squares <= 16384 < 65504


def _squared_relu_fp16(policy, act_BTF, value_FC):
    """`(relu², relu² @ W_value)` under float16 without overflow (see the module docstring).

    Returns the scaled hidden layer (what the value matmul sees, float16) and the output in the
    compute dtype. `s` is a constant for autodiff (the product is exactly independent of it).
    """
    act32 = act_BTF.astype(jnp.float32)
    peak = jax.lax.stop_gradient(jnp.max(act32))
    scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(peak, FP16_HIDDEN_PEAK) / FP16_HIDDEN_PEAK)))
    hidden = jnp.square(act32 / scale).astype(act_BTF.dtype)
    out = policy.einsum("btf,fc->btc", hidden, value_FC, out_dtype=jnp.float32) * (scale * scale)
    return hidden, out.astype(policy.compute_dtype)


@jax.custom_vjp
def squared_relu(x):
    """`relu(x)²` in x's dtype, keeping only its own output for the backward.

    The gradient `2 relu(x) dy` takes `relu(x)` as the square root of the output, which the
    value matmul keeps anyway (its backward needs it): no `[B, T, F]` array is saved for this
    function alone (the 0.1B step kept 12 of them, 200 MB each). `sqrt(round(relu(x)²))` is
    `relu(x)` to half the output's rounding (bf16: within 2^-10 relative), and the product
    is formed in float32 and rounded once to dy's dtype, so the gradient is within one
    rounding of autodiff's (tests/models/rwkv7/test_squared_relu.py, against float64).
    """
    return jnp.square(jax.nn.relu(x))


def _squared_relu_fwd(x):
    out = jnp.square(jax.nn.relu(x))
    return out, out


def _squared_relu_bwd(out, dy):
    f32 = jnp.float32
    return ((dy.astype(f32) * (2 * jnp.sqrt(out.astype(f32)))).astype(dy.dtype),)


squared_relu.defvjp(_squared_relu_fwd, _squared_relu_bwd)
