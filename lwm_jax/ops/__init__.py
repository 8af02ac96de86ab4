"""WKV7 operators: the public `wkv7` op, its pure-JAX implementations and a float64 reference.

Modules: `wkv7_op` (the op: validation + dispatch), `wkv7_recurrent` (token scan),
`wkv7_chunked` + `wkv7_chunk_math` (chunk-parallel form), `wkv7_reference` (float64 NumPy),
`segments` (packed documents), `testing` (random RWKV-7-like inputs, float64 gradients).
"""
from lwm_jax.ops.segments import segment_ids_from_cu_seqlens
from lwm_jax.ops.wkv7_op import IMPLS, wkv7
from lwm_jax.ops.wkv7_reference import wkv7_reference_np
from lwm_jax.ops.wkv7_sequence_parallel import shift_across_slices, wkv7_sequence_parallel

__all__ = ["IMPLS", "segment_ids_from_cu_seqlens", "shift_across_slices", "wkv7",
           "wkv7_reference_np", "wkv7_sequence_parallel"]
