"""TF32 tile products whose operands the kernel rounds itself: one instruction per element.

A float32 `tt.dot` at TF32 precision multiplies only the top 19 bits of each operand. XLA's
Triton pipeline (jaxlib 0.11.2) therefore rewrites every such dot in every Triton kernel, Pallas
ones included, to round both operands first with `cvt.rna.tf32.f32` (round to nearest, ties
away), which sm_90 has no instruction for: ptxas emits three per element (compare with
infinity, add half an ulp, mask), for every operand of every dot. The chunk-parallel WKV
launches are latency-bound sequences of small products, so those instructions cost time
(counts and timings: benchmarks/NOTES-wkv7.md).

Hopper converts float32 to TF32 in one instruction when the rounding is to nearest even
(`cvt.rn.tf32.f32`, SASS `F2FP.TF32.F32.PACK_B`, infinities and NaN kept). The product form
here rounds each operand that way and marks the dot `tf32_arguments_rounded`, the attribute
XLA's pass honours: the tensor cores then read operands whose dropped bits are already zero.
The numbers are those of TF32 products with round-to-nearest-even operands instead of ties
away (they differ only where the 13 dropped bits are exactly one half: the same error bound).

Use: pass a `RoundedTF32` (`ROUNDED[DEFAULT or HIGH]`) as the precision of `tile_dots.mm` /
`mm_tn` / `mm_nt` inside a Pallas-Triton kernel compiled for a GPU of compute capability >= 9.0
(`kernel_precision` decides; the WKV op's chunk-parallel launches ask it, the sequential ones
keep the plain precision); it needs this module's lowering rule for Pallas-Triton, registered
on import through JAX's lowering table (`available()` says whether that worked; where it did
not, callers keep the plain TF32 dot and XLA's rounding).
"""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

_F32 = jnp.float32
ROUNDED_ATTR = "tf32_arguments_rounded"   # the attribute XLA's TF32 rounding pass skips on
_TF32_PRECISIONS = (lax.Precision.DEFAULT, lax.Precision.HIGH)


def round_tf32(x):
    """float32 -> float32 rounded to TF32 (10 stored mantissa bits), to nearest even, by the
    GPU's `cvt.rn.tf32.f32` (Pallas-Triton kernels on sm_90+ only)."""
    from jax.experimental.pallas import triton as plgpu
    return plgpu.elementwise_inline_asm(
        "cvt.rn.tf32.f32 $0, $1;", args=[x.astype(_F32)], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, _F32)])[0]


def _dot_out(x_aval, y_aval, dimension_numbers):
    (cx, cy), _ = dimension_numbers
    shape = tuple(d for i, d in enumerate(x_aval.shape) if i not in cx) + \
        tuple(d for i, d in enumerate(y_aval.shape) if i not in cy)
    return jax.core.ShapedArray(shape, _F32)


def _plain_dot(x, y, *, dimension_numbers):
    return lax.dot_general(x, y, dimension_numbers, precision=lax.Precision.DEFAULT,
                           preferred_element_type=_F32)


rounded_dot_p = jax.extend.core.Primitive("lwm_tf32_rounded_dot")
rounded_dot_p.def_impl(_plain_dot)
rounded_dot_p.def_abstract_eval(_dot_out)
mlir.register_lowering(rounded_dot_p, mlir.lower_fun(_plain_dot, multiple_results=False))


def _register_triton_rule() -> bool:
    """Lower `rounded_dot_p` in Pallas-Triton kernels as JAX lowers a TF32 `dot_general`, plus
    the attribute. False where this JAX has no such table (the product form is then unused)."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as triton_lowering
        table = triton_lowering.triton_lowering_rules
        dot_rule = table[lax.dot_general_p]
    except Exception:   # noqa: BLE001  any failure of these private imports: no rounded form
        return False

    def rule(ctx, x, y, *, dimension_numbers):
        # the dot_general equation JAX would trace for this product gives the parameters its
        # own rule expects, whatever they are in this JAX version
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_in]
        params = jax.make_jaxpr(lambda a, b: _plain_dot(a, b,
                                dimension_numbers=dimension_numbers))(*shapes).eqns[0].params
        out = dot_rule(ctx, x, y, **params)
        op = getattr(out.owner, "operation", out.owner)
        if op.name == "tt.dot":     # else leave it to XLA's rounding: the same products
            op.attributes[ROUNDED_ATTR] = ir.UnitAttr.get()
        return out

    table[rounded_dot_p] = rule
    return True


_REGISTERED = _register_triton_rule()


def available() -> bool:
    """Whether Pallas-Triton kernels can use the `RoundedTF32` products in this JAX."""
    return _REGISTERED


class RoundedTF32:
    """Precision for `tile_dots`: TF32 products of operands rounded by `round_tf32`. `base` is
    the TF32 precision it stands for (DEFAULT or HIGH)."""

    def __init__(self, base):
        self.base = base

    def tile_dot(self, x, y, contract):
        return rounded_dot_p.bind(round_tf32(x), round_tf32(y),
                                  dimension_numbers=(contract, ((), ())))

    def __repr__(self):
        return f"RoundedTF32({self.base})"


ROUNDED = {p: RoundedTF32(p) for p in _TF32_PRECISIONS}


def gpu_rounds_in_one_instruction(device=None) -> bool:
    """Compute capability >= 9.0 (`cvt.rn.tf32.f32` exists from sm_90 on)."""
    try:
        device = device or jax.devices()[0]
        major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
    except (RuntimeError, ValueError):
        return False
    return major >= 9


def kernel_precision(prec, *, interpret: bool, wanted: bool | None):
    """The precision the chunk-parallel launches use for `prec`: `ROUNDED[prec]` for a TF32
    precision when the lowering rule is registered and `wanted` is True, or None on a first
    JAX device of compute capability >= 9.0; else `prec` (interpret mode always `prec`: the
    inline assembly has no interpreter)."""
    if interpret or wanted is False or not _REGISTERED or prec not in _TF32_PRECISIONS:
        return prec
    return ROUNDED[prec] if wanted or gpu_rounds_in_one_instruction() else prec

