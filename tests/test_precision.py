"""Precision policy parsing (`lwm_jax.precision`), dynamic loss scaling (`lwm_jax.precision.loss_scale`)
and what the fp16 train step does with it (unscaled gradients, overflow skip)."""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.precision.loss_scale import DynamicLossScale, NoLossScale, all_finite, loss_scale_for
from lwm_jax.precision import PRESETS, Policy, parse_policy
from lwm_jax.train.config import load_config
from lwm_jax.train.trainer import build_program


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
        "fp8-mixed": ("float32", "bfloat16", "float32", "default", "none"),
    }
    assert {n for n, p in PRESETS.items() if p.gemm == "fp8"} == {"fp8-mixed"}


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


# ---- the fp16 train step (what `lwm-jax train precision=fp16-mixed` compiles) ----------------
# No gradient clipping, so that Adam's first moment holds the gradient itself (clipping and
# Adam's normalisation would hide a gradient that is off by the loss scale).
_FP16_OVERRIDES = ["model.vocab_size=32", "model.n_layer=1", "model.n_embd=32",
                   "model.head_size=16", "runtime.wkv_impl=recurrent", "train.ctx_len=4",
                   "train.batch_size=2", "train.warmup_steps=0", "train.grad_clip=0",
                   "precision=fp16-mixed"]


@pytest.fixture(scope="module")
def fp16_program():
    program = build_program(load_config(None, _FP16_OVERRIDES))
    return program, jax.device_get(program.init_state())


def _placed(program, host_state, scale):
    """A fresh on-device copy of `host_state` with loss scale `scale` (the step donates it)."""
    ls = dataclasses.replace(host_state.loss_scale, scale=np.float32(scale),
                             good_steps=np.int32(0))
    return jax.device_put(dataclasses.replace(host_state, loss_scale=ls), program.state_sh)


_FP16_TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 5)), jnp.int32)


def test_fp16_step_unscales_its_gradients(fp16_program):
    """The gradient the fp16 step reports and feeds to Adam is the loss's gradient, whatever the
    loss scale: a step at scale 2^10 and one at scale 2^4 agree (powers of two are exact).
    Not scale 1: the fused loss hands the trunk its float32 gradient times the scale, so at
    scale 1 more of it lands among fp16's subnormals than at 2^10 (one entry of 1024 then
    differs by an fp16 rounding, 5e-4) -- the reason a loss scale exists."""
    program, host = fp16_program
    scaled, s_metrics = program.train_step(_placed(program, host, 2.0 ** 10), _FP16_TOKENS)
    plain, p_metrics = program.train_step(_placed(program, host, 2.0 ** 4), _FP16_TOKENS)
    assert float(s_metrics["finite"]) == float(p_metrics["finite"]) == 1.0
    assert float(s_metrics["loss_scale"]) == 2.0 ** 10 and float(p_metrics["loss_scale"]) == 16.0
    ratio = float(s_metrics["grad_norm"]) / float(p_metrics["grad_norm"])
    assert abs(ratio - 1) < 1e-4, f"grad_norm at loss scale 2^10 is {ratio:g}x the one at 2^4"
    # Adam's m = 0.1 * gradient. The smallest fp16 gradients can still be subnormal at 2^4
    # (spacing 2^-24 = 6e-8 before unscaling): atol 1e-8 on m.
    mu = lambda st: jax.device_get(st.opt_state[2].mu)   # noqa: E731
    chex.assert_trees_all_close(mu(scaled), mu(plain), rtol=1e-4, atol=1e-8)
    # (The parameters are no witness: Adam's first update is lr * sign(g) whatever g's scale,
    # and a gradient that underflows to 0 at scale 1 flips an entry from +-lr to 0.)


def test_overflowing_fp16_step_is_skipped(fp16_program):
    """The train step's own skip: at the largest loss scale (2^24) the fp16 backward overflows;
    the step leaves parameters and Adam moments bit for bit as they were, counts the step as
    skipped and halves the scale."""
    program, host = fp16_program
    new, metrics = program.train_step(_placed(program, host, 2.0 ** 24), _FP16_TOKENS)
    assert float(metrics["finite"]) == 0.0, "the step at loss scale 2^24 did not overflow"
    assert float(metrics["skipped_steps"]) == 1.0, "the overflowing step was not counted skipped"
    assert int(new.step) == int(host.step) + 1
    assert float(new.loss_scale.scale) == 2.0 ** 23 and int(new.loss_scale.good_steps) == 0
    got = jax.device_get((new.params, new.opt_state))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((host.params, host.opt_state))):
        assert np.array_equal(a, b), "an overflowing step changed the parameters / moments"


def test_loss_scale_for_policy():
    assert isinstance(loss_scale_for(PRESETS["fp16-mixed"]), DynamicLossScale)
    none = loss_scale_for(PRESETS["bf16-mixed"])
    assert isinstance(none, NoLossScale)
    g = {"a": jnp.ones(2)}
    assert none.unscale(g) is g and none.adjust(jnp.asarray(False)) is none
    assert none.scale_loss(jnp.asarray(3.0, jnp.bfloat16)).dtype == jnp.float32
