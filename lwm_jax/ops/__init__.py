"""Operators shared by the model families; one home per op, each a public function with its
implementations, kernels, custom gradients and the rule that picks among them (`impl=`).

  `wkv7/`             RWKV-7's WKV op: `from lwm_jax.ops.wkv7 import wkv7`
  `layer_norm`        LayerNorm, float32 statistics; Pallas kernels over transposed activations
  `group_norm`        per-group GroupNorm (RWKV-7's `ln_x`); a Pallas backward
  `squared_relu_mlp`  `relu(x W_key)² W_value`; Pallas GEMMs with the square in the epilogue
  `xent`              the loss chunk's cross-entropy statistics and logits gradient
  `segments`          packed-document helpers (`segment_ids_from_cu_seqlens`)
  `kernel_choice`     the rule the Pallas-kernel knobs share (`Runtime.*_impl`; a leaf)

Imports nothing itself, so importing one op loads only what that op needs.
"""
