"""The squared-ReLU MLP `relu(x W_key)² W_value` with its activation inside the GEMMs.

`squared_relu_mlp_fused` computes what RWKV-7's ChannelMix computes with `Policy.einsum` and
`models.rwkv7.channel_mix.squared_relu`, but the key product writes `relu(.)²` from its float32
accumulator (`ops.relu2_matmul.relu2_matmul_pallas`) and, in the backward, the value weight's
input-gradient product writes the pre-activation's gradient `dh * 2 sqrt(h)`
(`relu2_matmul_grad_pallas`): one pass over the `[M, F]` hidden layer fewer each way. The
value product and the weight-gradient products stay XLA GEMMs. Operands are cast to the 16-bit
compute dtype, every product accumulates in float32, and each gradient comes back in its
input's dtype (float32 parameters get float32 gradients), as `Policy.einsum`'s do.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.ops.relu2_matmul import relu2_matmul_grad_pallas, relu2_matmul_pallas
from lwm_jax.precision import MATMUL_OUTPUT_NAME

_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def squared_relu_mlp_fused(x_MC, key_CF, value_FC, compute_dtype, precision, interpret: bool):
    """`relu(x @ key)² @ value`, float32 `[M, C]`.

    Args:
      x_MC: `[M, C]` input, M = tokens (`ops.relu2_matmul.kernel_applies(M, C, F)`: the
        forward's and the backward's kernel products are both `[M, C] x [C, F]`).
      key_CF, value_FC: the weights (any float dtype; cast to `compute_dtype`).
      compute_dtype: the 16-bit dtype every product takes its operands in.
      precision: `jax.lax.Precision` of the XLA products (the policy's).
      interpret: run the kernels in the Pallas interpreter (tests).
    """
    return _forward(x_MC, key_CF, value_FC, compute_dtype, precision, interpret)[0]


def _forward(x, key, value, cd, precision, interpret):
    """The forward value and, for `_fused_bwd`, the 16-bit operands and `h` it keeps."""
    x_c, key_c, value_c = (a.astype(cd) for a in (x, key, value))
    hidden = checkpoint_name(relu2_matmul_pallas(x_c.T, key_c, interpret=interpret),
                             MATMUL_OUTPUT_NAME)
    out = jnp.einsum("mf,fc->mc", hidden, value_c, precision=precision,
                     preferred_element_type=_F32)
    protos = tuple(np.zeros((0,), a.dtype) for a in (x, key, value))
    return out, (x_c, key_c, value_c, hidden, protos)


def _fused_bwd(cd, precision, interpret, res, d_out):
    x_c, key_c, value_c, hidden, (x_p, key_p, value_p) = res
    dy = d_out.astype(cd)
    d_value = jnp.einsum("mf,mc->fc", hidden, dy, precision=precision,
                         preferred_element_type=_F32)
    d_pre = relu2_matmul_grad_pallas(dy.T, value_c, hidden, interpret=interpret)
    dx = jnp.einsum("mf,cf->mc", d_pre, key_c, precision=precision, preferred_element_type=_F32)
    d_key = jnp.einsum("mc,mf->cf", x_c, d_pre, precision=precision,
                       preferred_element_type=_F32)
    return dx.astype(x_p.dtype), d_key.astype(key_p.dtype), d_value.astype(value_p.dtype)


squared_relu_mlp_fused.defvjp(_forward, _fused_bwd)
