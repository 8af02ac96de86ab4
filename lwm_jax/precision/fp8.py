"""FP8 GEMMs with per-tensor delayed scaling: the block matmuls of the `fp8-mixed` policy.

    y = fp8_einsum("btc,cd->btd", x, w, meta, compute_dtype=jnp.bfloat16)

The GEMM is XLA's: each product is a `dot_general` of float8 operands inside our own VJP
(`_scaled_einsum`), the form XLA's GPU compiler rewrites into one cuBLASLt FP8 GEMM (its
"scaled dot" rewrite, which folds the scales into the GEMM and writes the result's dtype
directly). Forward: both operands are scaled and rounded to float8 e4m3 and multiplied with
float32 accumulation; backward: the output gradient is scaled and rounded to float8 e5m2 (more
range, less precision: gradients span more decades than activations) and both gradient
products take it with the saved e4m3 operands. TPUs compile the same dots of float8 operands
(v5e/v5p/v6e keep them; see `lwm-jax compile`); XLA:CPU and the interpreter emulate the float8
types, so CPU tests see the same roundings. `impl="flax"` runs Flax's
`flax.linen.fp8_ops.fp8_scaled_dot_general` instead (the ecosystem's form, kept to measure
against: on an H100 it cost more per step, see benchmarks/RESULTS.md); its scales are not
rounded to powers of two.

Delayed scaling (NVIDIA Transformer Engine's recipe, also Flax's): each of the three tensors of
a GEMM (input, kernel, output gradient) has a scale and a history of its recent absolute
maxima; a step quantizes with the scale computed from the history *before* that step's own
maximum (x / scale is clipped to the format's largest finite value), then appends its maximum.
The scale is rounded up to a power of two (`_delayed`), so scaling is exact. One scale per
tensor, so a single outlier sets the range of the whole tensor; the history lets the scale
follow slow growth and forget a spike after `history` steps.

State layout: one float32 array `meta [3, 1 + history]` per GEMM site, rows (input, kernel,
output gradient), column 0 the scale, columns 1.. the amax history: column 1 the newest, the
older maxima rotating through the rest (only their maximum is ever read; `init_meta`). The
meta is an input of the differentiated loss; what comes back as its "gradient" is the updated
meta (the overwrite-with-gradient convention of `flax.linen.fp8_ops`).
The trainer replaces the old meta by it (`overwrite`), combines micro-batches by their
maximum (`combine_accumulated`: every micro-batch starts from the same meta, so the results
differ only in the newest amax, and the step's amax is the largest), and keeps the old meta
on a skipped step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import fp8_ops

from lwm_jax.precision.einsum_spec import einsum_terms

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
HISTORY = 1024          # amax history length (Transformer Engine's and Flax's default)
ROWS = ("input", "kernel", "output_grad")


class Fp8Meta(nnx.Variable):
    """The delayed-scaling state of one FP8 GEMM site (or a stack of them, leading layer
    axis): `[..., 3, 1 + history]` float32 (module docstring). Not a parameter: the optimizer
    never sees it; the train step overwrites it with the value its backward returns."""


def init_meta(history: int = HISTORY, stack: tuple[int, ...] = ()) -> jax.Array:
    """A fresh meta: every scale 1, every recorded amax 0 (the first step quantizes at scale
    1 and records its amax; the scale follows from the second step)."""
    if history < 1:
        raise ValueError(f"fp8: amax history must be >= 1 step, got {history}")
    scale = jnp.ones((*stack, 3, 1), jnp.float32)
    return jnp.concatenate([scale, jnp.zeros((*stack, 3, history), jnp.float32)], axis=-1)


def check_meta(meta, where: str = "fp8 meta") -> None:
    """One-line ValueError unless `meta` is a float32 `[3, 1 + history]` array."""
    shape = tuple(getattr(meta, "shape", ()))
    if len(shape) != 2 or shape[0] != 3 or shape[1] < 2 or \
            jnp.dtype(getattr(meta, "dtype", None)) != jnp.float32:
        raise ValueError(f"{where}: expected a float32 [3, 1 + history] array (rows input, "
                         f"kernel, output gradient; column 0 the scale), got "
                         f"{getattr(meta, 'dtype', type(meta).__name__)} {shape}")


def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, meta: jax.Array, *,
               compute_dtype=jnp.bfloat16, out_dtype=None, impl: str = "xla",
               fast_grad_accum: bool = False) -> jax.Array:
    """`einsum(spec, x, w)` as an FP8 GEMM with delayed scaling (module docstring).

    Args:
      spec: a two-operand einsum with an explicit output ("btc,cd->btd").
      x: activations (any float dtype; cast to `compute_dtype` before quantizing).
      w: the weight, quantized from its own dtype (a float32 parameter's gradient stays
        float32).
      meta: this site's `[3, 1 + history]` float32 state.
      compute_dtype: x's dtype before quantizing (the policy's compute dtype); quantizing
        divides in float32.
      out_dtype: result dtype (default `compute_dtype`); products accumulate in float32.
      impl: "xla" (default: dots of float8 operands, results scaled after), "xla-dq" (the
        same values from dots of dequantized operands: `_product`) or "flax" (module
        docstring).
      fast_grad_accum: the gradient products at precision DEFAULT (cuBLASLt's fast FP8
        accumulation) instead of HIGHEST; "xla" forms only.
    Returns:
      the product in `out_dtype`. Its VJP gives x's and w's gradients (in their dtypes) and,
      for `meta`, the updated state.
    """
    check_meta(meta, "fp8_einsum: meta")
    if impl in ("xla", "xla-dq"):
        einsum_terms(spec, "fp8_einsum")
        out = jnp.dtype(compute_dtype if out_dtype is None else out_dtype)
        return _scaled_einsum(spec, out, bool(fast_grad_accum), impl == "xla-dq",
                              x.astype(compute_dtype), w, meta)
    if impl != "flax":
        raise ValueError(f"fp8_einsum: impl must be 'xla', 'xla-dq' or 'flax', got {impl!r}")
    # x is quantized from the compute dtype, w from its own (a float32 parameter keeps its
    # bits until the e4m3 rounding); the gradient products' float32 results come back in each
    # operand's dtype (`_cotangent_in_primal_dtype`), w's float32 gradient unrounded
    lhs = _cotangent_in_primal_dtype(x.astype(compute_dtype))
    rhs = _cotangent_in_primal_dtype(w)
    dot = functools.partial(
        fp8_ops.fp8_scaled_dot_general,
        lhs_scale=meta[0, :1], rhs_scale=meta[1, :1], grad_scale=meta[2, :1],
        lhs_amax_history=meta[0, 1:], rhs_amax_history=meta[1, 1:],
        grad_amax_history=meta[2, 1:], quantize_compute_type=compute_dtype)
    y = jnp.einsum(spec, lhs, rhs, preferred_element_type=jnp.float32, _dot_general=dot)
    return y.astype(compute_dtype if out_dtype is None else out_dtype)


@jax.custom_vjp
def _cotangent_in_primal_dtype(x):
    """Identity whose backward casts the incoming cotangent to x's dtype: the FP8 product's
    gradients are float32 (dequantized from its float32 accumulator) whatever its operands'
    dtypes, and a bf16 operand's cotangent must be bf16."""
    return x


def _cotangent_fwd(x):
    return x, jnp.zeros((0,), x.dtype)


def _cotangent_bwd(proto, g):
    return (g.astype(proto.dtype),)


_cotangent_in_primal_dtype.defvjp(_cotangent_fwd, _cotangent_bwd)


def _delayed(row, x, fmax):
    """(the scale to quantize with now `[1]`, the row after recording max|x|) for one
    `[1 + history]` meta row. The scale is the power of two at or above (largest amax of the
    history *before* this step) / (the format's largest finite value), so that amax maps into
    the format's top binade; while that amax is 0 or not finite the old scale stays.
    Transformer Engine's and Flax's delayed-scaling rule (margin 0) with the scale rounded up
    to a power of two, as the MX formats do: quantizing, dequantizing and scaling a product
    are then exact in every float type, the price at most one binade of e4m3's range."""
    scale, history = row[:1], row[1:]
    amax = jnp.max(history)
    mant, expo = jnp.frexp(amax / fmax)              # amax / fmax = mant * 2^expo, mant in [1/2, 1)
    pow2 = jnp.ldexp(jnp.float32(1), jnp.where(mant == 0.5, expo - 1, expo))
    scale = jnp.where((amax > 0) & jnp.isfinite(amax), pow2, scale)
    seen = jnp.max(jnp.abs(x)).astype(jnp.float32)
    history = jnp.roll(history, -1).at[0].set(seen)
    return scale, jnp.concatenate([scale, history])


def _quantize(x, scale, dtype):
    """x / scale rounded to the float8 `dtype`, clipped to its finite range; the division in
    float32 whatever x's dtype (XLA fuses it into the producer: no extra memory pass)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def _product(spec, a, sa, b, sb, dtype, precision, dequantize):
    """einsum(spec) of the float8 `a`, `b` with scales `sa`, `sb` ([1], powers of two), as
    `dtype`. Two forms of the same value, both rewritten by XLA's GPU compiler into one
    cuBLASLt FP8 GEMM that writes `dtype`: `dequantize` multiplies float32 conversions of the
    operands by their scales before the dot (the form the rewriter folds into the GEMM's
    operand scales; other backends then run a float32 dot), otherwise the dot takes the float8
    operands and its `dtype` result is multiplied by the two scales (exact: powers of two),
    which TPUs and XLA:CPU keep as a float8 dot."""
    if dequantize:
        return jnp.einsum(spec, a.astype(jnp.float32) * sa[0], b.astype(jnp.float32) * sb[0],
                          preferred_element_type=dtype, precision=precision)
    y = jnp.einsum(spec, a, b, preferred_element_type=dtype, precision=precision)
    return y * (sa * sb)[0].astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _scaled_einsum(spec, out_dtype, fast_grad_accum, dequantize, x, w, meta):
    """`einsum(spec, x, w)` of x and w quantized to e4m3 with meta's delayed scales, returned
    in `out_dtype`. The VJP quantizes the output gradient to e5m2 and forms both gradient
    products from float8 operands (e5m2 with e4m3), each returned in its operand's dtype;
    meta's cotangent is the updated meta. `fast_grad_accum` lets the gradient products use
    cuBLASLt's fast FP8 accumulation (precision DEFAULT) instead of HIGHEST (the forward
    always does, as Transformer Engine's recipe); `dequantize` picks `_product`'s form."""
    return _scaled_einsum_fwd(spec, out_dtype, fast_grad_accum, dequantize, x, w, meta)[0]


def _scaled_einsum_fwd(spec, out_dtype, fast_grad_accum, dequantize, x, w, meta):
    e4 = float(jnp.finfo(E4M3).max)
    sx, row_x = _delayed(meta[0], x, e4)
    sw, row_w = _delayed(meta[1], w, e4)
    qx, qw = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3)
    y = _product(spec, qx, sx, qw, sw, out_dtype, jax.lax.Precision.DEFAULT, dequantize)
    protos = np.zeros((0,), x.dtype), np.zeros((0,), w.dtype)
    return y, (qx, qw, sx, sw, row_x, row_w, meta[2], protos)


def _scaled_einsum_bwd(spec, out_dtype, fast_grad_accum, dequantize, res, g):
    qx, qw, sx, sw, row_x, row_w, row_g, (x_proto, w_proto) = res
    xs, ys, out = einsum_terms(spec, "fp8_einsum")
    sg, row_g = _delayed(row_g, g, float(jnp.finfo(E5M2).max))
    qg = _quantize(g, sg, E5M2)
    precision = jax.lax.Precision.DEFAULT if fast_grad_accum else jax.lax.Precision.HIGHEST
    dx = _product(f"{out},{ys}->{xs}", qg, sg, qw, sw, x_proto.dtype, precision, dequantize)
    dw = _product(f"{xs},{out}->{ys}", qx, sx, qg, sg, w_proto.dtype, precision, dequantize)
    return dx, dw, jnp.stack([row_x, row_w, row_g])


_scaled_einsum.defvjp(_scaled_einsum_fwd, _scaled_einsum_bwd)


def overwrite(old, returned, finite):
    """The metas after a step: the values the backward `returned` where the step is applied
    (`finite` true), the `old` ones where it is skipped. Pytrees of metas."""
    return jax.tree.map(lambda o, r: jnp.where(finite, r, o), old, returned)


def all_finite(metas) -> jax.Array:
    """bool scalar: every scale and recorded amax of the pytree `metas` is finite."""
    leaves = jax.tree.leaves(metas)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(m)) for m in leaves])) if leaves \
        else jnp.asarray(True)


def combine_accumulated(a, b):
    """Two micro-batches' returned metas as one: their maximum (module docstring)."""
    return jax.tree.map(jnp.maximum, a, b)


def current_amax(meta) -> jax.Array:
    """The amax each row recorded last (`[..., 3]`: input, kernel, output gradient)."""
    return meta[..., 1]


def float8_dots(jaxpr) -> int:
    """How many dot_generals of `jaxpr` (a `jax.core.Jaxpr`; sub-jaxprs included, each counted
    once) take only float8 operands: one per product of an FP8 GEMM in `fp8_einsum`'s default
    form, three per GEMM in a differentiated program (forward, two gradients)."""
    import jax.extend
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and all(
                "float8" in str(v.aval.dtype) for v in eqn.invars):
            count += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += float8_dots(sub)
    return count


def largest_amax(metas: dict) -> str:
    """One phrase naming the FP8 GEMM tensor with the largest recorded amax (the newest
    entry of every site, layer and row): where a diverging FP8 run's values grew most.
    `metas`: a nested dict of `[L, 3, 1 + history]` (or `[3, 1 + history]`) arrays on the host."""
    best = None
    for path, meta in jax.tree_util.tree_flatten_with_path(metas)[0]:
        amax = np.asarray(current_amax(np.asarray(meta)))
        if amax.ndim == 1:
            amax = amax[None]
        layer, row = np.unravel_index(int(np.argmax(amax)), amax.shape)
        value = float(amax[layer, row])
        if best is None or value > best[0]:
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            best = (value, name, int(layer), ROWS[row])
    if best is None:
        return "no FP8 GEMM state"
    value, name, layer, row = best
    return f"largest FP8 amax {value:.4g}: {name} layer {layer} {row}"
