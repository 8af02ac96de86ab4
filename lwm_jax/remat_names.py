"""The `jax.ad_checkpoint.checkpoint_name`s of the package: the values a remat policy may keep.

A leaf (imports nothing of the package), so the ops, their kernels, `lwm_jax.precision` and the
models name the same values without importing one another. `Runtime(remat_policy="save_dots")`
keeps `MATMUL_OUTPUT_NAME`, `WKV7_RESIDUALS_NAME` and `WKV7_OUTPUT_NAME`
(`lwm_jax.models.rwkv7.model.remat_policy`); the chunked WKV7 form keeps its own two inside its
per-chunk `jax.checkpoint`.
"""

# Every `Policy.einsum` / `einsum_f32` result, in the dtype the method returns it in (and
# ChannelMix's squared-ReLU hidden layer and output on its kernel path).
# `lwm_jax.precision.matmul_outputs_saveable` keeps these values: under a 16-bit policy that is
# the bf16/fp16 product, not the float32 accumulator it is rounded from (JAX's
# `dots_with_no_batch_dims_saveable` keeps the accumulator: twice the memory per matmul).
MATMUL_OUTPUT_NAME = "policy_matmul"

# The WKV7 kernels' saved-for-backward arrays (`lwm_jax.ops.wkv7.pallas_gpu`, `pallas_tpu`).
WKV7_RESIDUALS_NAME = "wkv7_residuals"
# The WKV7 op's output as TimeMix names it.
WKV7_OUTPUT_NAME = "wkv7_out"

# The chunked XLA form's chunk terms and chunk-start states (`[B, H, T, K]`-sized; kept by
# `lwm_jax.ops.wkv7.chunked`'s own checkpoint policy).
WKV7_CHUNK_TERMS_NAME = "wkv7_chunk_terms"
WKV7_CHUNK_STATES_NAME = "wkv7_chunk_states"
