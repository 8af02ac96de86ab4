"""Causal grouped-query self-attention on TPU through JAX's Pallas splash-attention kernel.

`splash_self_attention` runs `jax.experimental.pallas.ops.tpu.splash_attention` (a flash-style
Mosaic kernel with a custom VJP: no `[T, T]` scores in memory, softmax statistics (running max,
sum, logsumexp) in float32 inside the kernel, products accumulated in float32) on our layout:

- Layout: our `[B, T, H, D]` queries and `[B, T, K, D]` keys/values become the kernel's
  head-major `[H, T, D]` / `[K, T, D]` per batch row; the kernel is `jax.vmap`-ed over B.
- Heads: the kernel's multi-head form (`make_splash_mha`) takes K key/value heads with
  `H % K == 0` itself (query head h reads kv head `h // (H // K)`, and the dK/dV backward
  kernel sums over the H / K query heads of a group), so keys/values are neither repeated
  (H / K times the kv memory traffic) nor split into K multi-query calls (K launches).
- Scale: the kernel computes `softmax(q k^T)` without `1/sqrt(D)` (its reference takes plain
  `q k^T` logits); we multiply q by `1/sqrt(D)` in float32 and round once to q's dtype.
- Masks: causal always (`CausalMask` per head); packed documents through the kernel's
  `SegmentIds` (a query sees a key only inside its own segment). Every row keeps its diagonal,
  so no softmax row is empty.
- Blocks: every block size is the largest of 512, 256, 128 that divides T (128 is the kernel's
  minimum: the key block is a multiple of the 128 TPU lanes). T not a multiple of 128 is a
  one-line ValueError here; `lwm_jax.layers.attention.self_attention` checks
  `splash_supported` first and silently keeps XLA for such T.
- `interpret=True` runs the kernels in Pallas' interpreter (any backend; how the CPU tests run).

Numerics: the kernel's matmuls take no precision argument, so on a TPU they run at Mosaic's
default. For bfloat16 inputs the query-key products are exact with float32 accumulation, and the
probabilities meet v (upcast) in a float32 dot whose default rounds them to bf16 at most, as the
XLA path does explicitly; for float32 inputs the default would be one bf16 MXU pass whatever the
policy asked, which is why `self_attention` sends only bfloat16 here. Gradients come from the
kernel's own dQ and dK/dV kernels (float32 accumulation, logsumexp saved by the forward).

Sharding: the kernel is an opaque custom call that XLA's partitioner cannot split (it would
gather the whole batch onto every chip), so on a mesh of several devices
`splash_self_attention_sharded` runs it per chip inside a `shard_map`: rows over the batch axes
(`data`, `fsdp`), heads over `tensor` when it divides both head counts, T whole (a mesh that
splits T keeps XLA's attention: `layers.attention`). Compiled by the real TPU compiler for v4,
v5e, v5p and v6e (tests/layers/test_attention_tpu.py); numerics tested in the interpreter;
never run on TPU hardware here.

Works with jax 0.10.x and 0.11.x (the splash-attention sources are identical in both).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lwm_jax.mesh_axes import BATCH_AXES

MIN_BLOCK = 128
_BLOCKS = (512, 256, 128)


def _splash():
    """The splash-attention module, or a one-line error when this jax lacks what we use."""
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention as sa
        for name in ("make_splash_mha", "CausalMask", "MultiHeadMask", "SegmentIds",
                     "BlockSizes"):
            getattr(sa, name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"attention_tpu: jax {jax.__version__} has no usable Pallas splash "
                           f"attention ({e}); install jax 0.10.x or 0.11.x") from None
    return sa


def splash_supported(T: int) -> bool:
    """True when the kernel takes a sequence of T positions (T a positive multiple of 128)."""
    return T > 0 and T % MIN_BLOCK == 0


def block_size(T: int) -> int:
    """The largest of 512, 256, 128 that divides T (T a multiple of 128)."""
    if not splash_supported(T):
        raise ValueError(f"attention_tpu: sequence length {T} is not a multiple of {MIN_BLOCK} "
                         f"(the splash kernel's minimum block); pad T or use the XLA path")
    return next(b for b in _BLOCKS if T % b == 0)


def block_sizes(T: int):
    """`BlockSizes` for T: one block size for the forward, dQ and dK/dV kernels (separate dQ
    kernel: the fused backward would keep a float32 dQ per key block)."""
    b = block_size(T)
    return _splash().BlockSizes(block_q=b, block_kv=b, block_kv_compute=b,
                                block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b,
                                block_q_dq=b, block_kv_dq=b)


def make_kernel(T: int, H: int, *, interpret: bool = False):
    """The splash kernel for causal attention of H query heads over T positions (one device)."""
    sa = _splash()
    mask = sa.MultiHeadMask([sa.CausalMask((T, T)) for _ in range(H)])
    return sa.make_splash_mha(mask, block_sizes=block_sizes(T), head_shards=1, q_seq_shards=1,
                              interpret=interpret)


def splash_self_attention(q_BTHD, k_BTKD, v_BTKD, *, segment_ids_BT=None,
                          interpret: bool = False):
    """`softmax(q k^T / sqrt(D) + causal [+ segment] mask) v` through the splash kernel.

    Args:
      q_BTHD: queries `[B, T, H, D]` (bfloat16 on a TPU; float32 works, see the module note).
      k_BTKD, v_BTKD: keys/values `[B, T, K, D]`, `H % K == 0`; cast to q's dtype.
      segment_ids_BT: optional int `[B, T]` packed-document ids (a query sees only keys of its
        own id; causal too).
      interpret: run the Pallas kernels in the interpreter (CPU tests).
    Returns:
      `[B, T, H, D]` in q's dtype. Differentiable in q, k, v.
    """
    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    if H % K:
        raise ValueError(f"attention_tpu: {H} query heads are not a multiple of {K} key/value "
                         f"heads")
    if k_BTKD.shape != (B, T, K, D) or v_BTKD.shape != k_BTKD.shape:
        raise ValueError(f"attention_tpu: keys {k_BTKD.shape} and values {v_BTKD.shape} must "
                         f"both be [B, T, K, D] = [{B}, {T}, K, {D}] for queries {q_BTHD.shape}")
    dtype = q_BTHD.dtype
    kernel = make_kernel(T, H, interpret=interpret)
    scaled = (q_BTHD.astype(jnp.float32) * (1.0 / math.sqrt(D))).astype(dtype)
    q_BHTD = jnp.swapaxes(scaled, 1, 2)
    k_BKTD = jnp.swapaxes(k_BTKD.astype(dtype), 1, 2)
    v_BKTD = jnp.swapaxes(v_BTKD.astype(dtype), 1, 2)
    if segment_ids_BT is None:
        out_BHTD = jax.vmap(kernel)(q_BHTD, k_BKTD, v_BKTD)
    else:
        seg_BT = jnp.asarray(segment_ids_BT, jnp.int32)
        if seg_BT.shape != (B, T):
            raise ValueError(f"attention_tpu: segment_ids_BT has shape {seg_BT.shape}, expected "
                             f"[B, T] = [{B}, {T}]")
        SegmentIds = _splash().SegmentIds

        def one_row(q_HTD, k_KTD, v_KTD, seg_T):
            return kernel(q_HTD, k_KTD, v_KTD, segment_ids=SegmentIds(q=seg_T, kv=seg_T))
        out_BHTD = jax.vmap(one_row)(q_BHTD, k_BKTD, v_BKTD, seg_BT)
    return jnp.swapaxes(out_BHTD, 1, 2)


def splash_self_attention_sharded(q_BTHD, k_BTKD, v_BTKD, *, mesh=None, segment_ids_BT=None,
                                  interpret: bool = False):
    """`splash_self_attention` run per device of `mesh` (None or one device: a plain call).

    Rows are split over the mesh's batch axes (`data`, `fsdp`) when B divides over them, heads
    over `tensor` when it divides both H and K; every device runs the kernel on its own rows and
    heads with T whole. Same arguments and result as `splash_self_attention`.
    """
    if mesh is None or mesh.size == 1:
        return splash_self_attention(q_BTHD, k_BTKD, v_BTKD, segment_ids_BT=segment_ids_BT,
                                     interpret=interpret)
    B, _, H, _ = q_BTHD.shape
    K = k_BTKD.shape[2]
    size = lambda axes: math.prod(mesh.shape.get(a, 1) for a in axes)  # noqa: E731
    rows = tuple(a for a in BATCH_AXES if a in mesh.shape) if B % size(BATCH_AXES) == 0 else ()
    t = mesh.shape.get("tensor", 1)
    heads = "tensor" if t > 1 and H % t == 0 and K % t == 0 else None
    x_spec = P(rows or None, None, heads, None)
    specs, args = [x_spec] * 3, [q_BTHD, k_BTKD, v_BTKD]
    if segment_ids_BT is not None:
        specs.append(P(rows or None, None))
        args.append(jnp.asarray(segment_ids_BT, jnp.int32))

    def per_device(q, k, v, *seg):
        return splash_self_attention(q, k, v, segment_ids_BT=seg[0] if seg else None,
                                     interpret=interpret)
    # The Mosaic call's outputs carry no varying-axis types, which shard_map's check rejects.
    fn = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs), out_specs=x_spec,
                       check_vma=False)
    return fn(*args)
