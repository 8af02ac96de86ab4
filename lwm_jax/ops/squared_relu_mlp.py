"""The squared-ReLU MLP `relu(x W_key)² W_value` (RWKV-7's ChannelMix): the op
`squared_relu_mlp` and its forms.

`squared_relu_mlp(x, key, value, *, policy, impl, platform, mesh, probe)` runs:

    "xla"                  `Policy.einsum` products with `squared_relu` between them (under a
                           float16 compute dtype from a power-of-two-scaled copy, below)
    "pallas" / "interpret" `squared_relu_mlp_fused`: the key product writes `relu(.)²` from its
                           float32 accumulator (`relu2_matmul_pallas`) and, in the backward,
                           the value weight's input-gradient product writes the
                           pre-activation's gradient `dh * 2 sqrt(h)`
                           (`relu2_matmul_grad_pallas`): one pass over the `[M, F]` hidden
                           layer fewer each way ("interpret": in the Pallas interpreter)
    "auto"                 the kernels on one GPU under a bf16 compute dtype when the shapes
                           tile (`kernel_applies`) and no probe is given, else XLA's form; on
                           a mesh "pallas" runs them per device (`kernel_choice`)

(`impl` is `Runtime.ffn_impl`; the rule is `kernel_choice.kernel_chosen`.) On the kernel path
the value product and the weight-gradient products stay XLA GEMMs; operands are cast to the
16-bit compute dtype, every product accumulates in float32, and each gradient comes back in
its input's dtype (float32 parameters get float32 gradients), as `Policy.einsum`'s do.

fp16 (`fp16-mixed`): the square overflows float16 (max 65504) once a pre-activation passes 256,
which trained RWKV-7 models reach. Under a float16 compute dtype the squared activations are
therefore formed from a power-of-two-scaled copy, `(relu(k W) / s)²` with `s = 2^n` chosen from
the tensor's peak so that every entry stays <= 128² (scaling by a power of two is exact), and
`s²` is multiplied back after the value matmul, in float32. The result equals the unscaled
formula wherever that one is finite; bf16 and fp32 (no overflow below 3e38) are untouched.

The kernels. XLA runs the key product as a Triton GEMM and the square as a separate pass over
the `[M, F]` hidden layer (F = 4C), and in the backward the input-gradient product of W_value
and the square's gradient as two passes again: XLA's GEMM fusion only takes epilogues that
distribute over addition. These two kernels do each pair in one launch, from 16-bit operands
with a float32 accumulator:

    relu2_matmul_pallas:       h    = relu(x @ w)²            x `[M, K]`, w `[K, N]`
    relu2_matmul_grad_pallas:  dpre = (dy @ wᵀ) * 2 sqrt(h)   dy `[M, K]`, w `[N, K]`, h `[M, N]`

(x and dy passed transposed, `[K, M]`: the layout XLA keeps them in.) Both round once, from
the float32 accumulator (XLA's form rounds the product to the compute dtype before squaring,
and the hidden gradient before scaling it). `sqrt(h)` stands for `relu(x @ w)` as in
`squared_relu`. One program per `[BM, BN]` output tile loops over K in `BK` steps; tiles and
pipeline depth chosen from eight on an H100 (timings: benchmarks/RESULTS.md, "ChannelMix's
squared ReLU inside its GEMMs").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lwm_jax.ops.kernel_choice import (auto_pays_on, kernel_chosen, on_each_device,
                                        per_device_tokens)
from lwm_jax.remat_names import MATMUL_OUTPUT_NAME

BM, BN, BK = 128, 256, 64    # output tile rows / columns, K step
NUM_WARPS, NUM_STAGES = 8, 4
FP16_HIDDEN_PEAK = 128.0   # scaled activations stay <= 128, so their squares <= 16384 < 65504
_F32 = jnp.float32


def squared_relu_mlp(x_BTC, key_CF, value_FC, *, policy, impl: str = "xla",
                     platform: str | None = None, mesh=None, probe=None, fp8_metas=None):
    """`relu(x @ key)² @ value` in `policy.compute_dtype`, as `impl` says.

    Args:
      x_BTC: `[B, T, C]` input in the compute dtype.
      key_CF, value_FC: `[C, F]`, `[F, C]` weights (any float dtype; cast to the compute dtype).
      policy: the precision `Policy` (compute dtype, matmul precision, `einsum`).
      impl: "xla" (default), "pallas", "interpret" or "auto" (see the module docstring).
      platform: "cpu" | "gpu" | "tpu", the platform the program is compiled for (None: JAX's
        default devices'; read by "auto" only).
      mesh: the device mesh x is split over as the activations are (None: one device). "auto"
        and "pallas" run the kernels per device, the weights whole on each, when the mesh
        splits tokens only ("auto" not under FSDP, `kernel_choice.auto_pays_on`; on a mesh
        that splits more "auto" keeps XLA's form and "pallas" is an error).
      probe: optional `probe(name, x)` tap (`lwm_jax.probe`) on XLA's form: the hidden
        layer (`hidden`, `[B, T, F]`) and the output (`out`). The kernels take none.
      fp8_metas: `(key meta, value meta)` under an FP8 policy (`lwm_jax.precision.fp8`): both
        products run as FP8 GEMMs in XLA's form (the kernels have no FP8 path; "auto" then
        picks XLA's form).
    Returns:
      `[B, T, C]` in `policy.compute_dtype`.
    """
    cd = policy.compute_dtype
    B, T, C = x_BTC.shape
    F = key_CF.shape[-1]
    M = per_device_tokens(mesh, x_BTC.shape)
    if kernel_chosen(
            "ffn_impl", impl, per_device=M is not None, platform=platform,
            fits=(jnp.dtype(cd) == jnp.bfloat16 and probe is None and M is not None
                  and fp8_metas is None and kernel_applies(M, C, F)),
            pays=auto_pays_on(mesh), kernel="the Pallas ChannelMix GEMMs",
            needs=f"a bf16 compute dtype (not FP8 GEMMs), no probe and tokens x channels x "
                  f"hidden {B * T} x {C} x {F} in multiples of the kernel tiles "
                  "(ops.squared_relu_mlp.kernel_applies)"):
        def local(x, key, value):
            b, t, _ = x.shape
            out = squared_relu_mlp_fused(x.reshape(b * t, C), key, value, jnp.dtype(cd),
                                         policy.lax_precision, impl == "interpret")
            return out.astype(cd).reshape(b, t, C)
        out = on_each_device(local, mesh, x_BTC, key_CF, value_FC)
        return checkpoint_name(out, MATMUL_OUTPUT_NAME)
    key_meta, value_meta = fp8_metas or (None, None)
    pre = policy.einsum("btc,cf->btf", x_BTC, key_CF, fp8_meta=key_meta)
    if jnp.dtype(cd) == jnp.float16:
        hidden, out = _squared_relu_fp16(policy, jax.nn.relu(pre), value_FC)
    else:
        hidden = squared_relu(pre)
        out = policy.einsum("btf,fc->btc", hidden, value_FC, fp8_meta=value_meta)
    if probe is not None:
        probe("hidden", hidden)
        probe("out", out)
    return out


def _squared_relu_fp16(policy, act_BTF, value_FC):
    """`(relu², relu² @ W_value)` under float16 without overflow (see the module docstring).

    Returns the scaled hidden layer (what the value matmul sees, float16) and the output in the
    compute dtype. `s` is a constant for autodiff (the product is exactly independent of it).
    """
    act32 = act_BTF.astype(jnp.float32)
    peak = jax.lax.stop_gradient(jnp.max(act32))
    scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(peak, FP16_HIDDEN_PEAK) / FP16_HIDDEN_PEAK)))
    hidden = jnp.square(act32 / scale).astype(act_BTF.dtype)
    out = policy.einsum("btf,fc->btc", hidden, value_FC, out_dtype=jnp.float32) * (scale * scale)
    return hidden, out.astype(policy.compute_dtype)


@jax.custom_vjp
def squared_relu(x):
    """`relu(x)²` in x's dtype, keeping only its own output for the backward.

    The gradient `2 relu(x) dy` takes `relu(x)` as the square root of the output, which the
    value matmul keeps anyway (its backward needs it): no `[B, T, F]` array is saved for this
    function alone. `sqrt(round(relu(x)²))` is `relu(x)` to half the output's rounding (bf16:
    within 2^-10 relative), and the product is formed in float32 and rounded once to dy's
    dtype, so the gradient is within one rounding of autodiff's
    (tests/models/rwkv7/test_squared_relu.py, against float64).
    """
    return jnp.square(jax.nn.relu(x))


def _squared_relu_fwd(x):
    out = jnp.square(jax.nn.relu(x))
    return out, out


def _squared_relu_bwd(out, dy):
    f32 = jnp.float32
    return ((dy.astype(f32) * (2 * jnp.sqrt(out.astype(f32)))).astype(dy.dtype),)


squared_relu.defvjp(_squared_relu_fwd, _squared_relu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def squared_relu_mlp_fused(x_MC, key_CF, value_FC, compute_dtype, precision, interpret: bool):
    """`relu(x @ key)² @ value`, float32 `[M, C]`, on the kernels (see the module docstring).

    Args:
      x_MC: `[M, C]` input, M = tokens (`kernel_applies(M, C, F)`: the forward's and the
        backward's kernel products are both `[M, C] x [C, F]`).
      key_CF, value_FC: the weights (any float dtype; cast to `compute_dtype`).
      compute_dtype: the 16-bit dtype every product takes its operands in.
      precision: `jax.lax.Precision` of the XLA products (the policy's).
      interpret: run the kernels in the Pallas interpreter (tests).
    """
    return _fused_forward(x_MC, key_CF, value_FC, compute_dtype, precision, interpret)[0]


def _fused_forward(x, key, value, cd, precision, interpret):
    """The forward value and, for `_fused_backward`, the 16-bit operands and `h` it keeps."""
    x_c, key_c, value_c = (a.astype(cd) for a in (x, key, value))
    hidden = checkpoint_name(relu2_matmul_pallas(x_c.T, key_c, interpret=interpret),
                             MATMUL_OUTPUT_NAME)
    out = jnp.einsum("mf,fc->mc", hidden, value_c, precision=precision,
                     preferred_element_type=_F32)
    protos = tuple(np.zeros((0,), a.dtype) for a in (x, key, value))
    return out, (x_c, key_c, value_c, hidden, protos)


def _fused_backward(cd, precision, interpret, res, d_out):
    x_c, key_c, value_c, hidden, (x_p, key_p, value_p) = res
    dy = d_out.astype(cd)
    d_value = jnp.einsum("mf,mc->fc", hidden, dy, precision=precision,
                         preferred_element_type=_F32)
    d_pre = relu2_matmul_grad_pallas(dy.T, value_c, hidden, interpret=interpret)
    dx = jnp.einsum("mf,cf->mc", d_pre, key_c, precision=precision, preferred_element_type=_F32)
    d_key = jnp.einsum("mc,mf->cf", x_c, d_pre, precision=precision,
                       preferred_element_type=_F32)
    return dx.astype(x_p.dtype), d_key.astype(key_p.dtype), d_value.astype(value_p.dtype)


squared_relu_mlp_fused.defvjp(_fused_forward, _fused_backward)


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
