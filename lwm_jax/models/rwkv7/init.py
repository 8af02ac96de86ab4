"""RWKV-7 initialisation (current RWKV-LM rule, see the spec section "Initialisation").

Per-channel profiles for channel n in [0, C), layer l in [0, L):
  ratio0 = l / (L - 1)   (0 when L = 1)      ratio1 = 1 - l / L
  ddd_n = n / C          linear_n = n / (C - 1) - 0.5
  zigzag_n = z|z|, z = ((n mod N) - (N-1)/2) / ((N-1)/2)
  www_n = -6 + 6 (n / (C - 1)) ** (1 + ratio0 ** 0.3)

The vector formulas are deterministic float64 NumPy (no key); the matrices are semi-orthogonal
(`orthogonal`), built from a JAX key so the whole model init is reproducible and traceable
(`nnx.eval_shape` works). Matrices use the `x @ W` layout `[C_in, C_out]`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

EMB_RANGE = 1e-4        # emb ~ U(-1e-4, 1e-4)
LORA_GAIN = 0.1         # w2, a2, v2, g2
GAINS = {"receptance": 1.0, "key": 0.1, "value": 1.0, "ffn_key": 1.0}


def layer_ratios(layer_id: int, n_layer: int) -> tuple[float, float]:
    """`(ratio0, ratio1) = (l / (L - 1), 1 - l / L)`; ratio0 = 0 for a single-layer model."""
    if not 0 <= layer_id < n_layer:
        raise ValueError(f"layer_id {layer_id} outside [0, {n_layer})")
    ratio0 = layer_id / (n_layer - 1) if n_layer > 1 else 0.0
    return ratio0, 1.0 - layer_id / n_layer


def channel_profiles(C: int, N: int) -> dict[str, np.ndarray]:
    """float64 `[C]` profiles `ddd`, `linear`, `zigzag` (see module docstring)."""
    n = np.arange(C, dtype=np.float64)
    half = (N - 1) / 2 if N > 1 else 1.0
    z = ((n % N) - (N - 1) / 2) / half
    return {"ddd": n / C, "linear": n / max(C - 1, 1) - 0.5, "zigzag": z * np.abs(z)}


def time_mix_vectors(layer_id: int, n_layer: int, C: int, N: int) -> dict[str, np.ndarray]:
    """TimeMix vector parameters of one layer (float64 NumPy).

    Returns `x_r, x_w, x_k, x_v, x_a, x_g, w0, a0, v0, k_k, k_a` (`[C]`), `r_k` (`[H, N]`) and
    `ln_x_weight` (`[C]`, the GroupNorm weight `((l + 1) / L) ** 0.7`).
    """
    ratio0, ratio1 = layer_ratios(layer_id, n_layer)
    prof = channel_profiles(C, N)
    ddd, linear, zigzag = prof["ddd"], prof["linear"], prof["zigzag"]
    www = -6.0 + 6.0 * (np.arange(C) / max(C - 1, 1)) ** (1.0 + ratio0 ** 0.3)
    return {
        "x_r": 1.0 - ddd ** (0.2 * ratio1),
        "x_w": 1.0 - ddd ** (0.9 * ratio1),
        "x_k": 1.0 - ddd ** (0.7 * ratio1),
        "x_v": 1.0 - ddd ** (0.7 * ratio1),
        "x_a": 1.0 - ddd ** (0.9 * ratio1),
        "x_g": 1.0 - ddd ** (0.2 * ratio1),
        "w0": www + 0.5 + 2.5 * zigzag,
        "a0": -0.19 + 0.3 * zigzag + 0.4 * linear,
        "v0": 0.73 - 0.4 * linear,
        "k_k": 0.71 - 0.1 * linear,
        "k_a": np.full(C, 1.02),
        "r_k": np.full((C // N, N), -0.04),
        "ln_x_weight": np.full(C, ((layer_id + 1) / n_layer) ** 0.7),
    }


def channel_mix_vectors(layer_id: int, n_layer: int, C: int) -> dict[str, np.ndarray]:
    """ChannelMix `x_k = 1 - ddd ** (ratio1 ** 4)` (`[C]`, float64)."""
    _, ratio1 = layer_ratios(layer_id, n_layer)
    return {"x_k": 1.0 - channel_profiles(C, 1)["ddd"] ** (ratio1 ** 4)}


def stacked_vectors(fn, n_layer: int, *args) -> dict[str, np.ndarray]:
    """Stack `fn(l, n_layer, *args)` over layers: every entry gets a leading `[L]` axis."""
    per_layer = [fn(l, n_layer, *args) for l in range(n_layer)]
    return {k: np.stack([d[k] for d in per_layer]) for k in per_layer[0]}


def orthogonal(key, shape: tuple[int, ...], gain: float, dtype: Any = jnp.float32):
    """Semi-orthogonal matrix (or batch of them) times `gain`.

    For the trailing `[m, n]`: if m >= n the columns are orthonormal (`WᵀW = gain² I_n`), else
    the rows (`WWᵀ = gain² I_m`); same convention as torch's `orthogonal_` on the transposed
    weight. Built from a Gaussian by QR, with the signs of `diag(R)` folded into Q so the result
    is uniformly (Haar) distributed and a deterministic function of `key`. Leading dims = batch.
    Jitted (one compile per shape/gain/dtype). Outside a trace the result is waited for, so
    only one LAPACK QR is ever in flight: two batched QRs running at once can deadlock XLA:CPU's
    intra-op thread pool on a 2-core machine (both wait for pool threads the other holds).
    """
    q = _orthogonal(key, tuple(shape), float(gain), dtype)
    if not isinstance(q, jax.core.Tracer):
        q.block_until_ready()
    return q


@functools.partial(jax.jit, static_argnames=("shape", "gain", "dtype"))
def _orthogonal(key, shape, gain, dtype):
    *batch, m, n = shape
    big, small = max(m, n), min(m, n)
    a = jax.random.normal(key, (*batch, big, small), jnp.float32)
    if batch:   # one matrix at a time: see `_haar_q`
        q = jax.lax.map(_haar_q, a.reshape(-1, big, small)).reshape(a.shape)
    else:
        q = _haar_q(a)
    if m < n:
        q = jnp.swapaxes(q, -1, -2)
    return (gain * q).astype(dtype)


def _haar_q(a):
    """Q of `a` `[m, n]` (m >= n) with the signs of `diag(R)` folded in (Q is then unique).

    Called per matrix, never on a batch: on GPU a batched QR runs cuSOLVER's batched,
    unblocked kernel, which took nearly all of the 1.5B model's state init on an H100 (its
    square `[L, C, C]` receptance/key/value stacks); one matrix at a time the same stacks
    measured far faster (`benchmarks/init_time.py --qr --profile`; figures in
    benchmarks/RESULTS-log.md). Same values on CPU either way (LAPACK loops).
    """
    q, r = jnp.linalg.qr(a, mode="reduced")
    sign = jnp.sign(jnp.diagonal(r))
    return q * jnp.where(sign == 0, 1.0, sign)[None, :]


@functools.partial(jax.jit, static_argnames=("V", "C", "dtype"))
def embedding(key, V: int, C: int, dtype: Any = jnp.float32):
    """`[V, C]` uniform in `(-1e-4, 1e-4)`."""
    return jax.random.uniform(key, (V, C), jnp.float32, -EMB_RANGE, EMB_RANGE).astype(dtype)


def head_gain(V: int, C: int) -> float:
    """Output head gain: `0.5 * sqrt(V / C)` if V > C, else 0.5."""
    return 0.5 * float(np.sqrt(V / C)) if V > C else 0.5


def head(key, C: int, V: int, dtype: Any = jnp.float32):
    """`[C, V]` (x @ head layout) semi-orthogonal with gain `head_gain(V, C)`."""
    return orthogonal(key, (C, V), head_gain(V, C), dtype)
