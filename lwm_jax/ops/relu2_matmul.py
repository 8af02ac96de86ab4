"""Squared-ReLU GEMMs with the activation in the epilogue, as Pallas-Triton kernels.

RWKV-7's ChannelMix is `out = relu(x @ W_key)² @ W_value`. XLA runs the key product as a Triton
GEMM and the square as a separate pass over the `[M, F]` hidden layer (F = 4C), and in the
backward the input-gradient product of W_value and the square's gradient as two passes again:
XLA's GEMM fusion only takes epilogues that distribute over addition. These two kernels do each
pair in one launch, from 16-bit operands with a float32 accumulator:

    relu2_matmul_pallas:       h    = relu(x @ w)²            x `[M, K]`, w `[K, N]`
    relu2_matmul_grad_pallas:  dpre = (dy @ wᵀ) * 2 sqrt(h)   dy `[M, K]`, w `[N, K]`, h `[M, N]`

(x and dy passed transposed, `[K, M]`: the layout XLA keeps them in.)

Both round once, from the float32 accumulator (XLA's form rounds the product to the compute
dtype before squaring, and the hidden gradient before scaling it). `sqrt(h)` stands for
`relu(x @ w)` as in `models.rwkv7.channel_mix.squared_relu`. One program per `[BM, BN]` output
tile loops over K in `BK` steps; tiles and pipeline depth chosen from eight on an H100
(benchmarks/RESULTS.md, session 24; at 8192 x 2048 -> 8192 the forward kernel takes 0.434 ms
against XLA's 0.440 for the product alone and 0.530 with the square, the backward one 0.481
against 0.574). `lwm_jax.layers.squared_relu_mlp` wires them into ChannelMix.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BM, BN, BK = 128, 256, 64    # output tile rows / columns, K step
NUM_WARPS, NUM_STAGES = 8, 4
_F32 = jnp.float32


def kernel_applies(M: int, K: int, N: int) -> bool:
    """Whether `[M, K] x [K, N]` tiles exactly (the kernels take no ragged edges)."""
    return M > 0 and M % BM == 0 and N % BN == 0 and K % BK == 0


def _check(name, M, K, N):
    if not kernel_applies(M, K, N):
        raise ValueError(f"{name}: [{M}, {K}] x [{K}, {N}] does not tile by ({BM} rows, {BK} "
                         f"deep, {BN} columns); use the XLA form (kernel_applies)")


def _accumulate(xt_ref, w_ref, n_k, w_transposed):
    """float32 `[BM, BN]` = this tile's `x @ w` (or `x @ wᵀ`), BK rows of K at a time, from the
    activations' transpose `xt` `[K, BM]`."""
    def body(i, acc):
        xs = xt_ref[pl.ds(i * BK, BK), :]
        if w_transposed:
            ws, w_dim = w_ref[:, pl.ds(i * BK, BK)], 1
        else:
            ws, w_dim = w_ref[pl.ds(i * BK, BK), :], 0
        return acc + jax.lax.dot_general(xs, ws, (((0,), (w_dim,)), ((), ())),
                                         preferred_element_type=_F32)

    return jax.lax.fori_loop(0, n_k, body, jnp.zeros((BM, BN), _F32))


def _relu2_kernel(xt_ref, w_ref, h_ref, *, n_k):
    pre = jnp.maximum(_accumulate(xt_ref, w_ref, n_k, w_transposed=False), 0.0)
    h_ref[...] = (pre * pre).astype(h_ref.dtype)


def _relu2_grad_kernel(dyt_ref, w_ref, h_ref, dpre_ref, *, n_k):
    dh = _accumulate(dyt_ref, w_ref, n_k, w_transposed=True)
    dpre_ref[...] = (dh * (2.0 * jnp.sqrt(h_ref[...].astype(_F32)))).astype(dpre_ref.dtype)


def _params():
    return plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


@functools.partial(jax.jit, static_argnames=("interpret",))
def relu2_matmul_pallas(xt_KM, w_KN, *, interpret: bool = False):
    """`relu(x @ w)²` `[M, N]` in x's dtype (float32 accumulation, one rounding).

    Args:
      xt_KM: the activations transposed, `xᵀ` `[K, M]` (16-bit): XLA keeps ChannelMix's input
        tokens-minor (`[C, B, T]` in memory), so `x.T` is a free view where `x` would be a copy.
      w_KN: `[K, N]` weight in the same dtype.
      interpret: run in the Pallas interpreter (CPU tests).
    """
    K, M = xt_KM.shape
    N = w_KN.shape[1]
    _check("relu2_matmul_pallas", M, K, N)
    return pl.pallas_call(
        functools.partial(_relu2_kernel, n_k=K // BK), grid=(M // BM, N // BN),
        in_specs=[pl.BlockSpec((K, BM), lambda i, j: (0, i)),
                  pl.BlockSpec((K, BN), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((BM, BN), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((M, N), xt_KM.dtype),
        compiler_params=_params(), interpret=interpret, name="relu2_matmul",
    )(xt_KM, w_KN)


@functools.partial(jax.jit, static_argnames=("interpret",))
def relu2_matmul_grad_pallas(dyt_KM, w_NK, h_MN, *, interpret: bool = False):
    """`(dy @ wᵀ) * 2 sqrt(h)` `[M, N]` in dy's dtype: the gradient of the squared ReLU's input,
    given the transposed cotangent `dyᵀ` `[K, M]` of `h @ w` (w `[N, K]`, the value weight;
    transposed for the reason `relu2_matmul_pallas` gives) and the saved `h` `[M, N]`."""
    K, M = dyt_KM.shape
    N = w_NK.shape[0]
    _check("relu2_matmul_grad_pallas", M, K, N)
    tile = pl.BlockSpec((BM, BN), lambda i, j: (i, j))
    return pl.pallas_call(
        functools.partial(_relu2_grad_kernel, n_k=K // BK), grid=(M // BM, N // BN),
        in_specs=[pl.BlockSpec((K, BM), lambda i, j: (0, i)),
                  pl.BlockSpec((BN, K), lambda i, j: (j, 0)), tile],
        out_specs=tile, out_shape=jax.ShapeDtypeStruct((M, N), dyt_KM.dtype),
        compiler_params=_params(), interpret=interpret, name="relu2_matmul_grad",
    )(dyt_KM, w_NK, h_MN)
