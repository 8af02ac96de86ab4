"""The two-operand einsum specs whose gradient products a custom VJP writes by hand."""
from __future__ import annotations


def einsum_terms(spec: str, where: str = "Policy.einsum") -> tuple[str, str, str]:
    """`(x's indices, y's indices, output's indices)` of `spec` ("btc,cd->btd" -> "btc", "cd",
    "btd"). The backward products `out,y->x` and `x,out->y` exist only for a spec with two
    operands, an explicit output, no ellipsis and every operand index in the output or in the
    other operand; any other spec is a one-line ValueError naming `where`."""
    lhs, arrow, out = spec.replace(" ", "").partition("->")
    xs, comma, ys = lhs.partition(",")
    if not arrow or not comma or "." in spec or any(
            c not in out + ys for c in xs) or any(c not in out + xs for c in ys):
        raise ValueError(f"{where}: spec {spec!r} needs two operands, an explicit '->', no "
                         "ellipsis, and every operand index in the output or the other operand")
    return xs, ys, out
