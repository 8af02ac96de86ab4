"""Precision: one concern in four modules.

- `policy`: the `Policy` (param / compute / output dtype, explicit matmul and WKV precision),
  its presets and parsing, and the einsum / per-channel-parameter helpers that keep float32
  gradients under a 16-bit compute dtype;
- `bf16_split`: float32 products from bfloat16 tensor-core passes (the decay island's LoRA);
- `loss_scale`: dynamic loss scaling for `fp16-mixed`;
- `fp8`: FP8 GEMMs with delayed scaling and their per-site state (`fp8-mixed`).

The policy's public names are re-exported here: `from lwm_jax.precision import parse_policy`.
"""
from lwm_jax.precision.policy import (DTYPES, GEMM_FORMATS, LOSS_SCALES, MATMUL_PRECISIONS,
                                      PRESETS, WKV_PRECISIONS, Policy, check_trailing,
                                      matmul_outputs_saveable, param_add, param_mul,
                                      parse_policy)

__all__ = ["DTYPES", "GEMM_FORMATS", "LOSS_SCALES", "MATMUL_PRECISIONS", "PRESETS",
           "WKV_PRECISIONS", "Policy", "check_trailing", "matmul_outputs_saveable", "param_add", "param_mul", "parse_policy"]
