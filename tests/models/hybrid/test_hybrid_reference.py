"""The RWKV-7 / attention hybrid against an independent float64 NumPy forward.

What it proves: the fp32 `RWKVHybrid` (IEEE fp32 matmuls) computes, to fp32 rounding, the
architecture its docstring and `HybridConfig` describe. Layer l is an RWKV-7 block unless l is
in `attention_layers`, where the block is

    x += Attention(LN1(x));  x += ChannelMix(LN2(x))

with causal grouped-query attention (query head h reads key/value head h // (H / K)), RoPE with
the "rotate half" pairing (i with i + N/2, base `rope_theta`) on q and k, the softmax scale
1/sqrt(N), and RWKV's squared-ReLU ChannelMix with its own token shift. `v_first` comes from
layer 0 and is mixed into every later RWKV layer; attention layers in between leave it alone.
Packed documents restart the RWKV state and token shifts and the attention's context where the
segment id changes (RoPE positions restart too, which logits cannot show: RoPE scores depend
on relative positions only). The loss gradient is checked as well: its projections on random
directions equal the float64 forward's central differences.

Why it is independent: the reference below uses nothing of `lwm_jax` but the model's parameter
tree. It runs token by token (the model runs whole sequences), keeps an explicit key/value
cache per attention layer instead of a mask, computes RoPE angles in float64 from
`theta ** (-2i / N)`, and writes every formula out in float64. The parameters are drawn here
(`_draw`), not by the model's initialisers. Its RWKV-7 layers are checked against the separate
float64 RWKV-7 reference (`lwm_jax.models.rwkv7.reference.forward_np`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm_jax.models.hybrid import HybridConfig, RWKVHybrid
from lwm_jax.models.rwkv7.reference import forward_np
from lwm_jax.runtime import Runtime

# Two attention layers, each between RWKV-7 layers (0, 2, 4); 4 query heads over 2 kv heads.
CFG = dict(vocab_size=67, n_layer=5, n_embd=64, head_size=16, attention_layers=(1, 3),
           attn_kv_heads=2, rope_theta=500.0)
RT = Runtime(wkv_impl="chunked", chunk_size=8)
B, T = 2, 29
SEGMENTS_BT = np.asarray([[3] * 12 + [7] * 17, [5] * 29])     # row 0 packs two documents
# fp32 vs float64, measured on CPU: logits 4.8e-7 relative, projected gradients 1.3e-5 and
# 2.6e-5 (the fp32 chunked and recurrent WKV give gradients that differ by as much).
TOL = 5e-6        # logits and loss
GRAD_TOL = 1e-4   # a gradient projection vs the float64 central difference


def rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# ---------------------------------------------------------------- float64 reference forward

def _f64(tree):
    if isinstance(tree, dict):
        return {k: _f64(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)


def _ln(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = np.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["weight"] + p["bias"]


def _sig(z):
    return 1.0 / (1.0 + np.exp(-z))


def _layer(tree, i):
    """Layer `i`'s slice of a stacked parameter tree."""
    return {k: _layer(v, i) if isinstance(v, dict) else v[i] for k, v in tree.items()}


def _rotate(x_HN, pos, theta):
    """RoPE of one token: pairs (i, i + N/2) turned by `pos * theta ** (-2i / N)`."""
    N = x_HN.shape[-1]
    angle = pos * theta ** (-np.arange(0, N, 2) / N)
    c, s = np.cos(angle), np.sin(angle)
    a, b = x_HN[:, :N // 2], x_HN[:, N // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def _channel_mix(p, xn_C, prev_C):
    mixed = xn_C + (prev_C - xn_C) * p["x_k"]
    return np.maximum(mixed @ p["key"], 0.0) ** 2 @ p["value"]


def _rwkv_time_mix(p, xn_C, prev_C, S_HVK, v_first_C, first, N):
    """One token of RWKV-7 TimeMix; updates the state `S [H, value, key]` in place.
    Returns `(out [C], v_first [C])`."""
    C = xn_C.shape[0]
    H = C // N
    d = prev_C - xn_C
    xr, xw, xk, xv, xa, xg = (xn_C + d * p["x_" + m] for m in "rwkvag")
    r, k, v = xr @ p["receptance"], xk @ p["key"], xv @ p["value"]
    log_decay = -np.exp(-0.5) * _sig(p["w0"] + np.tanh(xw @ p["w1"]) @ p["w2"])
    if first:
        v_first_C = v
    else:
        v = v + (v_first_C - v) * _sig(p["v0"] + xv @ p["v1"] @ p["v2"])
    a = _sig(p["a0"] + xa @ p["a1"] @ p["a2"])
    gate = _sig(xg @ p["g1"]) @ p["g2"]
    kk = (k * p["k_k"]).reshape(H, N)
    kk = kk / np.maximum(np.sqrt((kk ** 2).sum(-1, keepdims=True)), 1e-12)
    k = k * (1.0 + (a - 1.0) * p["k_a"])
    r_HN, k_HN, v_HN, a_HN = (z.reshape(H, N) for z in (r, k, v, a))
    y_HN = np.empty((H, N))
    for h in range(H):
        # S <- S (diag(exp(w)) - kk (kk * a)^T) + v k^T ;  y = S r
        S_HVK[h] = (S_HVK[h] * np.exp(log_decay.reshape(H, N)[h])[None, :]
                    - np.outer(S_HVK[h] @ kk[h], kk[h] * a_HN[h]) + np.outer(v_HN[h], k_HN[h]))
        y_HN[h] = S_HVK[h] @ r_HN[h]
    mu = y_HN.mean(-1, keepdims=True)
    y_HN = (y_HN - mu) / np.sqrt(((y_HN - mu) ** 2).mean(-1, keepdims=True) + N * 1e-5)
    y = y_HN.reshape(C) * p["ln_x"]["weight"] + p["ln_x"]["bias"]
    y = y + ((r_HN * k_HN * p["r_k"]).sum(-1, keepdims=True) * v_HN).reshape(C)
    return (y * gate) @ p["output"], v_first_C


def _attention(p, xn_C, cache, pos, *, N, K, theta):
    """One token of causal GQA with RoPE; appends this token's key/value to `cache`."""
    H = xn_C.shape[0] // N
    q_HN = _rotate((xn_C @ p["q"]).reshape(H, N), pos, theta)
    cache["k"].append(_rotate((xn_C @ p["k"]).reshape(K, N), pos, theta))
    cache["v"].append((xn_C @ p["v"]).reshape(K, N))
    k_SKN, v_SKN = np.stack(cache["k"]), np.stack(cache["v"])
    heads = []
    for h in range(H):
        g = h // (H // K)
        score_S = k_SKN[:, g] @ q_HN[h] / np.sqrt(N)
        w_S = np.exp(score_S - score_S.max())
        heads.append((w_S / w_S.sum()) @ v_SKN[:, g])
    return np.concatenate(heads) @ p["o"]


def hybrid_forward_f64(params, tokens_BT, *, n_layer, attention_layers, head_size, kv_heads,
                       rope_theta, segment_ids_BT=None, attn_out_scale=1.0):
    """Float64 logits `[B, T, V]` of the hybrid, one token at a time.

    `params`: the model's parameter tree (any float dtype). `attn_out_scale` multiplies the
    attention layers' attention output (1 = the model; 0 shows how much attention matters).
    """
    p = _f64(params)
    tokens_BT = np.asarray(tokens_BT)
    Bn, Tn = tokens_BT.shape
    C, N = p["emb"].shape[1], head_size
    H = C // N
    seg_BT = np.zeros((Bn, Tn), int) if segment_ids_BT is None else np.asarray(segment_ids_BT)
    rwkv_layers = [l for l in range(n_layer) if l not in attention_layers]
    per_layer = {l: ("attn", attention_layers.index(l)) if l in attention_layers
                 else ("rwkv", rwkv_layers.index(l)) for l in range(n_layer)}
    layer_params = {l: _layer(p["attn_blocks" if kind == "attn" else "blocks"], i)
                    for l, (kind, i) in per_layer.items()}
    logits_BTV = np.zeros((Bn, Tn, p["head"].shape[1]))
    for b in range(Bn):
        for t in range(Tn):
            if t == 0 or seg_BT[b, t] != seg_BT[b, t - 1]:          # a document starts
                start = t
                att_shift = {l: np.zeros(C) for l in range(n_layer)}
                ffn_shift = {l: np.zeros(C) for l in range(n_layer)}
                wkv = {l: np.zeros((H, N, N)) for l in range(n_layer)}
                kv_cache = {l: {"k": [], "v": []} for l in range(n_layer)}
            x = _ln(p["emb"][tokens_BT[b, t]], p["ln0"])
            v_first = None
            for l in range(n_layer):
                lp = layer_params[l]
                xn = _ln(x, lp["ln1"])
                if per_layer[l][0] == "attn":
                    x = x + attn_out_scale * _attention(lp["attn"], xn, kv_cache[l], t - start,
                                                        N=N, K=kv_heads, theta=rope_theta)
                else:
                    out, v_first = _rwkv_time_mix(lp["att"], xn, att_shift[l], wkv[l], v_first,
                                                  l == 0, N)
                    att_shift[l] = xn
                    x = x + out
                xn2 = _ln(x, lp["ln2"])
                x = x + _channel_mix(lp["ffn"], xn2, ffn_shift[l])
                ffn_shift[l] = xn2
            logits_BTV[b, t] = _ln(x, p["ln_out"]) @ p["head"]
    return logits_BTV


# ---------------------------------------------------------------------------------- tests

MATRICES = frozenset({"q", "k", "v", "o", "receptance", "key", "value", "output", "head",
                      "w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"})
MIXES = frozenset({"x_r", "x_w", "x_k", "x_v", "x_a", "x_g"})


def _draw(path, leaf, rng):
    """A random value for one parameter, from its name: matrices `[..., in, out]` N(0, 1/in),
    `emb` N(0, 1), norm weights 1 + N(0, 0.2²), token-shift mixes U(0, 1), the rest (biases,
    w0, a0, v0, k_k, k_a, r_k) N(0, 0.5²). Norm weights and biases differ enough between
    `ln1` and `ln2` that using one for the other shows."""
    name = str(path[-1].key)
    if name in MATRICES:
        value = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2])
    elif name == "emb":
        value = rng.standard_normal(leaf.shape)
    elif name == "weight":
        value = 1.0 + 0.2 * rng.standard_normal(leaf.shape)
    elif name in MIXES:
        value = rng.uniform(0.0, 1.0, leaf.shape)
    else:
        value = 0.5 * rng.standard_normal(leaf.shape)
    return value.astype(np.float32)


def _build(runtime=RT, **overrides):
    """`(model, resolved config, parameter tree)`: the hybrid's structure from its constructor,
    traced abstractly (no init computation runs), with every parameter drawn by `_draw`."""
    cfg = HybridConfig(**{**CFG, **overrides})
    model = nnx.eval_shape(lambda: RWKVHybrid(cfg, "fp32", runtime=runtime, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(lambda path, leaf: _draw(path, leaf, rng),
                                              nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    nnx.update(model, state)
    return model, model.cfg, params


@pytest.fixture(scope="module")
def hybrid():
    return _build()


def _reference(cfg, params, tokens_BT, segment_ids_BT=None, **kw):
    return hybrid_forward_f64(params, tokens_BT, n_layer=cfg.n_layer,
                              attention_layers=cfg.attention_layers, head_size=cfg.head_size,
                              kv_heads=cfg.kv_heads, rope_theta=cfg.rope_theta,
                              segment_ids_BT=segment_ids_BT, **kw)


def _tokens(seed):
    """Random ids in [1, V) (never the all-zeros input)."""
    return np.random.default_rng(seed).integers(1, CFG["vocab_size"], (B, T))


def test_reference_rwkv_layers_agree_with_the_rwkv7_reference(hybrid):
    """The hybrid's RWKV layers alone form a plain 3-layer RWKV-7 stack: on it this file's
    reference equals the separate float64 RWKV-7 reference (packed documents included) to
    float64 rounding."""
    _, cfg, params = hybrid
    rwkv_only = {k: v for k, v in params.items() if k != "attn_blocks"}
    tok_BT = _tokens(12)
    ours_BTV = hybrid_forward_f64(rwkv_only, tok_BT, n_layer=len(cfg.rwkv_layers),
                                  attention_layers=(), head_size=cfg.head_size, kv_heads=0,
                                  rope_theta=cfg.rope_theta, segment_ids_BT=SEGMENTS_BT)
    theirs_BTV, _ = forward_np(rwkv_only, tok_BT, head_size=cfg.head_size,
                               segment_ids=SEGMENTS_BT)
    assert rel(ours_BTV, theirs_BTV) < 1e-12


def test_logits_match_the_float64_reference(hybrid):
    """fp32 logits within fp32 rounding of the float64 forward, for whole sequences (no segment
    ids) and for packed documents (row 0 holds two). Neither comparison is vacuous: dropping
    the attention output, or ignoring the document boundary, moves the float64 logits by far
    more than the tolerance."""
    model, cfg, params = hybrid
    tok_BT = _tokens(11)
    graphdef, state = nnx.split(model, nnx.Param)

    @jax.jit
    def logits(state):
        m = nnx.merge(graphdef, state)
        return m(jnp.asarray(tok_BT)), m(jnp.asarray(tok_BT), segment_ids=jnp.asarray(SEGMENTS_BT))

    out_BTV, out_packed_BTV = (np.asarray(a) for a in logits(state))
    assert out_BTV.dtype == np.float32 and out_BTV.shape == (B, T, CFG["vocab_size"])
    ref_BTV = _reference(cfg, params, tok_BT)
    ref_packed_BTV = _reference(cfg, params, tok_BT, SEGMENTS_BT)
    err, err_packed = rel(out_BTV, ref_BTV), rel(out_packed_BTV, ref_packed_BTV)
    print(f"\nlogits rel err: one document per row {err:.2e}, packed documents {err_packed:.2e}")
    assert err < TOL, err
    assert err_packed < TOL, err_packed
    no_attention = rel(_reference(cfg, params, tok_BT, attn_out_scale=0.0), ref_BTV)
    no_boundary = rel(ref_BTV[0, 12:], ref_packed_BTV[0, 12:])
    print(f"float64 logits move by {no_attention:.2e} without attention output, {no_boundary:.2e}"
          f" (second document) without the boundary")
    assert min(no_attention, no_boundary) > 1e3 * TOL


def _next_token_loss_f64(cfg, params, tok_BT, seg_BT):
    logits_BTV = _reference(cfg, params, tok_BT[:, :-1], seg_BT[:, :-1])
    top_BT1 = logits_BTV.max(-1, keepdims=True)
    lse_BT = np.log(np.exp(logits_BTV - top_BT1).sum(-1)) + top_BT1[..., 0]
    picked_BT = np.take_along_axis(logits_BTV, tok_BT[:, 1:, None], -1)[..., 0]
    return float(np.mean(lse_BT - picked_BT))


def test_loss_gradient_matches_float64_central_differences():
    """The fp32 gradient of the next-token loss over packed documents, projected on random
    directions (all parameters; the attention layer's parameters alone), equals the float64
    forward's central difference along them. The backward's compile is the costliest part of
    this file, so it runs on the smallest hybrid with an attention layer between RWKV layers
    (RWKV, attention, RWKV: `v_first` crosses it) and the recurrent WKV."""
    model, cfg, params = _build(Runtime(wkv_impl="recurrent"), n_layer=3, attention_layers=(1,))
    tok_BT = _tokens(13)
    graphdef, state = nnx.split(model, nnx.Param)

    @jax.jit
    def loss_and_grad(state):
        def loss(s):
            logits_BTV = nnx.merge(graphdef, s)(jnp.asarray(tok_BT[:, :-1]),
                                                segment_ids=jnp.asarray(SEGMENTS_BT[:, :-1]))
            logp_BTV = jax.nn.log_softmax(logits_BTV)
            picked_BT1 = jnp.take_along_axis(logp_BTV, jnp.asarray(tok_BT[:, 1:, None]), -1)
            return -jnp.mean(picked_BT1)
        return jax.value_and_grad(loss)(state)

    value, grads = loss_and_grad(state)
    loss_f64 = _next_token_loss_f64(cfg, params, tok_BT, SEGMENTS_BT)
    assert abs(float(value) - loss_f64) < TOL * loss_f64, (float(value), loss_f64)

    p64, g64 = _f64(params), _f64(nnx.to_pure_dict(grads))
    rng = np.random.default_rng(5)
    for group in ("all", "attn_blocks"):
        d = jax.tree.map(lambda a: rng.standard_normal(a.shape), p64)
        if group != "all":
            d = {k: v if k == group else jax.tree.map(np.zeros_like, v) for k, v in d.items()}
        projected = sum(float((g * u).sum()) for g, u in zip(jax.tree.leaves(g64),
                                                             jax.tree.leaves(d)))
        h = 1e-6      # float64: truncation ~h², rounding ~1e-16 / h, both far below fp32's
        plus, minus = (_next_token_loss_f64(cfg, jax.tree.map(lambda a, u: a + s * h * u, p64, d),
                                            tok_BT, SEGMENTS_BT) for s in (1.0, -1.0))
        central = (plus - minus) / (2 * h)
        err = abs(projected - central) / abs(central)
        print(f"gradient along a random direction ({group}): fp32 {projected:.8e}, float64 "
              f"central difference {central:.8e}, rel err {err:.2e}")
        assert err < GRAD_TOL, (group, projected, central)
