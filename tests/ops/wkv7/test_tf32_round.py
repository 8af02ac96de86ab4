"""The GPU kernels' TF32 products with operands rounded in the kernel (`pallas_gpu.tf32_round`).

On CPU: the rule that picks the product form, and the lowering for CUDA (no GPU needed): every
TF32 dot of the chunk-parallel kernels carries the attribute that keeps XLA's rounding pass off
it, and its operands come from the one-instruction rounding. Marked `gpu`: the rounding itself
against a NumPy round-to-nearest-even on the bits, and the op's errors against float64 with and
without the kernel's rounding.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.ops.wkv7.pallas_gpu import tf32_round
from lwm_jax.ops.wkv7.pallas_gpu.launches import Tuning
from lwm_jax.ops.wkv7.tile_dots import mm, mm_nt, mm_tn

HIGHEST, DEFAULT, HIGH = (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT,
                          jax.lax.Precision.HIGH)


def test_kernel_precision_rule():
    """The rounded form replaces TF32 precisions only, never in the interpreter, never when
    turned off; `wanted=True` forces it off a GPU (offline lowering for sm_90)."""
    kp = tf32_round.kernel_precision
    assert tf32_round.available()           # this JAX has the Pallas-Triton lowering table
    for prec in (DEFAULT, HIGH):
        rounded = kp(prec, interpret=False, wanted=True)
        assert isinstance(rounded, tf32_round.RoundedTF32) and rounded.base is prec
        assert kp(prec, interpret=True, wanted=True) is prec
        assert kp(prec, interpret=False, wanted=False) is prec
    assert kp(HIGHEST, interpret=False, wanted=True) is HIGHEST
    tf32x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert kp(tf32x3, interpret=False, wanted=True) is tf32x3
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:                               # auto: only on a GPU of compute capability >= 9
        assert kp(DEFAULT, interpret=False, wanted=None) is DEFAULT


def test_tile_dots_use_a_precision_object_that_forms_its_own_product():
    """`tile_dots` hands the product to a precision object with `tile_dot`, with the
    contraction dims of mm / mm_tn / mm_nt."""
    seen = []

    class Fake:
        def tile_dot(self, x, y, contract):
            seen.append(contract)
            return jax.lax.dot_general(x, y, (contract, ((), ())))

    x, y = jnp.ones((4, 3)), jnp.ones((3, 5))
    assert mm(x, y, Fake()).shape == (4, 5)
    assert mm_tn(jnp.ones((3, 4)), y, Fake()).shape == (4, 5)
    assert mm_nt(x, jnp.ones((5, 3)), Fake()).shape == (4, 5)
    assert seen == [((1,), (0,)), ((0,), (0,)), ((1,), (1,))]


def _lowered(round_tf32: bool) -> dict[str, str]:
    """`{kernel name: Triton IR}` of one bf16 fwd+bwd (Triton chains) lowered for CUDA at the
    production shape (K = V = 64, C = 32)."""
    from lwm_jax.ops.wkv7.pallas_gpu.op import wkv7_gpu
    from lwm_jax.ops.wkv7.testing import lowered_triton_kernels
    xs = [jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)] * 6
    tune = Tuning(round_tf32=round_tf32, split_out=True)      # out_fwd lowered as well

    def loss(xs):
        o, sT = wkv7_gpu(*xs, None, None, 32, None, tuning=tune)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(sT)
    try:
        kernels = lowered_triton_kernels(jax.grad(loss), xs)
    except (ImportError, AttributeError):
        kernels = []
    if not kernels:            # the hook saw nothing: JAX lowers Pallas-Triton calls elsewhere
        pytest.skip("this JAX lowers Pallas-Triton calls without the hooked function")
    return {k["name"]: k["ttir"] for k in kernels}


def test_lowered_kernels_mark_every_tf32_dot_and_round_its_operands():
    """With `round_tf32` every TF32 `tt.dot` of the chunk-parallel launches is marked
    `tf32_arguments_rounded`, and each operand of a marked dot is the result of the
    one-instruction `cvt.rn.tf32.f32` (or a transpose of one): a marked dot with an unrounded
    operand would leave the hardware truncating it. The sequential launches and `out_fwd` keep
    XLA's rounding (no faster with the kernel's), as does everything without `round_tf32`."""
    dot = re.compile(r"(%\S+) = tt\.dot (%[^,]+), (%[^,]+), %[^,]+, inputPrecision = tf32(.*)")
    kernels = _lowered(True)
    assert {"wkv7_intra_fwd", "wkv7_intra_bwd", "wkv7_seq_fwd", "wkv7_seq_bwd",
            "wkv7_out_fwd"} <= set(kernels)
    for name, ir in kernels.items():
        dots = dot.findall(ir)
        assert dots, name
        if name not in ("wkv7_intra_fwd", "wkv7_intra_bwd"):
            assert tf32_round.ROUNDED_ATTR not in ir and "cvt.rn.tf32.f32" not in ir, name
            continue
        rounded = set(re.findall(r"(%\S+) = tt\.elementwise_inline_asm \"cvt\.rn\.tf32\.f32", ir))
        rounded |= {t for t, x in re.findall(r"(%\S+) = tt\.trans (%[^ ]+)", ir) if x in rounded}
        for _, a, b, rest in dots:
            assert tf32_round.ROUNDED_ATTR in rest, (name, rest)
            assert a in rounded and b in rounded, (name, a, b)
        assert len(dots) >= 12, name
    for name, ir in _lowered(False).items():
        assert tf32_round.ROUNDED_ATTR not in ir and "cvt.rn.tf32.f32" not in ir, name


def _tf32_rn_reference(x: np.ndarray) -> np.ndarray:
    """float32 rounded to 10 stored mantissa bits, to nearest, ties to even (finite x)."""
    bits = x.view(np.uint32).astype(np.uint64)
    lsb = (bits >> 13) & 1
    out = ((bits + 0xFFF + lsb) & ~np.uint64(0x1FFF)) & 0xFFFFFFFF
    return out.astype(np.uint32).view(np.float32)


@pytest.mark.gpu
def test_gpu_round_tf32_is_round_to_nearest_even_and_keeps_non_finite():
    from jax.experimental import pallas as pl
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 128)) * np.exp(rng.uniform(-30, 30, (16, 128)))).astype(
        np.float32)
    bits = x.view(np.uint32)
    bits[0, :32] = (bits[0, :32] & ~np.uint32(0x1FFF)) | 0x1000      # exact ties
    bits[1, :32] = (bits[1, :32] & ~np.uint32(0x3FFF)) | 0x1000      # ties on an even TF32 lsb
    x[2, :4] = [np.inf, -np.inf, np.nan, -np.nan]
    x[3, :4] = [1e-40, -1e-42, 3e38, -3.4e38]                          # subnormal, near max

    def kernel(x_ref, o_ref):
        o_ref[...] = tf32_round.round_tf32(x_ref[...])
    got = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        jnp.asarray(x)))
    finite = np.isfinite(x) & (np.abs(x) < 3.39e38)
    np.testing.assert_array_equal(got[finite].view(np.uint32),
                                  _tf32_rn_reference(x[finite]).view(np.uint32))
    assert np.isposinf(got[2, 0]) and np.isneginf(got[2, 1])
    assert np.isnan(got[2, 2]) and np.isnan(got[2, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [False, True])
def test_gpu_kernel_rounding_keeps_the_errors(segments):
    """The op with the kernels' own rounding against XLA's (ties to even instead of away): each
    output's and gradient's error against float64 within 2% (+1e-6) of the other's, and inside
    the compiled kernel's bounds (o <= 2e-3, every gradient <= 3e-3)."""
    from lwm_jax.ops.wkv7.pallas import wkv7_pallas
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
    B, T, H, D = 2, 600, 4, 64
    key = jax.random.PRNGKey(11)
    xs = random_wkv7_inputs(key, B, T, H, D, D, jnp.bfloat16)
    ks = jax.random.split(jax.random.fold_in(key, 1), 3)
    s0 = 0.5 * jax.random.normal(ks[0], (B, H, D, D))
    seg = (jnp.cumsum(jax.random.uniform(ks[1], (B, T)) < 0.01, axis=1).astype(jnp.int32)
           if segments else None)
    do = jax.random.normal(ks[2], (B, T, H, D), jnp.float32).astype(jnp.bfloat16)
    dsT = jax.random.normal(jax.random.fold_in(key, 2), (B, H, D, D), jnp.float32)
    ref_o, ref_s, ref_g = wkv7_reference_vjp_f64(xs, s0, seg, np.asarray(do, np.float64), dsT)

    def errors(flag):
        f = lambda xs, s0: wkv7_pallas(*xs, s0, seg, 32, None,  # noqa: E731
                                       tuning=Tuning(round_tf32=flag))
        (o, sT), vjp = jax.vjp(f, xs, s0)
        gxs, gs0 = vjp((do, dsT))
        errs = {"o": rel_err(o, ref_o), "sT": rel_err(sT, ref_s),
                "ds0": rel_err(gs0, ref_g["initial_state"])}
        errs.update({f"d{n}": rel_err(g, ref_g[n]) for n, g in zip("rwkvab", gxs)})
        return errs
    mine, xla = errors(True), errors(False)
    assert mine["o"] <= 2e-3 and max(mine.values()) <= 3e-3, mine
    for name in mine:
        assert mine[name] <= 1.02 * xla[name] + 1e-6, (name, mine, xla)
