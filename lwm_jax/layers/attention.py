"""Grouped-query attention: XLA / cuDNN through `jax.nn.dot_product_attention`, splash on TPU,
and the KV cache.

Which kernel runs (`self_attention`, whole-sequence attention: training, scoring, prefill):
- TPU, bfloat16 inputs, T a multiple of 128 (with or without packed-document segment ids): JAX's
  Pallas splash-attention kernel (`lwm_jax.layers.attention_tpu`: flash-style, no `[T, T]`
  scores in memory, float32 softmax statistics). float32 inputs stay on XLA there (the kernel's
  matmuls take no precision, and Mosaic's default is one bf16 pass: `fp32` would not be IEEE
  float32), and so do float16 inputs and other T.
- GPU, 16-bit causal attention without an explicit mask (unpacked rows): cuDNN's fused
  flash-attention kernel (`implementation="cudnn"`, fp32 softmax statistics inside the kernel).
- Everything else, and every cache (decoding) call on any backend: `implementation=None`, which
  in jax 0.10 / 0.11 is always the XLA form.
The XLA form takes the query-key products with
float32 accumulation and float32 output for 16-bit inputs, and the softmax in float32 (tested in
tests/layers/test_attention.py); the probabilities are then cast to the value dtype for the
second product. The matmul precision of float32 inputs is set for the call with
`jax.default_matmul_precision(precision)`, so `fp32` ("highest") attention is IEEE float32 on
GPU and TPU too, not TF32 / one bf16 pass.

Masks: causal always. With `segment_ids_BT` (packed documents), a boolean mask also keeps every
query inside its own segment (splash: the kernel's segment ids). With a cache, query `t` of row
`b` sits at position `length[b] + t` and sees the cache entries `s <= length[b] + t`.

Heads: queries `[B, T, H, D]`, keys/values `[B, S, K, D]` with `H % K == 0` (K = H is plain
multi-head attention, K = 1 multi-query).

Platform: the kernel choice reads the platform the program is compiled for (`platform`, the
model's mesh's devices, `lwm_jax.hardware.platform_of`), never JAX's default backend, so a CPU
host compiling for a TPU topology takes the splash path. On a device mesh of several chips the
splash kernel runs per chip inside a `shard_map` (`attention_tpu.splash_self_attention_sharded`);
a mesh that splits T (`sequence` > 1) keeps XLA's form, which the partitioner can split.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lwm_jax.hardware import platform_of
from lwm_jax.layers.attention_tpu import splash_self_attention_sharded, splash_supported
from lwm_jax.mesh_axes import SEQUENCE_AXIS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every position seen so far (optionally stacked with a leading layer
    axis L on every field).

    k, v: `[B, S_max, K, D]` in the compute dtype; entries at and past `length` are unused.
    length: int32 `[B]`, positions filled per row (rows may differ).
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array


def empty_cache(batch: int, max_len: int, kv_heads: int, head_dim: int, dtype,
                layers: tuple[int, ...] = ()) -> KVCache:
    """Zero cache for `batch` fresh rows of up to `max_len` positions (`layers=(L,)` stacks)."""
    shape = (*layers, batch, max_len, kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((*layers, batch), jnp.int32))


def segment_mask(segment_ids_BT):
    """bool `[B, 1, T, T]`: query t sees key s when `s <= t` and both share a segment id."""
    seg = jnp.asarray(segment_ids_BT)
    T = seg.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    same = seg[:, :, None] == seg[:, None, :]
    return (same & causal)[:, None]


def cache_mask(length_B, T: int, S: int):
    """bool `[B, 1, T, S]`: query t of row b (at position `length[b] + t`) sees entries
    `s <= length[b] + t`."""
    q_pos = length_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    return (jnp.arange(S, dtype=jnp.int32)[None, None, :] <= q_pos[:, :, None])[:, None]


def attend(q_BTHD, k_BSKD, v_BSKD, *, precision: str, mask=None, is_causal: bool = False,
           platform: str | None = None):
    """`softmax(q k^T / sqrt(D) + mask) v` per head group; returns `[B, T, H, D]` in q's dtype.

    `precision`: matmul precision name for float32 inputs ("default" | "high" | "highest").
    `mask`: optional bool `[B, 1, T, S]` (True = attend).
    `platform`: the platform the program is compiled for (None: JAX's default devices').
    """
    H, K = q_BTHD.shape[2], k_BSKD.shape[2]
    if H % K:
        raise ValueError(f"attention: {H} query heads are not a multiple of {K} key/value heads")
    dtype = q_BTHD.dtype
    with jax.default_matmul_precision(precision):
        return jax.nn.dot_product_attention(q_BTHD, k_BSKD.astype(dtype), v_BSKD.astype(dtype),
                                            mask=mask, is_causal=is_causal,
                                            implementation=_implementation(
                                                q_BTHD, mask, platform or platform_of()))


def _implementation(q_BTHD, mask, platform: str):
    """"cudnn" for 16-bit attention without an explicit mask on a GPU (head_dim a multiple of
    8, at most 128: what cuDNN's fused kernel takes); None (JAX's choice: XLA) otherwise."""
    D = q_BTHD.shape[-1]
    if (platform != "gpu" or mask is not None or D > 128 or D % 8
            or jnp.dtype(q_BTHD.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))):
        return None
    return "cudnn"


def self_attention(q_BTHD, k_BTKD, v_BTKD, *, precision: str, segment_ids_BT=None,
                   interpret: bool = False, platform: str | None = None, mesh=None):
    """Causal attention of a whole sequence (training, scoring, prefill without a cache).

    q `[B, T, H, D]`, k/v `[B, T, K, D]`, optional int `segment_ids_BT` `[B, T]`; returns
    `[B, T, H, D]` in q's dtype. On a TPU, bfloat16 inputs with T a multiple of 128 take the
    splash kernel (`interpret=True` runs it in Pallas' interpreter: tests); otherwise XLA/cuDNN.
    `platform`: the platform the program is compiled for (None: JAX's default devices');
    `mesh`: the device mesh the step runs on (None or one device: no `shard_map`).
    """
    platform = platform or platform_of(mesh)
    if _use_splash(q_BTHD, platform, mesh):
        return splash_self_attention_sharded(q_BTHD, k_BTKD, v_BTKD, mesh=mesh,
                                             segment_ids_BT=segment_ids_BT, interpret=interpret)
    if segment_ids_BT is None:
        return attend(q_BTHD, k_BTKD, v_BTKD, precision=precision, is_causal=True,
                      platform=platform)
    return attend(q_BTHD, k_BTKD, v_BTKD, precision=precision,
                  mask=segment_mask(segment_ids_BT), platform=platform)


def _use_splash(q_BTHD, platform: str, mesh) -> bool:
    """Splash on a TPU for bfloat16 queries over T a multiple of 128, T not split over the
    mesh (see the module note)."""
    unsplit_T = mesh is None or mesh.shape.get(SEQUENCE_AXIS, 1) == 1
    return (platform == "tpu" and unsplit_T and splash_supported(q_BTHD.shape[1])
            and jnp.dtype(q_BTHD.dtype) == jnp.dtype(jnp.bfloat16))


def write_cache(cache: KVCache, k_BTKD, v_BTKD) -> KVCache:
    """`cache` with the T new keys/values of each row written at positions `length[b]..+T`
    and `length` advanced by T. The caller keeps `length + T <= S_max` (a write past the end
    would be clamped by XLA, silently)."""
    def put(buf_SKD, new_TKD, start):
        return jax.lax.dynamic_update_slice(buf_SKD, new_TKD.astype(buf_SKD.dtype),
                                            (start, 0, 0))
    k = jax.vmap(put)(cache.k, k_BTKD, cache.length)
    v = jax.vmap(put)(cache.v, v_BTKD, cache.length)
    return KVCache(k, v, cache.length + k_BTKD.shape[1])


def cached_attention(q_BTHD, k_BTKD, v_BTKD, cache: KVCache, *, precision: str):
    """Append the new keys/values to `cache`, then attend over everything cached so far.

    Returns `(out [B, T, H, D], new cache)`. Equal to `self_attention` on the whole history.
    """
    T, S = q_BTHD.shape[1], cache.k.shape[1]
    mask = cache_mask(cache.length, T, S)
    cache = write_cache(cache, k_BTKD, v_BTKD)
    out = attend(q_BTHD, cache.k, cache.v, precision=precision, mask=mask)
    return out, cache
