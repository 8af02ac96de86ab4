"""LLaMA block = RMSNorm -> grouped-query attention with RoPE, RMSNorm -> SwiGLU, both residual.

`Block` holds the parameters of ALL layers stacked on a leading `layers` axis; `block_forward`
is the pure per-layer function (one layer's parameter slice in, new residual stream out) that
the model's Python loop and its `lax.scan` both call.

Dtypes: the residual stream, q/k/v, the attention output and the MLP run in
`policy.compute_dtype`, every projection through `policy.einsum` (explicit precision, float32
accumulation). float32 islands: the RMSNorm statistics, the RoPE angles and rotation, the
attention logits and softmax, and the SiLU gate (`silu(g) * u` in float32, cast once).

Under an FP8 policy the seven projections (q/k/v/o, gate/up/down) are FP8 GEMMs: each has an
`Fp8Meta` `[L, 3, 1 + history]` beside its weight (`fp8_q`, ..., `fp8_down`; the delayed-scaling
state of `lwm_jax.precision.fp8`, not a parameter). Attention itself and the head stay as above.

Initialisation: every matrix ~ N(0, 0.02^2), except the two that write into the residual
stream (`attn.o`, `mlp.down`), which get 0.02 / sqrt(2L) so that the stream's variance at
init does not grow with depth (GPT-2's rule).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from lwm_jax.layers.attention import KVCache, cached_attention, self_attention
from lwm_jax.layers.rms_norm import RMSNorm, rms_norm
from lwm_jax.layers.rope import apply_rope
from lwm_jax.precision.fp8 import Fp8Meta, init_meta
from lwm_jax.probe import scoped

INIT_STD = 0.02


def normal(key, shape, std: float, dtype):
    """N(0, std^2) in float32, cast to `dtype`."""
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Attention(nnx.Module):
    """Attention projections of all L layers, `x @ W` layout (logical axes in brackets):
    q `[L, C, H*D]`, k and v `[L, C, K*D]` (layers, embed, heads), o `[L, H*D, C]`
    (layers, heads, embed). "heads" names the flattened head-times-head_dim axis."""

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs):
        L, C, D, pd = cfg.n_layer, cfg.n_embd, cfg.head_dim, policy.param_dtype
        out_std = INIT_STD / math.sqrt(2 * L)
        in_axes, out_axes = ("layers", "embed", "heads"), ("layers", "heads", "embed")
        self.q = nnx.Param(normal(rngs.params(), (L, C, cfg.n_head * D), INIT_STD, pd),
                           logical_axes=in_axes)
        self.k = nnx.Param(normal(rngs.params(), (L, C, cfg.n_kv_head * D), INIT_STD, pd),
                           logical_axes=in_axes)
        self.v = nnx.Param(normal(rngs.params(), (L, C, cfg.n_kv_head * D), INIT_STD, pd),
                           logical_axes=in_axes)
        self.o = nnx.Param(normal(rngs.params(), (L, cfg.n_head * D, C), out_std, pd),
                           logical_axes=out_axes)
        _fp8_metas(self, ("q", "k", "v", "o"), L, policy)


class MLP(nnx.Module):
    """SwiGLU of all L layers: gate and up `[L, C, F]` (layers, embed, mlp), down `[L, F, C]`
    (layers, mlp, embed)."""

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs):
        L, C, F, pd = cfg.n_layer, cfg.n_embd, cfg.ffn_hidden, policy.param_dtype
        self.gate = nnx.Param(normal(rngs.params(), (L, C, F), INIT_STD, pd),
                              logical_axes=("layers", "embed", "mlp"))
        self.up = nnx.Param(normal(rngs.params(), (L, C, F), INIT_STD, pd),
                            logical_axes=("layers", "embed", "mlp"))
        self.down = nnx.Param(normal(rngs.params(), (L, F, C), INIT_STD / math.sqrt(2 * L), pd),
                              logical_axes=("layers", "mlp", "embed"))
        _fp8_metas(self, ("gate", "up", "down"), L, policy)


def _fp8_metas(module, names, L: int, policy) -> None:
    """Under an FP8 policy, an `fp8_<name>` scaling state `[L, 3, 1 + history]` per GEMM."""
    if policy.fp8:
        for name in names:
            setattr(module, f"fp8_{name}", Fp8Meta(init_meta(stack=(L,)),
                                                   logical_axes=("layers", None, None)))


class Block(nnx.Module):
    """Parameters of all L blocks: `attn_norm`, `mlp_norm` (RMSNorm `[L, C]`), `attn`, `mlp`."""

    def __init__(self, cfg, policy, *, rngs: nnx.Rngs):
        stack, pd = (cfg.n_layer,), policy.param_dtype
        self.attn_norm = RMSNorm(cfg.n_embd, param_dtype=pd, stack=stack, eps=cfg.rms_eps)
        self.attn = Attention(cfg, policy, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.n_embd, param_dtype=pd, stack=stack, eps=cfg.rms_eps)
        self.mlp = MLP(cfg, policy, rngs=rngs)


@jax.named_scope("attention")
def attention_forward(p: dict, x_BTC, cos_BTK, sin_BTK, cache: KVCache | None, *, cfg, policy,
                      segment_ids_BT=None, platform: str | None = None, mesh=None, probe=None):
    """One layer's attention on normalised input `x_BTC` -> `([B, T, C], new cache or None)`.
    `platform` / `mesh`: what the program is compiled for (`layers.attention.self_attention`).
    `probe`: optional tap of each projection's input as it formed it: `q`, `k`, `v` (the
    projections' outputs, `[B, T, heads * D]` before RoPE) and `heads` (the attention output,
    `[B, T, H * D]`, the output projection's input)."""
    B, T, _ = x_BTC.shape
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    tap = probe or (lambda name, x: None)
    q = policy.einsum("btc,cf->btf", x_BTC, p["q"], fp8_meta=p.get("fp8_q"))
    k = policy.einsum("btc,cf->btf", x_BTC, p["k"], fp8_meta=p.get("fp8_k"))
    v = policy.einsum("btc,cf->btf", x_BTC, p["v"], fp8_meta=p.get("fp8_v"))
    for name, value in (("q", q), ("k", k), ("v", v)):
        tap(name, value)
    q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)
    q, k = apply_rope(q, cos_BTK, sin_BTK), apply_rope(k, cos_BTK, sin_BTK)
    prec = policy.matmul_precision
    if cache is None:
        out = self_attention(q, k, v, precision=prec, segment_ids_BT=segment_ids_BT,
                             platform=platform, mesh=mesh)
    else:
        out, cache = cached_attention(q, k, v, cache, precision=prec)
    heads = out.reshape(B, T, H * D)
    tap("heads", heads)
    return policy.einsum("btf,fc->btc", heads, p["o"], fp8_meta=p.get("fp8_o")), cache


@jax.named_scope("mlp")
def mlp_forward(p: dict, x_BTC, *, policy, probe=None):
    """SwiGLU `down(silu(gate x) * up x)`; the gate product in float32, cast once.
    `probe`: optional tap of `gate`, `up` (float32 products) and `hidden` (the down
    projection's input, compute dtype)."""
    g = policy.einsum("btc,cf->btf", x_BTC, p["gate"], out_dtype=jnp.float32,
                      fp8_meta=p.get("fp8_gate"))
    u = policy.einsum("btc,cf->btf", x_BTC, p["up"], out_dtype=jnp.float32,
                      fp8_meta=p.get("fp8_up"))
    hidden = (jax.nn.silu(g) * u).astype(policy.compute_dtype)
    if probe is not None:
        for name, value in (("gate", g), ("up", u), ("hidden", hidden)):
            probe(name, value)
    return policy.einsum("btf,fc->btc", hidden, p["down"], fp8_meta=p.get("fp8_down"))


def block_forward(p: dict, x_BTC, cos_BTK, sin_BTK, cache: KVCache | None, *, cfg, policy,
                  segment_ids_BT=None, probe=None, platform: str | None = None, mesh=None):
    """One layer: `x += attn(norm(x)); x += mlp(norm(x))`.

    Args:
      p: one layer's parameters `{"attn_norm", "attn", "mlp_norm", "mlp"}` (plain dict).
      x_BTC: `[B, T, C]` residual stream in `policy.compute_dtype`.
      cos_BTK, sin_BTK: float32 `[B or 1, T, D/2]` RoPE tables of this call's positions.
      cache: this layer's `KVCache` (decoding) or None (whole-sequence attention).
      cfg: the resolved `LlamaConfig`. policy: `Policy`.
      segment_ids_BT: packed-document ids (whole-sequence attention only).
      probe: optional `probe(name, x)` tap, in execution order: `attn_in` (the normed input of
        q/k/v), `attn/q`, `attn/k`, `attn/v`, `attn/heads` (`attention_forward`), `mlp_in`
        (the normed input of gate/up), `mlp/gate`, `mlp/up`, `mlp/hidden` (`mlp_forward`),
        then `attn_out`, `x_att`, `mlp_out`, `x_out`: every FP8 GEMM's input and output as the
        policy formed them (the precision report's sites). Taps only observe.
      platform, mesh: the platform and device mesh the program is compiled for (the model's;
        they pick the attention kernel and how it is split over devices).
    Returns:
      `(x_BTC, new cache or None)`.
    """
    cd = policy.compute_dtype
    tap = probe or (lambda name, x: None)
    h = rms_norm(x_BTC, p["attn_norm"]["weight"], eps=cfg.rms_eps, out_dtype=cd)
    tap("attn_in", h)
    att, cache = attention_forward(p["attn"], h, cos_BTK, sin_BTK, cache, cfg=cfg,
                                   policy=policy, segment_ids_BT=segment_ids_BT,
                                   platform=platform, mesh=mesh, probe=scoped(probe, "attn"))
    x_BTC = x_BTC + att
    h = rms_norm(x_BTC, p["mlp_norm"]["weight"], eps=cfg.rms_eps, out_dtype=cd)
    tap("mlp_in", h)
    mlp = mlp_forward(p["mlp"], h, policy=policy, probe=scoped(probe, "mlp"))
    x_BTC_out = x_BTC + mlp
    if probe is not None:
        for name, value in (("attn_out", att), ("x_att", x_BTC), ("mlp_out", mlp),
                            ("x_out", x_BTC_out)):
            probe(name, value)
    return x_BTC_out, cache
