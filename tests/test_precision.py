"""Precision policy parsing (`lwm_jax.precision`), dynamic loss scaling (`lwm_jax.loss_scale`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.loss_scale import DynamicLossScale, NoLossScale, all_finite, loss_scale_for
from lwm_jax.precision import PRESETS, Policy, parse_policy


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_parse_to_themselves(name):
    assert parse_policy(name) is PRESETS[name]
    assert parse_policy(f"  {name.upper()} ") is PRESETS[name]
    assert parse_policy(PRESETS[name]) is PRESETS[name]


def test_preset_table():
    got = {n: (jnp.dtype(p.param_dtype).name, jnp.dtype(p.compute_dtype).name,
               jnp.dtype(p.output_dtype).name, p.matmul_precision, p.loss_scale)
           for n, p in PRESETS.items()}
    assert got == {
        "fp32": ("float32", "float32", "float32", "highest", "none"),
        "fp32-fast": ("float32", "float32", "float32", "default", "none"),
        "bf16-mixed": ("float32", "bfloat16", "float32", "default", "none"),
        "fp16-mixed": ("float32", "float16", "float32", "default", "dynamic"),
        "bf16": ("bfloat16", "bfloat16", "float32", "default", "none"),
    }


def test_key_value_strings_and_defaults():
    p = parse_policy("p=f32,c=bf16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16,
                                                                jnp.float32)
    assert (p.matmul_precision, p.loss_scale, p.name) == ("default", "none", "p=f32,c=bf16")
    p = parse_policy("c=f16")
    assert p.param_dtype == jnp.float32 and p.loss_scale == "dynamic"
    p = parse_policy("p=bf16")                      # compute defaults to the param dtype
    assert p.compute_dtype == jnp.bfloat16 and p.matmul_precision == "default"
    p = parse_policy("p=f32, c=f32, o=bf16, m=high, s=none")
    assert p.output_dtype == jnp.bfloat16 and p.matmul_precision == "high"
    assert parse_policy("p=float32,c=float32").matmul_precision == "highest"


@pytest.mark.parametrize("spec,match", [
    ("bf17-mixed", "valid presets: fp32, fp32-fast, bf16-mixed, fp16-mixed, bf16"),
    ("p=f32,c=bf8", "valid dtypes: .*bf16.*f16.*f32"),
    ("p=f32,x=bf16", "keys are p=param, c=compute"),
    ("p=f32,c", "bad part 'c'"),
    ("", "presets: fp32"),
    ("p=f32,m=fastest", "is not one of \\('default', 'high', 'highest'\\)"),
    ("p=f32,s=static", "is not one of \\('none', 'dynamic'\\)"),
])
def test_bad_specs_name_the_valid_choices(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_non_string_spec_is_rejected():
    with pytest.raises(ValueError, match="expected a preset name"):
        parse_policy(16)


def test_einsum_casts_operands_and_returns_requested_dtype():
    pol = PRESETS["bf16-mixed"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 5)), jnp.float32)
    y = pol.einsum("ij,jk->ik", x, w)
    assert y.dtype == jnp.bfloat16
    ref = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(w.astype(jnp.bfloat16),
                                                                       np.float64)
    y32 = pol.einsum("ij,jk->ik", x, w, out_dtype=jnp.float32)
    assert y32.dtype == jnp.float32 and np.abs(np.asarray(y32) - ref).max() < 1e-5
    assert pol.einsum_f32("ij,jk->ik", x.astype(jnp.bfloat16), w).dtype == jnp.float32
    tree = pol.cast_to_compute({"a": x, "i": jnp.arange(3)})
    assert tree["a"].dtype == jnp.bfloat16 and tree["i"].dtype == jnp.int32
    assert pol.lax_precision == jax.lax.Precision.DEFAULT
    assert PRESETS["fp32"].lax_precision == jax.lax.Precision.HIGHEST


def test_policy_validates_fields():
    with pytest.raises(ValueError, match="matmul precision"):
        Policy("x", matmul_precision="fast")
    with pytest.raises(ValueError, match="loss scale"):
        Policy("x", loss_scale="static")


def test_dynamic_loss_scale_halves_on_overflow_and_doubles_after_interval():
    ls = DynamicLossScale.create(initial_scale=1024.0, growth_interval=3)
    assert float(ls.scale_loss(jnp.asarray(2.0, jnp.bfloat16))) == 2048.0
    grads = {"w": jnp.asarray([2048.0, -1024.0], jnp.float16)}
    un = ls.unscale(grads)
    assert un["w"].dtype == jnp.float32 and np.array_equal(np.asarray(un["w"]), [2.0, -1.0])
    ls = ls.adjust(jnp.asarray(False))                       # overflow: halve, reset counter
    assert (float(ls.scale), int(ls.good_steps)) == (512.0, 0)
    for expected_good in (1, 2):
        ls = ls.adjust(jnp.asarray(True))
        assert (float(ls.scale), int(ls.good_steps)) == (512.0, expected_good)
    ls = ls.adjust(jnp.asarray(True))                        # 3rd finite step in a row: double
    assert (float(ls.scale), int(ls.good_steps)) == (1024.0, 0)
    ls = ls.adjust(jnp.asarray(True)).adjust(jnp.asarray(False))   # overflow resets the streak
    assert (float(ls.scale), int(ls.good_steps)) == (512.0, 0)


def test_dynamic_loss_scale_respects_bounds_and_jits():
    ls = DynamicLossScale.create(initial_scale=2.0, growth_interval=1, min_scale=1.0,
                                 max_scale=4.0)
    step = jax.jit(lambda s, ok: s.adjust(ok))
    assert float(step(step(ls, False), False).scale) == 1.0
    assert float(step(step(step(ls, True), True), True).scale) == 4.0
    assert step(ls, True).scale.dtype == jnp.float32 and step(ls, True).good_steps.dtype == \
        jnp.int32


def test_overflowing_step_is_detected_for_skipping():
    finite = {"a": jnp.ones(3, jnp.float16), "i": jnp.arange(2)}
    assert bool(all_finite(finite))
    assert not bool(all_finite({"a": jnp.asarray([1.0, jnp.inf], jnp.float16)}))
    assert not bool(all_finite({"a": jnp.asarray([jnp.nan], jnp.float32), "b": jnp.ones(2)}))
    assert bool(all_finite({}))
    # the intended skip: keep the old params when grads are not finite
    ls = DynamicLossScale.create(initial_scale=8.0)
    grads = {"a": jnp.asarray([jnp.inf], jnp.float16)}
    ok = all_finite(grads)
    params = jnp.asarray([1.0])
    new_params = jnp.where(ok, params - ls.unscale(grads)["a"], params)
    assert float(new_params[0]) == 1.0 and float(ls.adjust(ok).scale) == 4.0


def test_loss_scale_for_policy():
    assert isinstance(loss_scale_for(PRESETS["fp16-mixed"]), DynamicLossScale)
    none = loss_scale_for(PRESETS["bf16-mixed"])
    assert isinstance(none, NoLossScale)
    g = {"a": jnp.ones(2)}
    assert none.unscale(g) is g and none.adjust(jnp.asarray(False)) is none
    assert none.scale_loss(jnp.asarray(3.0, jnp.bfloat16)).dtype == jnp.float32
