"""Operators shared by the model families.

`wkv7/`: the RWKV-7 WKV op (public `wkv7`, its implementations, kernels and references);
`segments`: packed-document helpers. `from lwm_jax.ops import wkv7` gives the op (a function);
the subpackage's modules import as `lwm_jax.ops.wkv7.<module>`.
"""
from lwm_jax.ops.segments import segment_ids_from_cu_seqlens
from lwm_jax.ops.wkv7 import (IMPLS, shift_across_slices, wkv7, wkv7_reference_np,  # noqa: F811
                              wkv7_sequence_parallel)

__all__ = ["IMPLS", "segment_ids_from_cu_seqlens", "shift_across_slices", "wkv7",
           "wkv7_reference_np", "wkv7_sequence_parallel"]
