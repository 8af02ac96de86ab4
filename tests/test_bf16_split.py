"""`lwm_jax.precision.bf16_split`: float32 products from bf16 pieces, against float64 on fresh random
operands (never zeros), beside what an IEEE float32 product and plain bf16 products give."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from lwm_jax.precision.bf16_split import bf16_pieces, split_einsum

F32, BF16 = jnp.float32, jnp.bfloat16


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def _operands(seed, x_shape, y_shape, x_dtype=F32):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, x_shape, F32).astype(x_dtype)
    y = jax.random.normal(ky, y_shape, F32) * 0.3
    return x, y


def test_three_pieces_are_exactly_the_float32_value():
    x = jax.random.normal(jax.random.PRNGKey(0), (4096,), F32) * 10.0 ** jnp.arange(-3, 5)[
        jax.random.randint(jax.random.PRNGKey(1), (4096,), 0, 8)]
    pieces = bf16_pieces(x, 3)
    assert all(p.dtype == BF16 for p in pieces)
    total = sum(np.asarray(p, np.float64) for p in pieces)
    x64 = np.asarray(x, np.float64)
    np.testing.assert_array_equal(total, x64)
    two = sum(np.asarray(p, np.float64) for p in bf16_pieces(x, 2))
    assert np.max(np.abs(two - x64) / np.abs(x64)) > 2.0 ** -20     # two pieces are not enough


def test_pieces_survive_xla_dropping_round_trips():
    # jitted, where XLA may treat a float32 -> bf16 -> float32 round trip as excess precision
    x = jax.random.normal(jax.random.PRNGKey(2), (1024,), F32)
    pieces = jax.jit(lambda v: bf16_pieces(v, 3))(x)
    assert float(jnp.max(jnp.abs(pieces[1].astype(F32)))) > 0     # residuals really exist
    total = sum(np.asarray(p, np.float64) for p in pieces)
    np.testing.assert_array_equal(total, np.asarray(x, np.float64))


@pytest.mark.parametrize("spec,x_shape,y_shape", [
    ("btr,rc->btc", (2, 64, 96), (96, 256)),         # the decay LoRA's second product
    ("bc,cr->br", (128, 512), (512, 64)),
    ("rb,rc->bc", (96, 128), (96, 256)),             # contracted axis first on both sides
])
def test_two_split_operands_match_ieee_float32(spec, x_shape, y_shape):
    x, y = _operands(3, x_shape, y_shape)
    ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(y, np.float64))
    got = split_einsum(spec, x, y, x_pieces=3, y_pieces=3)
    assert got.dtype == F32
    ieee = jnp.einsum(spec, x, y, precision="highest", preferred_element_type=F32)
    assert _rel(got, ref) < 2 * _rel(ieee, ref) + 1e-7
    plain = jnp.einsum(spec, x.astype(BF16), y.astype(BF16), preferred_element_type=F32)
    assert _rel(plain, ref) > 100 * _rel(got, ref)      # what the pieces buy


@pytest.mark.parametrize("exact_side", ["x", "y"])
def test_one_bf16_operand_is_one_exact_piece(exact_side):
    # the decay LoRA's first product: a bf16 activation times a float32 weight
    x, y = _operands(5, (2, 64, 512), (512, 96), x_dtype=BF16)
    spec = "btc,cr->btr"
    if exact_side == "y":
        spec, x, y = "cr,btc->btr", y, x
    ref = np.einsum(spec, np.asarray(x, np.float64), np.asarray(y, np.float64))
    pieces = dict(x_pieces=1, y_pieces=3) if exact_side == "x" else dict(x_pieces=3, y_pieces=1)
    got = split_einsum(spec, x, y, **pieces)
    ieee = jnp.einsum(spec, x.astype(F32), y.astype(F32), precision="highest",
                      preferred_element_type=F32)
    assert _rel(got, ref) < 2 * _rel(ieee, ref) + 1e-7


def test_two_contracted_indices_with_a_split_x_are_refused():
    x, y = _operands(7, (4, 8, 16), (8, 16, 32))
    with pytest.raises(ValueError, match="exactly one"):
        split_einsum("bij,ijc->bc", x, y, x_pieces=3, y_pieces=1)
    with pytest.raises(ValueError, match="exactly one"):
        split_einsum("bij,ijc->bc", x, y, x_pieces=3, y_pieces=3)
