"""Operators shared by the model families.

`wkv7/`: the RWKV-7 WKV op (public `wkv7`, its implementations, kernels and references);
`segments`: packed-document helpers; `xent`: the loss chunk's cross-entropy statistics and
logits gradient (plain JAX and one Pallas-Triton kernel). `from lwm_jax.ops import wkv7` gives
the op's package, which is callable: `wkv7(r, w, k, v, a, b, ...)` runs the op
(`lwm_jax.ops.wkv7.dispatch.wkv7`).
"""
from lwm_jax.ops import wkv7
from lwm_jax.ops.segments import segment_ids_from_cu_seqlens
from lwm_jax.ops.wkv7 import (IMPLS, shift_across_slices, wkv7_reference_np,
                              wkv7_sequence_parallel)

__all__ = ["IMPLS", "segment_ids_from_cu_seqlens", "shift_across_slices", "wkv7",
           "wkv7_reference_np", "wkv7_sequence_parallel"]
