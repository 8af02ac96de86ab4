"""Float64 NumPy forward of RWKV-7, written from the spec formulas (test reference).

Independent of the JAX model's code paths: token by token, official state layout
(`S [value, key]`, `S_t = S_{t-1} (diag(e^{w_t}) + a_t b_tᵀ) + v_t k_tᵀ`, `y_t = S_t r_t`).
Takes the model's parameter tree (`lwm_jax.models.rwkv7.testing.param_dict`) and returns logits and
a state in the model's layout (`wkv` as [key, value]) so results compare directly.
"""
from __future__ import annotations

import numpy as np


def _f64(tree):
    if isinstance(tree, dict):
        return {k: _f64(v) for k, v in tree.items()}
    return np.asarray(tree, dtype=np.float64)


def _layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def forward_np(params: dict, tokens, *, head_size: int, state=None, segment_ids=None):
    """Float64 logits `[B, T, V]` and final state for int `tokens [B, T]`.

    Args:
      params: nested dict as in the model docstring (any float dtype; upcast to float64).
      state: optional dict `tmix_shift [L,B,C]`, `cmix_shift [L,B,C]`, `wkv [L,B,H,N,N]`
        ([key, value] layout); zeros if None.
      segment_ids: optional int `[B, T]`; state and token shift reset where the id changes.
    Returns:
      `(logits [B,T,V] float64, state dict in the same layout as the input state)`.
    """
    p = _f64(params)
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    L, C = p["blocks"]["ln1"]["weight"].shape
    N = head_size
    H = C // N
    if state is None:
        tshift, cshift = np.zeros((L, B, C)), np.zeros((L, B, C))
        S = np.zeros((L, B, H, N, N))            # official layout [value, key]
    else:
        tshift = np.array(state["tmix_shift"], np.float64)
        cshift = np.array(state["cmix_shift"], np.float64)
        S = np.swapaxes(np.array(state["wkv"], np.float64), -1, -2)
    reset = np.zeros((B, T), bool)
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        reset[:, 1:] = seg[:, 1:] != seg[:, :-1]

    logits = np.zeros((B, T, p["head"].shape[1]))
    blk = p["blocks"]
    for b in range(B):
        for t in range(T):
            if reset[b, t]:
                tshift[:, b], cshift[:, b], S[:, b] = 0.0, 0.0, 0.0
            x = _layer_norm(p["emb"][tokens[b, t]], p["ln0"]["weight"], p["ln0"]["bias"])
            v_first = None
            for l in range(L):
                at = {k: v[l] for k, v in blk["att"].items() if k != "ln_x"}
                xn = _layer_norm(x, blk["ln1"]["weight"][l], blk["ln1"]["bias"][l])
                xx = tshift[l, b] - xn
                tshift[l, b] = xn
                xr, xw, xk, xv, xa, xg = (xn + xx * at["x_" + m] for m in "rwkvag")
                r, k, v = xr @ at["receptance"], xk @ at["key"], xv @ at["value"]
                w = -np.exp(-0.5) * _sigmoid(at["w0"] + np.tanh(xw @ at["w1"]) @ at["w2"])
                if l == 0:
                    v_first = v
                else:
                    v = v + (v_first - v) * _sigmoid(at["v0"] + (xv @ at["v1"]) @ at["v2"])
                a = _sigmoid(at["a0"] + (xa @ at["a1"]) @ at["a2"])
                g = _sigmoid(xg @ at["g1"]) @ at["g2"]
                kk = (k * at["k_k"]).reshape(H, N)
                kk = kk / np.maximum(np.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)
                k = k * (1 + (a - 1) * at["k_a"])
                rh, kh, vh, ah = (z.reshape(H, N) for z in (r, k, v, a))
                y = np.zeros((H, N))
                for h in range(H):
                    trans = np.diag(np.exp(w.reshape(H, N)[h])) + np.outer(-kk[h], kk[h] * ah[h])
                    S[l, b, h] = S[l, b, h] @ trans + np.outer(vh[h], kh[h])
                    y[h] = S[l, b, h] @ rh[h]
                mean = y.mean(-1, keepdims=True)
                var = ((y - mean) ** 2).mean(-1, keepdims=True)
                y = ((y - mean) / np.sqrt(var + N * 1e-5)).reshape(C)
                y = y * blk["att"]["ln_x"]["weight"][l] + blk["att"]["ln_x"]["bias"][l]
                y = y + ((rh * kh * at["r_k"]).sum(-1, keepdims=True) * vh).reshape(C)
                x = x + (y * g) @ at["output"]

                ff = {k: v[l] for k, v in blk["ffn"].items()}
                xn2 = _layer_norm(x, blk["ln2"]["weight"][l], blk["ln2"]["bias"][l])
                kx = xn2 + (cshift[l, b] - xn2) * ff["x_k"]
                cshift[l, b] = xn2
                x = x + np.square(np.maximum(kx @ ff["key"], 0.0)) @ ff["value"]
            xo = _layer_norm(x, p["ln_out"]["weight"], p["ln_out"]["bias"])
            logits[b, t] = xo @ p["head"]
    new_state = {"tmix_shift": tshift, "cmix_shift": cshift, "wkv": np.swapaxes(S, -1, -2)}
    return logits, new_state
