"""float32 products from bfloat16 tensor-core passes: IEEE-float32-level accuracy, 16-bit speed.

A float32 value x is exactly the sum of three bfloat16 pieces: `x_hi` = x's leading 8
significant bits, `x_mid` = the next 8 of `x - x_hi`, `x_lo` = the rest (each subtraction is
exact in float32, and bfloat16 has float32's exponent range). A product of two bfloat16
values is exact in float32, so `x @ y` computed from the pieces' products with float32
accumulation has an IEEE float32 matmul's error, up to the accumulation order and the terms
below ~2^-24 of the result that are left out: it keeps the six terms `i + j <= 2` of
`x_i @ y_j` (i, j = 0 hi, 1 mid, 2 lo). An operand that is bfloat16 already (a 16-bit
activation upcast for the product) is one piece, exactly, and then three terms remain.
Measured on an H100: the decay island's largest relative error is of the order of IEEE
float32's, orders of magnitude below TF32's (`benchmarks/decay_products.py` measures error and
time; figures in benchmarks/RESULTS-log.md).

Why: on GPUs XLA runs an IEEE float32 matmul (`Precision.HIGHEST`) off the tensor cores, and
at the skinny shapes of a LoRA (rank 64-256) its own split-product algorithms of float32
accuracy (`DotAlgorithmPreset.BF16_BF16_F32_X6`, `TF32_TF32_F32_X3`) measured barely faster
than it on the 1.5B island, where this module's form was clearly faster than all three
(`benchmarks/decay_products.py`; figures in benchmarks/RESULTS-log.md).
Here the terms of one product become one bfloat16 GEMM: stacked along the output (x a single
piece: y's pieces side by side, x read once) or along the contracted axis (each term's
operands concatenated: for a split x, which should then be the small operand).

A leaf module: imports nothing of `lwm_jax`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_BF16, _F32 = jnp.bfloat16, jnp.float32
MAX_ORDER = 2                       # keep the terms x_i @ y_j with i + j <= MAX_ORDER
_EXACT = jax.lax.Precision.DEFAULT  # bf16 x bf16 products are exact in float32 at any precision


def bf16_pieces(x, n: int) -> list:
    """`n` bfloat16 arrays, largest first, whose float32 sum is `x` (float32): exactly for n = 3,
    to within 2^-(8 n - 1) relative for fewer (n = 1: exact for values that are bf16 numbers).
    n = 1 masks too: a plain cast there (XLA then drops the bf16 -> float32 -> bf16 casts) ran
    the 1.5B step at the same speed with more peak memory (`benchmarks/train_step.py`; figures
    in benchmarks/RESULTS-log.md).

    Each piece keeps the leading 8 significant bits of what is left (the float32 bit pattern with
    its low 16 bits cleared), so the three pieces hold all 24 bits of x. The pieces are made by
    masking bits, not by rounding to bfloat16 and back: XLA on GPUs may drop a float32 ->
    bfloat16 -> float32 round trip as excess precision (`xla_allow_excess_precision`, on by
    default), which made every residual zero and the "split" product a plain bfloat16 one."""
    pieces, rest = [], x.astype(_F32)
    for i in range(n):
        bits = jax.lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000)
        head = jax.lax.bitcast_convert_type(bits, _F32)       # exactly a bfloat16 number
        pieces.append(head.astype(_BF16))
        if i + 1 < n:
            rest = rest - head                                 # exact in float32
    return pieces


def _parse(spec: str) -> tuple[str, str, str]:
    lhs, _, out = spec.replace(" ", "").partition("->")
    xs, _, ys = lhs.partition(",")
    return xs, ys, out


def split_einsum(spec: str, x, y, *, x_pieces: int, y_pieces: int):
    """`einsum(spec, x, y)` as float32 from bfloat16 products of the operands' pieces.

    x, y: float arrays, upcast to float32 and split into `x_pieces` / `y_pieces` (1: the
    operand's values are bfloat16 numbers, used as they are; 3: any float32). A single-piece x
    meets y's pieces stacked along the output; otherwise every term's operands are concatenated
    along the contracted axis, and the spec must contract exactly one index. Returns float32,
    the terms summed smallest first. The products run at an explicit `Precision.DEFAULT`: a
    product of two bfloat16 numbers is exact at any precision, so the backend's fastest bf16
    path is the right one.
    """
    xs, ys, out = _parse(spec)
    px, py = bf16_pieces(x, x_pieces), bf16_pieces(y, y_pieces)
    if x_pieces == 1 and y_pieces == 1:
        return jnp.einsum(spec, px[0], py[0], precision=_EXACT, preferred_element_type=_F32)
    if x_pieces == 1:
        # x (e.g. a large bf16 activation) read once: y's pieces side by side along a new
        # output axis `q`, one GEMM, then the terms summed smallest first
        q = next(c for c in "qQzZ" if c not in spec)
        terms = jnp.einsum(f"{xs},{ys}{q}->{out}{q}", px[0], jnp.stack(py, axis=-1),
                           precision=_EXACT, preferred_element_type=_F32)
        total = terms[..., -1]
        for i in range(terms.shape[-1] - 2, -1, -1):
            total = total + terms[..., i]
        return total
    contracted = [c for c in xs if c in ys and c not in out]
    if len(contracted) != 1:
        raise ValueError(f"split_einsum: {spec!r} contracts {len(contracted)} indices; a split "
                         "x needs exactly one")
    k = contracted[0]
    # every term i + j <= MAX_ORDER in one GEMM: the terms' operands concatenated along k,
    # smallest terms first
    order = sorted(((i, j) for i in range(x_pieces) for j in range(y_pieces)
                    if i + j <= MAX_ORDER), key=lambda ij: -(ij[0] + ij[1]))
    xk = jnp.concatenate([px[i] for i, _ in order], axis=xs.index(k))
    yk = jnp.concatenate([py[j] for _, j in order], axis=ys.index(k))
    return jnp.einsum(spec, xk, yk, precision=_EXACT, preferred_element_type=_F32)
