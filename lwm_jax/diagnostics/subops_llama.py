"""LLaMA-family sub-ops for the precision report: RoPE table, attention, RMSNorm, SwiGLU MLP,
logits, loss.

| op        | policy value                         | its input                 | policy storage     |
|-----------|--------------------------------------|---------------------------|--------------------|
| rope      | `rope_cos_sin` at 0..max_seq_len-1   | positions (exact)         | float32            |
| attention | tap `attn_out`                       | layer input (`emb` / previous `x_out`) | normed x, q, k, v, rotated q/k, probabilities, heads, out in compute dtype |
| rmsnorm   | `rms_norm` on the run's `x_att`      | tap `x_att`               | output compute dtype |
| mlp       | tap `mlp_out`                        | tap `x_att`               | normed x, silu(g) u and out in compute dtype; g, u float32 |
| logits    | tap `logits`                         | last `x_out`              | output dtype       |

RMSNorm and RoPE are measured in isolation: the library's own functions
(`lwm_jax.layers.rms_norm`, `lwm_jax.layers.rope`) called as the block calls them, on the run's
values (no end-to-end column for them).

Under an FP8 policy the table is `FP8_SUBOPS`: the same ops (the attention's and MLP's floors
with e4m3 operands in their projections, `Context.gemm_operand`) plus one per FP8 GEMM site
(`attn_q`, `attn_k`, `attn_v`, `attn_o`, `mlp_gate`, `mlp_up`, `mlp_down`; `FP8_GEMMS` maps each
meta site to its op), each on its input as the policy formed it: the block's taps `attn_in`,
`attn/heads`, `mlp_in`, `mlp/hidden` (`lwm_jax.models.llama.block.block_forward`), so the local
error is the GEMM's own.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from lwm_jax.diagnostics.subops import (F32, LOSS, Context, Family, Local, SubOp, logits_from,
                                        projection_or_vector_std, rms_norm64, storage)
from lwm_jax.layers.rms_norm import rms_norm
from lwm_jax.layers.rope import inv_frequencies, rope_cos_sin


def _layer(ctx: Context, group: str, layer: int) -> dict:
    return {k: v[layer] for k, v in ctx.params["blocks"][group].items()}


def _freqs(cfg):
    return inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def _rope64(x_BTHD, cos_TK, sin_TK):
    half = x_BTHD.shape[-1] // 2
    x1, x2 = x_BTHD[..., :half], x_BTHD[..., half:]
    c, s = cos_TK[None, :, None, :], sin_TK[None, :, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _attention64(x_BTC, p, norm_w, cfg, store, prod=lambda a: a, gemm=None):
    """One layer's attention sublayer in float64; `store(x)` is applied wherever the block
    stores a value, `prod(x)` to every product operand and `gemm(x)` (default `prod`) to the
    projections' operands (identity for the reference; compute-dtype rounding and the
    backend's product rounding for the floor, e4m3 projection operands under FP8)."""
    gemm = prod if gemm is None else gemm
    B, T, _ = x_BTC.shape
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    angle = np.arange(T, dtype=np.float64)[:, None] * _freqs(cfg)[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    h = store(rms_norm64(x_BTC, norm_w, cfg.rms_eps))
    h = gemm(h)
    q = _rope64(store(h @ gemm(p["q"])).reshape(B, T, H, D), cos, sin)
    k = _rope64(store(h @ gemm(p["k"])).reshape(B, T, K, D), cos, sin)
    q, k = prod(store(q)), prod(store(k))
    v = prod(store(h @ gemm(p["v"]))).reshape(B, T, K, D)
    causal = np.tril(np.ones((T, T), bool))
    heads = []
    for i in range(H):
        j = i // (H // K)
        scores = np.einsum("btd,bsd->bts", q[:, :, i], k[:, :, j]) / np.sqrt(D)
        scores = np.where(causal, scores, -np.inf)
        e = np.exp(scores - scores.max(-1, keepdims=True))
        probs = prod(store(e / e.sum(-1, keepdims=True)))
        heads.append(store(np.einsum("bts,bsd->btd", probs, v[:, :, j])))
    return store(gemm(np.concatenate(heads, -1)) @ gemm(p["o"]))


def attention_local(ctx: Context, layer: int) -> Local:
    """RMSNorm, q/k/v, RoPE, causal softmax attention (GQA) and the output projection, from
    the run's layer input (under FP8 the floor's projections take e4m3 operands)."""
    cfg, cd = ctx.cfg, ctx.compute_dtype
    x = ctx.tap("emb" if layer == 0 else f"layer{layer - 1}/x_out")
    p = _layer(ctx, "attn", layer)
    w = ctx.params["blocks"]["attn_norm"]["weight"][layer]
    ref = _attention64(x, p, w, cfg, lambda a: a)
    floor = _attention64(x, p, w, cfg, lambda a: storage(a, cd), ctx.product,
                         ctx.gemm_operand)
    return Local(ctx.tap(f"layer{layer}/attn_out"), ref, floor)


def rmsnorm_local(ctx: Context, layer: int) -> Local:
    """The MLP's RMSNorm (`lwm_jax.layers.rms_norm`) on the run's `x_att`, output in the
    compute dtype, as the block calls it."""
    x_att = ctx.taps[f"layer{layer}/x_att"]
    weight_dtype = jnp.dtype(ctx.policy.param_dtype)
    w = ctx.params["blocks"]["mlp_norm"]["weight"][layer]
    value = rms_norm(jnp.asarray(x_att), jnp.asarray(w, weight_dtype), eps=ctx.cfg.rms_eps,
                     out_dtype=ctx.compute_dtype)
    ref = rms_norm64(np.asarray(x_att, np.float64), w, ctx.cfg.rms_eps)
    return Local(np.asarray(value, np.float64), ref, storage(ref, ctx.compute_dtype))


def mlp_local(ctx: Context, layer: int) -> Local:
    """SwiGLU `down(silu(gate h) * up h)`, h = RMSNorm(x_att), from the run's `x_att` (the
    floor's three GEMMs with operands as `Context.gemm_operand`: e4m3 under FP8)."""
    cd = ctx.compute_dtype
    p = _layer(ctx, "mlp", layer)
    w = ctx.params["blocks"]["mlp_norm"]["weight"][layer]
    h = rms_norm64(ctx.tap(f"layer{layer}/x_att"), w, ctx.cfg.rms_eps)

    def swiglu(h, store, store32, gemm):
        h = gemm(h)
        g, u = store32(h @ gemm(p["gate"])), store32(h @ gemm(p["up"]))
        return store(gemm(store(g / (1.0 + np.exp(-g)) * u)) @ gemm(p["down"]))
    same = lambda a: a  # noqa: E731
    ref = swiglu(h, same, same, same)
    floor = swiglu(storage(h, cd), lambda a: storage(a, cd), lambda a: storage(a, F32),
                   ctx.gemm_operand)
    return Local(ctx.tap(f"layer{layer}/mlp_out"), ref, floor)


def rope_local(ctx: Context, layer) -> Local:
    """cos and sin tables of every position up to `max_seq_len` (`rope_cos_sin`, what the
    model uses) against float64 `cos(p f)`, `sin(p f)`."""
    del layer
    freqs = _freqs(ctx.cfg)
    positions = np.arange(ctx.cfg.max_seq_len, dtype=np.int64)
    cos, sin = rope_cos_sin(jnp.asarray(positions, jnp.int32), freqs)
    value = np.concatenate([np.asarray(cos, np.float64), np.asarray(sin, np.float64)], -1)
    angle = positions[:, None].astype(np.float64) * freqs[None, :]
    ref = np.concatenate([np.cos(angle), np.sin(angle)], -1)
    return Local(value, ref, storage(ref, F32))


def logits_local(ctx: Context, layer) -> Local:
    """Final RMSNorm + head (the embedding transposed when tied) on the last residual."""
    del layer
    cfg = ctx.cfg
    x = ctx.tap(f"layer{cfg.n_layer - 1}/x_out")
    head = ctx.params["embed"].T if cfg.tie_embeddings else ctx.params["head"]
    return logits_from(ctx, rms_norm64(x, ctx.params["norm"]["weight"], cfg.rms_eps), head)


SUBOPS = (
    SubOp("rope", "pre", None, rope_local,
          "RoPE cos/sin tables, positions 0..max_seq_len-1",
          "RoPE tables below float32 accuracy (e.g. a bf16 table or angles formed as float32 "
          "products): use lwm_jax.layers.rope.rope_cos_sin"),
    SubOp("attention", "layer", "attn_out", attention_local,
          "RMSNorm, q/k/v, RoPE, causal softmax attention, output projection",
          "attention loses more than its storage rounding: keep its logits and softmax in "
          "float32 (lwm_jax.layers.attention) and the matmul precision explicit (m=highest)"),
    SubOp("rmsnorm", "layer", None, rmsnorm_local,
          "RMSNorm before the MLP (float32 statistics)",
          "RMSNorm statistics below float32: keep the norm island "
          "(lwm_jax.layers.rms_norm: float32 mean square)"),
    SubOp("mlp", "layer", "mlp_out", mlp_local,
          "SwiGLU MLP with its RMSNorm",
          "the MLP loses more than its storage rounding: keep silu(g) * u in float32 and "
          "check the matmul precision (m=highest)"),
    SubOp("logits", "post", "logits", logits_local,
          "final RMSNorm + head (float32 logits island)",
          "logits computed below float32: keep the logits island (head_fn: float32 RMSNorm "
          "and Policy.einsum_f32; output dtype o=f32)"),
    LOSS,
)


# ---------------------------------------------------------------- FP8 GEMMs (fp8-mixed)
def _operand(ctx: Context, x) -> np.ndarray:
    """A block GEMM's operand in its floor, float64: e4m3 at its ideal scale under an FP8
    policy (`Context.gemm_operand`), else what `Policy.einsum` multiplies: the value in the
    compute dtype (a float32 weight is cast there), then the backend's product rounding. The
    second is the compute-dtype floor the not-FP8 check compares against
    (`precision_fp8.gemm_checks`), so it rounds the weight as a GEMM that ran in bf16 does."""
    if getattr(ctx.policy, "fp8", False):
        return ctx.gemm_operand(x)
    return ctx.product(storage(x, ctx.compute_dtype))


def gemm_local(ctx: Context, layer: int, *, inp: str, group: str, weight: str, out: str,
               out_dtype=None) -> Local:
    """One projection `x W` on the run's input tap `inp` (as the policy formed it) against its
    output tap `out`; floor: `_operand`s, product stored in `out_dtype` (default the compute
    dtype; the SwiGLU gate and up products are returned in float32)."""
    x = ctx.tap(f"layer{layer}/{inp}")
    w = _layer(ctx, group, layer)[weight]
    floor = _operand(ctx, x) @ _operand(ctx, w)
    return Local(ctx.tap(f"layer{layer}/{out}"), x @ w,
                 storage(floor, ctx.compute_dtype if out_dtype is None else out_dtype))


FP8_FIX = ("this FP8 GEMM loses more than e4m3 rounding at a working scale: its delayed scale "
           "is stale or lost (values clipped at 448 x scale or flushed below 2^-9 x scale); "
           "read its scale / amax trajectory (the report's fp8 section), calibrate longer "
           "(--fp8-calibration-steps) or keep this GEMM in bf16")
# (site, sub-op, input tap, parameter group, weight, output tap, output dtype, meaning)
_GEMM_SITES = (
    ("attn/q", "attn_q", "attn_in", "attn", "q", "attn/q", None, "query projection h W_q"),
    ("attn/k", "attn_k", "attn_in", "attn", "k", "attn/k", None, "key projection h W_k"),
    ("attn/v", "attn_v", "attn_in", "attn", "v", "attn/v", None, "value projection h W_v"),
    ("attn/o", "attn_o", "attn/heads", "attn", "o", "attn_out", None,
     "output projection (attention heads) W_o"),
    ("mlp/gate", "mlp_gate", "mlp_in", "mlp", "gate", "mlp/gate", F32,
     "SwiGLU gate h W_gate, float32 product"),
    ("mlp/up", "mlp_up", "mlp_in", "mlp", "up", "mlp/up", F32,
     "SwiGLU up h W_up, float32 product"),
    ("mlp/down", "mlp_down", "mlp/hidden", "mlp", "down", "mlp_out", None,
     "SwiGLU down (silu(g) u) W_down"),
)
FP8_GEMM_SUBOPS = {
    name: SubOp(name, "layer", out, functools.partial(gemm_local, inp=inp, group=group,
                                                       weight=weight, out=out,
                                                       out_dtype=out_dtype),
                f"{meaning} (FP8)", FP8_FIX)
    for _, name, inp, group, weight, out, out_dtype, meaning in _GEMM_SITES}
FP8_GEMMS = tuple((site, name) for site, name, *_ in _GEMM_SITES)
_BY_NAME = {op.name: op for op in SUBOPS} | FP8_GEMM_SUBOPS
FP8_SUBOPS = tuple(_BY_NAME[n] for n in (
    "rope", "attn_q", "attn_k", "attn_v", "attn_o", "attention", "rmsnorm", "mlp_gate",
    "mlp_up", "mlp_down", "mlp", "logits", "loss"))


def grad_group(path: tuple[str, ...]) -> str:
    """Parameter group of a gradient leaf (per layer under `blocks`)."""
    if path[0] != "blocks":
        return {"embed": "embed", "norm": "head", "head": "head"}.get(path[0], path[0])
    return {"attn": "attention", "mlp": "mlp", "attn_norm": "norms",
            "mlp_norm": "norms"}.get(path[1], path[1])


# `[..., in, out]` matrices applied as `x @ W`.
PROJECTIONS = frozenset({"q", "k", "v", "o", "gate", "up", "down", "head"})


def warm_std(path: tuple[str, ...], x) -> float | None:
    """`Family.warm_std` for LLaMA: `projection_or_vector_std` (at init, the RMSNorm weights
    are the constant 1; every matrix is Gaussian and kept)."""
    return projection_or_vector_std(path, x, PROJECTIONS)


FAMILY = Family("llama", SUBOPS, grad_group, warm_std, FP8_SUBOPS, FP8_GEMMS,
                ("attention", "mlp"))
