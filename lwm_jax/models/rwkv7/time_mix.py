"""RWKV-7 TimeMix (the attention-like mixer), parameters stacked over layers.

`TimeMix` only holds parameters (leading axis L); the math is the pure function
`time_mix_forward`, which the blocks call on one layer's slice (a plain dict of arrays), so a
Python loop over layers and a `lax.scan` over the stacked arrays run exactly the same code.

Dtypes: activations, r/k/v/a/b and every projection run in `policy.compute_dtype` (all matmuls
through `policy.einsum`, explicit precision, fp32 accumulation). Parameters are cast to the
compute dtype before touching activations, so an fp32 parameter never promotes r/k/v/a/b (under
`fp16-mixed` they all reach `wkv7` as float16), with `precision=policy.wkv_precision` for the
WKV's in-chunk matmuls. fp32 islands: the decay path
(`d = w0 + tanh(x_w @ w1) @ w2`, `w = -exp(-0.5) * sigmoid(d)`), the `kk` L2 normalisation, the
WKV state and the `ln_x` GroupNorm statistics.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.hardware import platform_of
from lwm_jax.layers.norms import GroupNorm
from lwm_jax.layers.shift import token_shift_mixes
from lwm_jax.models.rwkv7 import init
from lwm_jax.ops.group_norm import group_norm
from lwm_jax.ops.wkv7 import wkv7
from lwm_jax.precision import param_add, param_mul
from lwm_jax.precision.fp8 import Fp8Meta, init_meta
from lwm_jax.remat_names import WKV7_OUTPUT_NAME

MIX_NAMES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
FP8_GEMMS = ("receptance", "key", "value", "output")    # FP8 under an FP8 policy
VECTOR_NAMES = MIX_NAMES + ("w0", "a0", "v0", "k_k", "k_a")
LORA_NAMES = (("w1", "w2", "decay_lora"), ("a1", "a2", "a_lora"), ("v1", "v2", "v_lora"),
              ("g1", "g2", "gate_lora"))
KK_EPS = 1e-12
DECAY_SCALE = math.exp(-0.5)   # w = -exp(-0.5) * sigmoid(d)


class TimeMix(nnx.Module):
    """TimeMix parameters of all L layers (`[L, ...]`, dtype `policy.param_dtype`).

    Attributes (logical axes in brackets):
      x_r, x_w, x_k, x_v, x_a, x_g: `[L, C]` token-shift mixes mu (layers, embed).
      w0, a0, v0, k_k, k_a: `[L, C]` (layers, embed).
      w1, a1, v1, g1: `[L, C, d]` LoRA down (layers, embed, lora); init 0.
      w2, a2, v2, g2: `[L, d, C]` LoRA up (layers, lora, embed); orthogonal gain 0.1.
      r_k: `[L, H, N]` (layers, heads, head_dim).
      receptance, key, value: `[L, C, C]` as `x @ W` (layers, embed, heads); orthogonal gains
        1, 0.1, 1. output: `[L, C, C]` (layers, heads, embed); init 0. Here "heads" names the
        flattened H·N feature axis.
      ln_x: GroupNorm with `weight`, `bias` `[L, C]`; weight init `((l + 1) / L) ** 0.7`.
      fp8_receptance, fp8_key, fp8_value, fp8_output: under an FP8 policy only, `Fp8Meta`
        `[L, 3, 1 + history]`, the delayed-scaling state of those four GEMMs
        (`lwm_jax.precision.fp8`; not parameters).
    Layer 0 never uses its v0/v1/v2 (it defines `v_first`), matching the official checkpoint.
    The LoRA products stay in the compute dtype under an FP8 policy (their rank-d GEMMs are too
    thin to gain from FP8 and the decay LoRA is an fp32 island).
    """

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs):
        cfg = cfg.resolved()
        L, C, N = cfg.n_layer, cfg.n_embd, cfg.head_size
        pd = policy.param_dtype
        vec = init.stacked_vectors(init.time_mix_vectors, L, C, N)
        for name in VECTOR_NAMES:
            setattr(self, name, nnx.Param(jnp.asarray(vec[name], pd),
                                          logical_axes=("layers", "embed")))
        for down, up, field in LORA_NAMES:
            d = getattr(cfg, field)
            setattr(self, down, nnx.Param(jnp.zeros((L, C, d), pd),
                                          logical_axes=("layers", "embed", "lora")))
            up_init = init.orthogonal(rngs.params(), (L, d, C), init.LORA_GAIN, pd)
            setattr(self, up, nnx.Param(up_init, logical_axes=("layers", "lora", "embed")))
        self.r_k = nnx.Param(jnp.asarray(vec["r_k"], pd),
                             logical_axes=("layers", "heads", "head_dim"))
        for name in ("receptance", "key", "value"):
            setattr(self, name, nnx.Param(init.orthogonal(rngs.params(), (L, C, C),
                                                          init.GAINS[name], pd),
                                          logical_axes=("layers", "embed", "heads")))
        self.output = nnx.Param(jnp.zeros((L, C, C), pd), logical_axes=("layers", "heads", "embed"))
        self.ln_x = GroupNorm(C, C // N, N * 1e-5, param_dtype=pd, stack=(L,),
                              weight_init=np.asarray(vec["ln_x_weight"]))
        if policy.fp8:
            for name in FP8_GEMMS:
                setattr(self, f"fp8_{name}", Fp8Meta(init_meta(stack=(L,)),
                                                     logical_axes=("layers", None, None)))


def decay_log(p: dict, x_w_BTC, policy):
    """fp32 island: log-decay `w = -exp(-0.5) * sigmoid(w0 + tanh(x_w @ w1) @ w2)`.

    Both LoRA matmuls take fp32 operands and multiply them to IEEE-float32 accuracy whatever the
    policy (`policy.einsum_f32(..., precision="highest")`; a TF32 product, the GPU's `default`,
    puts ~4e-4 relative error on a slow channel's `w`, which `exp(T w)` multiplies by T); under
    a bf16 compute dtype as bf16 tensor-core products of the operands' exact bf16 pieces
    (`lwm_jax.precision.bf16_split`), elsewhere as HIGHEST products; `w0` is upcast. The backward
    products are the policy's (`einsum_f32`). Returns `[B, T, C]` float32 in `(-0.6065, 0)`.
    """
    hidden = jnp.tanh(policy.einsum_f32("btc,cr->btr", x_w_BTC, p["w1"], precision="highest"))
    d = p["w0"].astype(jnp.float32) + policy.einsum_f32("btr,rc->btc", hidden, p["w2"],
                                                        precision="highest")
    return -DECAY_SCALE * jax.nn.sigmoid(d)


def normalize_heads(x_BTHN, scale_HN=None, eps: float = KK_EPS):
    """fp32 island: `u / max(||u||_2, eps)` over the head dim (last axis), `u = x * scale` formed
    in float32 (`scale`: x's trailing dims, e.g. `k_k` as `[H, N]`, or None = 1). Returns float32.

    Written as `u * rsqrt(max(sum u², eps²))` so the gradient stays finite at u = 0. The
    backward is written by hand: the forward keeps x in its own (often 16-bit) dtype and one
    float32 number per head, not the float32 u and u² that autodiff would keep.

    x_BTHN: any float dtype. Returns `[B, T, H, N]` float32.
    """
    if scale_HN is None:
        scale_HN = jnp.ones((), jnp.float32)
    return _normalize_heads(x_BTHN, scale_HN, float(eps))


def _normalize_heads_fwd(x, scale, eps):
    u = x.astype(jnp.float32) * scale.astype(jnp.float32)
    sumsq = jnp.sum(jnp.square(u), axis=-1, keepdims=True)
    clamped = sumsq <= eps * eps                 # the norm is eps there: a constant
    return u * jax.lax.rsqrt(jnp.maximum(sumsq, eps * eps)), (x, scale, sumsq, clamped)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _normalize_heads(x, scale, eps):
    return _normalize_heads_fwd(x, scale, eps)[0]


def _normalize_heads_bwd(eps, res, dy):
    x, scale, sumsq, clamped = res
    x32, s32 = x.astype(jnp.float32), scale.astype(jnp.float32)
    rnorm = jax.lax.rsqrt(jnp.maximum(sumsq, eps * eps))
    y = x32 * s32 * rnorm
    # d(u / |u|) = (dy - y <y, dy>) / |u|
    du = rnorm * (dy - jnp.where(clamped, 0.0, y * jnp.sum(y * dy, axis=-1, keepdims=True)))
    d_scale = jnp.sum(du * x32, axis=tuple(range(du.ndim - s32.ndim)))  # over the lead axes
    return (du * s32).astype(x.dtype), d_scale.astype(scale.dtype)


_normalize_heads.defvjp(_normalize_heads_fwd, _normalize_heads_bwd)


def _lora(policy, x_BTC, down, up):
    return policy.einsum("btr,rc->btc", policy.einsum("btc,cr->btr", x_BTC, down), up)


@jax.named_scope("time_mix")
def time_mix_forward(p: dict, x_BTC, shift_BC, wkv_BHNN, v_first_BTC, *, first: bool, policy,
                     head_size: int, wkv_impl: str = "auto", chunk_size: int | None = None,
                     segment_ids_BT=None, probe=None, wkv_op=None,
                     ln_x_impl: str = "xla", platform: str | None = None, mesh=None
                     ) -> tuple[Any, Any, Any]:
    """One layer's TimeMix.

    Args:
      p: this layer's parameters (plain dict, names as in `TimeMix`, no layer axis; `ln_x` a dict
        with `weight`, `bias`).
      x_BTC: `[B, T, C]` LayerNorm'd input (cast to `policy.compute_dtype`).
      shift_BC: `[B, C]` previous token's `x` (any float dtype; zeros for a fresh sequence).
      wkv_BHNN: `[B, H, N, N]` float32 WKV state, indexed [key, value].
      v_first_BTC: `[B, T, C]` layer 0's value (ignored, may be None, when `first` is True).
      first: True for layer 0 (defines `v_first = v`; no value residual), False for the others,
        or a traced bool scalar (a layer scan's body): both forms computed, one selected.
      segment_ids_BT: optional int `[B, T]` packed-document ids (token shift and state reset).
      probe: optional `probe(name, x)` tap (`lwm_jax.probe`); sees r, k, v, the
        log-decay w, a, g, the WKV inputs a_in/b_in, its output and state, ln_x and the output.
      wkv_op: the WKV7 function, called as `lwm_jax.ops.wkv7.wkv7` is (None: `wkv7`); e.g. the
        sequence-parallel op bound to a mesh (`RWKV7(..., mesh=)`).
      ln_x_impl: `Runtime.ln_x_impl`, the `impl` of `lwm_jax.ops.group_norm.group_norm`.
        "auto" takes the Pallas backward on one GPU when the shape fits it; "pallas" runs it
        per device on `mesh`.
      platform: the platform the program is compiled for ("cpu" | "gpu" | "tpu"; None: JAX's
        default devices'): picks the WKV kernel family and "auto"'s kernels.
      mesh: the device mesh the activations are split over (None: one device).
    Returns:
      `(out_BTC, v_first_BTC, new_wkv_BHNN)`: output in compute dtype, `v_first` in compute
      dtype, state float32.
    """
    cd, f32 = policy.compute_dtype, jnp.float32
    B, T, C = x_BTC.shape
    N = head_size
    platform = platform or platform_of()
    H = C // N
    x = x_BTC.astype(cd)
    # per-channel parameters meet 16-bit activations through token_shift_mixes / param_mul /
    # param_add: same forward, their gradients summed over the tokens in float32
    xr, xw, xk, xv, xa, xg = token_shift_mixes(x, shift_BC, [p[m] for m in MIX_NAMES],
                                               segment_ids_BT)

    r = policy.einsum("btc,cd->btd", xr, p["receptance"], fp8_meta=p.get("fp8_receptance"))
    k = policy.einsum("btc,cd->btd", xk, p["key"], fp8_meta=p.get("fp8_key"))
    v = policy.einsum("btc,cd->btd", xv, p["value"], fp8_meta=p.get("fp8_value"))
    w = decay_log(p, xw, policy)

    if first is True:
        v_first_BTC = v
    else:
        v_gate = jax.nn.sigmoid(param_add(_lora(policy, xv, p["v1"], p["v2"]), p["v0"]))
        mixed = v + (v_first_BTC.astype(cd) - v) * v_gate
        if first is False:
            v = mixed
        else:   # traced flag (layer scan): layer 0 keeps v and defines v_first with it; its
            v = jnp.where(first, v, mixed)     # v0/v1/v2 gradients are then exactly zero
            v_first_BTC = jnp.where(first, v, v_first_BTC.astype(cd))
    a = jax.nn.sigmoid(param_add(_lora(policy, xa, p["a1"], p["a2"]), p["a0"]))
    g = policy.einsum("btr,rc->btc", jax.nn.sigmoid(policy.einsum("btc,cr->btr", xg, p["g1"])),
                      p["g2"])

    kk = normalize_heads(k.reshape(B, T, H, N), p["k_k"].reshape(H, N))
    k = k * (1 + param_mul(a - 1, p["k_a"]))

    heads = lambda t: t.reshape(B, T, H, N)  # noqa: E731
    r4, k4, v4, a4 = heads(r), heads(k), heads(v), heads(a)
    a_in, b_in = (-kk).astype(cd), (kk * a4.astype(f32)).astype(cd)
    tap = probe or (lambda name, x: None)
    for name, val in (("r", r4), ("w", heads(w)), ("k", k4), ("v", v4), ("a_in", a_in),
                      ("b_in", b_in), ("a", a), ("g", g)):
        tap(name, val)
    with jax.named_scope("wkv"):
        op = wkv_op or functools.partial(wkv7, platform=platform)
        o, wkv_BHNN = op(r4, heads(w), k4, v4, a_in, b_in,
                           initial_state=wkv_BHNN, return_state=True, segment_ids=segment_ids_BT,
                           chunk_size=chunk_size, impl=wkv_impl, output_dtype=cd,
                           precision=policy.wkv_precision)
    o = checkpoint_name(o, WKV7_OUTPUT_NAME)   # kept by Runtime(remat_policy="save_dots")
    tap("wkv_out", o)
    tap("wkv_state", wkv_BHNN)

    y = group_norm(o.reshape(B, T, C), p["ln_x"]["weight"], p["ln_x"]["bias"], n_groups=H,
                   eps=N * 1e-5, out_dtype=cd, impl=ln_x_impl, platform=platform,
                   mesh=mesh)
    tap("ln_x", y)
    bonus = jnp.sum(param_mul(r4 * k4, p["r_k"]), axis=-1, keepdims=True, dtype=f32)
    y = y + (bonus.astype(cd) * v4).reshape(B, T, C)
    out = policy.einsum("btc,cd->btd", y * g, p["output"], fp8_meta=p.get("fp8_output"))
    tap("out", out)
    return out, v_first_BTC, wkv_BHNN
