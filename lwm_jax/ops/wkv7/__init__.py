"""The RWKV-7 WKV op (generalized delta rule), FLA layout, fp32 state.

The op is the function `wkv7`: `from lwm_jax.ops.wkv7 import wkv7`.

Modules (imports only point down this list; `contract` imports nothing of the package):
  `dispatch`          the public `wkv7`: validation, then recurrent / chunked / Pallas
  `sequence_parallel` `wkv7` over sequence slices on a mesh axis
  `pallas`            the Pallas kernel of the current backend (`pallas_gpu/`, `pallas_tpu/`)
  `chunked`           chunk-parallel pure JAX; `chunk_math`: its per-chunk algebra
  `recurrent`         the token scan (exact fp32, no matmuls)
  `reference`         float64 NumPy recurrence; `testing`: random inputs, float64 gradients
  `tril_inverse`      the blocked unit-lower-triangular inverse every chunked path uses
  `tile_dots`         2-D tile products with float32 accumulation (both kernels' tiles)
  `contract`          input checks, dtypes, precision names, decay bound, chunk limits (a leaf)
"""
from lwm_jax.ops.wkv7.contract import PRECISIONS
from lwm_jax.ops.wkv7.dispatch import IMPLS, wkv7
from lwm_jax.ops.wkv7.reference import wkv7_reference_np
from lwm_jax.ops.wkv7.sequence_parallel import shift_across_slices, wkv7_sequence_parallel

__all__ = ["IMPLS", "PRECISIONS", "shift_across_slices", "wkv7", "wkv7_reference_np",
           "wkv7_sequence_parallel"]
