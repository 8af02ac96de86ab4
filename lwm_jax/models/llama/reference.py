"""Float64 NumPy forward of the LLaMA model, written from the formulas (for tests).

`forward(cfg, params, tokens_BT, segment_ids_BT=None) -> logits [B, T, V]` float64, where
`params` is the model's parameter pure dict (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`)
and `cfg` a resolved `LlamaConfig`. Attention is an explicit loop over heads with a boolean
mask; RoPE angles are `position * inv_freq` in float64; positions restart at each segment.
"""
from __future__ import annotations

import numpy as np

from lwm_jax.layers.rope import inv_frequencies


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x_THD, pos_T, freqs):
    angle = pos_T[:, None, None] * freqs[None, None, :]
    half = x_THD.shape[-1] // 2
    x1, x2 = x_THD[..., :half], x_THD[..., half:]
    c, s = np.cos(angle), np.sin(angle)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def _positions(seg_T):
    pos, start = np.zeros(len(seg_T)), 0
    for t in range(len(seg_T)):
        if t and seg_T[t] != seg_T[t - 1]:
            start = t
        pos[t] = t - start
    return pos


def forward(cfg, params, tokens_BT, segment_ids_BT=None):
    p = {k: v for k, v in params.items()}
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    tokens_BT = np.asarray(tokens_BT)
    B, T = tokens_BT.shape
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    seg = np.zeros((B, T), int) if segment_ids_BT is None else np.asarray(segment_ids_BT)
    freqs = inv_frequencies(D, cfg.rope_theta, cfg.rope_scaling)
    embed = f64(p["embed"])
    head = embed.T if cfg.tie_embeddings else f64(p["head"])
    blk = p["blocks"]
    out = np.zeros((B, T, cfg.vocab_size))
    for b in range(B):
        x = embed[tokens_BT[b]]
        pos = _positions(seg[b])
        allowed = (seg[b][:, None] == seg[b][None, :]) & np.tri(T, dtype=bool)
        for l in range(cfg.n_layer):
            h = _rms(x, f64(blk["attn_norm"]["weight"][l]), cfg.rms_eps)
            q = _rope((h @ f64(blk["attn"]["q"][l])).reshape(T, H, D), pos, freqs)
            k = _rope((h @ f64(blk["attn"]["k"][l])).reshape(T, K, D), pos, freqs)
            v = (h @ f64(blk["attn"]["v"][l])).reshape(T, K, D)
            heads = []
            for i in range(H):
                j = i // (H // K)
                logits = q[:, i] @ k[:, j].T / np.sqrt(D)
                logits = np.where(allowed, logits, -np.inf)
                w = np.exp(logits - logits.max(-1, keepdims=True))
                heads.append((w / w.sum(-1, keepdims=True)) @ v[:, j])
            x = x + np.concatenate(heads, -1) @ f64(blk["attn"]["o"][l])
            h = _rms(x, f64(blk["mlp_norm"]["weight"][l]), cfg.rms_eps)
            g, u = h @ f64(blk["mlp"]["gate"][l]), h @ f64(blk["mlp"]["up"][l])
            x = x + (g / (1 + np.exp(-g)) * u) @ f64(blk["mlp"]["down"][l])
        out[b] = _rms(x, f64(p["norm"]["weight"]), cfg.rms_eps) @ head
    return out
