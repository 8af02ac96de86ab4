"""Tests that kill bugs which once survived the whole suite (mutation testing, "Hardening").

Each test names the planted bug it kills; `python tools/plant_bugs.py` re-plants every bug in a
temporary copy of the package and checks that the named test fails there (and passes here).

1. the decay rounded through bf16 where `time_mix_forward` hands it to `wkv7`;
2. `k * k_k` computed in the compute dtype before the kk normalisation;
3. `precision=` dropped from `Policy.einsum` / `Policy.einsum_f32`;
5. the trainer ignoring `train.l2wrap`;
6. the HF export swapping `r_proj` / `k_proj`.
(4, the fp16 step not unscaling its gradients, lives with the loss-scale tests in
tests/test_precision.py.)
"""
from __future__ import annotations

import dataclasses
import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jex_core
from safetensors.numpy import load_file

from lwm_jax.runtime import Runtime
from lwm_jax import PRESETS, ModelConfig
from lwm_jax.probe import Probe
from lwm_jax.interop.api import export
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.models.rwkv7.testing import param_dict, randomize_params
from lwm_jax.precision import parse_policy
from lwm_jax.train.config import load_config
from lwm_jax.train.loss import lm_loss
from lwm_jax.train.trainer import build_program

time_mix_module = importlib.import_module("lwm_jax.models.rwkv7.time_mix")
step_module = importlib.import_module("lwm_jax.train.step")

CFG = ModelConfig(vocab_size=64, n_layer=2, n_embd=64, head_size=32)
RT = Runtime(chunk_size=16)
H, N = CFG.n_head, CFG.head_size
F64 = np.float64


def _tokens(B, T, seed=0, V=CFG.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


def _f64(x):
    return np.asarray(x, F64)


# ---- 1. the decay handed to wkv7 -------------------------------------------------------------

def _record(monkeypatch, name):
    """Wrap `time_mix.<name>` (as TimeMix looks it up) so every call's arguments are kept."""
    calls = []
    real = getattr(time_mix_module, name)

    def recorder(*args, **kw):
        out = real(*args, **kw)
        calls.append((args, kw, out))
        return out
    monkeypatch.setattr(time_mix_module, name, recorder)
    return calls


@pytest.fixture(scope="module", params=list(PRESETS))
def preset_run(request):
    """One forward of a randomized model per preset (k_a = 0, so that the tapped `k` is the raw
    key), recording what TimeMix passed to `decay_log` (w0, w1, w2, x_w) and to `wkv7`
    (r, w, k, v, a, b) in each layer, and every probe tap. Run eagerly, not under jit: jit may
    keep a bf16 intermediate such as x_w in f32 where it is consumed (XLA's excess precision),
    so the value a tap sees would not be exactly the value used."""
    preset = request.param
    rt = dataclasses.replace(RT, wkv_impl="recurrent")        # the cheapest WKV to run eagerly
    model = randomize_params(RWKV7(CFG, preset, runtime=rt, rngs=nnx.Rngs(0)), seed=1)
    att = model.blocks.att
    att.k_a[...] = jnp.zeros_like(att.k_a[...])
    probe = Probe()
    mp = pytest.MonkeyPatch()
    try:
        decay_calls, wkv_calls = _record(mp, "decay_log"), _record(mp, "wkv7")
        model(_tokens(2, 8, seed=3), probe=probe)
    finally:
        mp.undo()
    decay = [(args[0]["w0"], args[0]["w1"], args[0]["w2"], args[1]) for args, _, _ in decay_calls]
    return {"preset": preset, "model": model, "decay": decay,
            "wkv": [args[:6] for args, _, _ in wkv_calls], "taps": dict(probe.records)}


def test_decay_handed_to_wkv7_is_the_fp32_decay(preset_run):
    """The `w` that `wkv7` receives, per layer, equals the float64 decay
    `-exp(-0.5) * sigmoid(w0 + tanh(x_w @ w1) @ w2)` of the very `x_w` and parameters TimeMix
    used, to fp32 accuracy, under every preset (bf16 rounding anywhere on the way: 2e-3)."""
    decay_calls, wkv_calls = preset_run["decay"], preset_run["wkv"]
    assert len(decay_calls) == len(wkv_calls) == CFG.n_layer
    for (w0, w1, w2, x_w), wkv_args in zip(decay_calls, wkv_calls):
        d64 = _f64(w0) + np.tanh(_f64(x_w) @ _f64(w1)) @ _f64(w2)
        w64 = -np.exp(-0.5) / (1.0 + np.exp(-d64))                        # [B, T, C]
        w = wkv_args[1]
        chex.assert_type(w, jnp.float32)
        chex.assert_shape(w, (2, 8, H, N))
        # fp32 evaluation of this formula (C = 64 terms) is good to a few 1e-7 relative
        chex.assert_trees_all_close(_f64(w).reshape(w64.shape), w64, rtol=1e-5, atol=0)


# ---- 2. kk (the WKV a / b inputs) --------------------------------------------------------------

def _assert_correctly_rounded(got, exact, dtype, rtol, what):
    """|got - exact| <= half an ulp of `dtype` at `exact` + `rtol * |exact|` elementwise: `got`
    is `exact` computed in float32 (relative error <= rtol) then rounded once to `dtype`."""
    fi = jnp.finfo(dtype)
    e = np.floor(np.log2(np.maximum(np.abs(exact), np.finfo(F64).tiny)))
    ulp = np.exp2(np.maximum(e, fi.minexp) - fi.nmant)
    excess = np.abs(_f64(got) - exact) - (0.5 * ulp + rtol * np.abs(exact))
    bad = excess > 0
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.size} elements are not the correctly rounded "
        f"{jnp.dtype(dtype).name} value of the float64 result (worst excess "
        f"{float(excess.max()):.3g} over half an ulp + {rtol:g} relative)")


def test_kk_handed_to_wkv7_is_fp32_normalised_then_rounded(preset_run):
    """`a_in = -kk` and `b_in = kk * a` reach the WKV as the correctly rounded (compute dtype)
    values of the float64 `kk = normalize(k * k_k)` of the model's own k: the product and the
    norm are fp32, only the result is rounded. (`k * k_k` in bf16/f16 first: every other
    element is one ulp off.)"""
    model, taps, preset = preset_run["model"], preset_run["taps"], preset_run["preset"]
    cd = model.policy.compute_dtype
    for l in range(CFG.n_layer):
        pre = f"layer{l}/att/"
        k64 = _f64(taps[pre + "k"])                                        # [B, T, H, N]
        a64 = _f64(taps[pre + "a"]).reshape(k64.shape)                   # ICL rate (cd)
        kk = k64 * _f64(model.blocks.att.k_k[l]).reshape(H, N)
        kk = kk / np.linalg.norm(kk, axis=-1, keepdims=True)
        for name, exact in (("a_in", -kk), ("b_in", kk * a64)):
            got = taps[pre + name]
            chex.assert_type(got, cd)
            _assert_correctly_rounded(got, exact, cd, 4e-6, f"layer {l} {name} ({preset})")
        # and they are what wkv7 was handed
        w_args = preset_run["wkv"][l]
        np.testing.assert_array_equal(np.asarray(w_args[4]), np.asarray(taps[pre + "a_in"]))
        np.testing.assert_array_equal(np.asarray(w_args[5]), np.asarray(taps[pre + "b_in"]))


# ---- 3. explicit matmul precision in the traced forward and backward --------------------------

def _sub_jaxprs(params):
    for value in params.values():
        for x in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(x, jex_core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jex_core.Jaxpr):
                yield x


def _dot_generals(jaxpr, found, inside=(), callers=frozenset()):
    """Every `dot_general` equation of `jaxpr` and (recursively) of its sub-jaxprs: pjit,
    custom_vjp/custom_jvp, scan, while, cond branches, checkpoint (remat), closed_call, as
    `(eqn, primitives it is inside, function names in the enclosing equations' tracebacks)`
    (a custom_vjp body is traced apart: its own traceback stops at the custom_vjp)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append((eqn, inside, callers))
        tb = eqn.source_info.traceback
        names = callers | {f.function_name for f in tb.frames} if tb is not None else callers
        for sub in _sub_jaxprs(eqn.params):
            _dot_generals(sub, found, inside + (eqn.primitive.name,), names)
    return found


def _origin(eqn, callers=frozenset()) -> str:
    """'policy' (a `Policy.einsum`/`einsum_f32` matmul, or its transpose), 'decay island' (one
    of those called by TimeMix's `decay_log`, IEEE float32 under every policy), 'wkv' (inside
    the WKV op / kernels) or the innermost lwm_jax file it came from. Backward equations keep
    the source of the forward equation they transpose."""
    tb = eqn.source_info.traceback
    assert tb is not None, f"dot_general without source info: {eqn}"
    files = [f.file_name.replace("\\", "/") for f in tb.frames]
    if any(f.endswith("lwm_jax/precision/policy.py") for f in files):
        if "decay_log" in callers or any(f.function_name == "decay_log" for f in tb.frames):
            return "decay island"
        return "policy"
    if any("/lwm_jax/ops/" in f or "/lwm_jax/kernels/" in f for f in files):
        return "wkv"
    return next((f for f in files if "/lwm_jax/" in f), files[0] if files else "?")


_PRECISION_CASES = [(name, False) for name in PRESETS] + [("p=f32,c=bf16,m=high", True)]


def _wkv_precisions(policy):
    """Allowed precisions of the WKV op's own matmuls: the policy's `wkv_precision` (the
    in-chunk products, where the policy has one) and IEEE fp32 (the op's default, kept for its
    0/1 interval sums and the (I - A)^-1 of a chunk)."""
    wkv = getattr(policy, "wkv_precision", None) or "highest"
    return {(jax.lax.Precision(wkv),) * 2, (jax.lax.Precision.HIGHEST,) * 2}


@pytest.mark.parametrize("spec,scan_remat", _PRECISION_CASES)
def test_every_matmul_has_an_explicit_precision(spec, scan_remat):
    """"Every matmul gets an explicit precision; nothing depends on a global flag": each
    `dot_general` of the traced forward AND backward (loss, L2Wrap, all parameter gradients)
    carries `precision=(P, P)` with P the policy's precision for the policy's matmuls, HIGHEST
    for the decay island's forward products on float32 operands (DEFAULT on the exact bf16
    pieces of `lwm_jax.precision.bf16_split` under a bf16 compute dtype), and its WKV precision inside
    the WKV op; none carries `None` (= whatever `jax_default_matmul_precision` says). On CPU
    every precision computes the same numbers, so only the jaxpr can show this."""
    policy = parse_policy(spec)
    rt = dataclasses.replace(RT, wkv_impl="chunked", remat=scan_remat, scan_layers=scan_remat)
    graphdef, params = nnx.split(RWKV7(CFG, policy, runtime=rt, rngs=nnx.Rngs(0)))
    tok = _tokens(1, 9)

    def loss(p):
        return lm_loss(nnx.merge(graphdef, p)(tok[:, :-1]), tok[:, 1:], use_l2wrap=True)

    ieee, own = (jax.lax.Precision.HIGHEST,) * 2, (policy.lax_precision,) * 2
    wkv_policy = (jax.lax.Precision(getattr(policy, "wkv_precision", None) or "highest"),) * 2
    counts = {}
    for what, fn in (("forward", loss), ("forward+backward", jax.value_and_grad(loss))):
        # the decay island's forward products are IEEE whatever the policy; its gradient
        # products are the policy's (16-bit operands under a 16-bit compute dtype)
        want = {"policy": {own}, "wkv": _wkv_precisions(policy),
                "decay island": {ieee} if what == "forward" else {ieee, own}}
        dots = _dot_generals(jax.make_jaxpr(fn)(params).jaxpr, [])
        fp8_gemm = lambda e: all("float8" in str(v.aval.dtype) for v in e.invars)  # noqa
        counts[what] = sum(_origin(e, c) in ("policy", "decay island") or fp8_gemm(e)
                           for e, _, c in dots)
        if what == "forward":   # two per traced layer: a layer scan traces one body for all
            traced_layers = 1 if scan_remat else CFG.n_layer
            assert sum(_origin(e, c) == "decay island" for e, _, c in dots) == 2 * traced_layers
        for eqn, inside, callers in dots:
            if fp8_gemm(eqn):
                # an FP8 GEMM (`lwm_jax.precision.fp8`, through Flax's fp8_ops): only under an
                # FP8 policy, and with an explicit precision too
                got = eqn.params["precision"]
                assert policy.fp8 and got is not None and None not in tuple(got), (what, got)
                continue
            origin = _origin(eqn, callers)
            assert origin in want, f"{what}: a dot_general outside Policy.einsum, in {origin}"
            got = eqn.params["precision"]
            if (origin == "decay island" and got == (jax.lax.Precision.DEFAULT,) * 2
                    and jnp.dtype(policy.compute_dtype) == jnp.bfloat16):
                # the forward's split form: bf16 pieces (exact products), float32 accumulation
                assert [v.aval.dtype for v in eqn.invars] == [jnp.dtype(jnp.bfloat16)] * 2
                assert eqn.params["preferred_element_type"] == jnp.dtype(jnp.float32)
                continue
            assert got in want[origin], (
                f"{spec} {what}: {origin} dot_general (inside {'/'.join(inside) or 'top'}) has "
                f"precision {got}, the policy says {sorted(map(str, want[origin]))}")
        # the policy's WKV precision does reach the op's products
        assert any(_origin(e, c) == "wkv" and e.params["precision"] == wkv_policy
                   for e, _, c in dots)
        if scan_remat:
            assert any("scan" in inside and any(p.startswith("remat") or p == "checkpoint"
                                                for p in inside) for _, inside, _ in dots)
    # r, k, v, o, the w/a/g LoRA pairs, ffn key/value per layer (12), layer 1's v LoRA pair,
    # the head: 27 policy matmuls; a layer scan traces one body (with the v LoRA pair: layer 0
    # computes and discards it there) and the head: 15. The backward transposes each for both
    # of its operands
    assert counts["forward"] >= (14 + 1 if scan_remat else 12 + 14 + 1)
    assert counts["forward+backward"] >= 3 * counts["forward"]


@pytest.mark.parametrize("spec", ["bf16-mixed", "fp16-mixed"])
def test_backward_matmuls_run_in_the_compute_dtype(spec):
    """Under a 16-bit compute dtype the backward of every `Policy.einsum` multiplies 16-bit
    operands too. Plain autodiff of a bf16 x bf16 -> float32 product hands the transposes a
    float32 cotangent, and XLA runs float32 x bf16 as a float32 (TF32) matmul at half the
    tensor-core rate: the profile of the 0.1B bf16-mixed step on an H200 showed every backward
    GEMM as `sm90_xmma_gemm_f32f32_tf32f32`. No policy matmul may mix operand dtypes, and the
    16-bit ones must be as many as forward + two transposes each."""
    policy = parse_policy(spec)
    low = jnp.dtype(policy.compute_dtype)
    rt = dataclasses.replace(RT, wkv_impl="chunked")
    graphdef, params = nnx.split(RWKV7(CFG, policy, runtime=rt, rngs=nnx.Rngs(0)))
    tok = _tokens(1, 9)

    def loss(p):
        return lm_loss(nnx.merge(graphdef, p)(tok[:, :-1]), tok[:, 1:], use_l2wrap=True)

    counts = {}
    for what, fn in (("forward", loss), ("forward+backward", jax.value_and_grad(loss))):
        dots = [e for e, _, c in _dot_generals(jax.make_jaxpr(fn)(params).jaxpr, [])
                if _origin(e, c) in ("policy", "decay island")]
        dtypes = [tuple(jnp.dtype(v.aval.dtype) for v in e.invars) for e in dots]
        mixed = [d for d in dtypes if d[0] != d[1]]
        assert not mixed, f"{spec} {what}: policy matmuls with mixed operand dtypes {mixed[:3]}"
        counts[what] = sum(d == (low, low) for d in dtypes)
    # r, k, v, o, ffn key/value (12), the a and g LoRA pairs (8), layer 1's v pair (2); the
    # decay LoRA and the head are fp32 islands
    assert counts["forward"] >= 22
    assert counts["forward+backward"] >= 3 * counts["forward"]


# ---- 5. the trainer's train.l2wrap switch ---------------------------------------------------

_L2WRAP_OVERRIDES = ["model.vocab_size=32", "model.n_layer=1", "model.n_embd=32",
                     "model.head_size=16", "runtime.wkv_impl=recurrent", "train.ctx_len=4",
                     "train.batch_size=2", "train.warmup_steps=0", "train.grad_clip=0",
                     "train.weight_decay=0", "precision=fp32"]
TARGET = 7      # the token the rigged model predicts everywhere


class _JaxWithCountingJit:
    """`jax` as seen from lwm_jax.train.step, except that `jit` first wraps the function in
    `chex.assert_max_traces(n=1)`: a second trace of the train step raises."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def jit(fun, *args, **kw):
        return jax.jit(chex.assert_max_traces(fun, n=1), *args, **kw)


def _program(l2wrap: bool):
    flag = f"train.l2wrap={str(l2wrap).lower()}"
    return build_program(load_config(None, _L2WRAP_OVERRIDES + [flag]))


@pytest.fixture(scope="module")
def l2wrap_programs():
    """`build_program` (what `lwm-jax train` runs) for train.l2wrap true and false; the true
    one's jitted step counts its traces (for the retrace test below)."""
    chex.clear_trace_counter()
    mp = pytest.MonkeyPatch()
    mp.setattr(step_module, "jax", _JaxWithCountingJit())      # only while building
    try:
        counted = _program(True)
    finally:
        mp.undo()
    return {True: counted, False: _program(False)}


def _rigged_state(program):
    """A model that predicts TARGET with certainty at every position, whatever the input:
    ln_out's weight is 0 and its bias b gives logits `b @ head` with a gap of > 150 nats.
    Its cross-entropy gradient is exactly zero; only L2Wrap's gradient is not."""
    state = program.init_state()
    params = jax.device_get(state.params)
    head = np.asarray(params["head"], np.float32)
    bias = 200.0 * head[:, TARGET] / np.sum(np.square(head[:, TARGET]))   # logit 200 at TARGET
    params["ln_out"] = {"weight": np.zeros_like(bias), "bias": bias}
    logits = bias @ head
    assert logits.argmax() == TARGET and np.sort(logits)[-1] - np.sort(logits)[-2] > 150
    new = dataclasses.replace(state, params=jax.tree.map(jnp.asarray, params))
    return jax.device_put(new, program.state_sh), bias, head, float(logits.max())


@pytest.mark.parametrize("flag", [True, False])
def test_trainer_passes_train_l2wrap_to_the_step(l2wrap_programs, flag):
    """A model that is certain and right: the cross-entropy gradient is exactly 0, L2Wrap still
    pushes the max logit down (`max * 1e-4 / (B*T)` per position at the argmax). The program
    `build_program` compiles must follow `train.l2wrap`: all-zero gradients when false; when
    true, the head gradient is exactly L2Wrap's (column TARGET = b * max * 1e-4, others 0)."""
    program = l2wrap_programs[flag]
    state, bias, head, max_logit = _rigged_state(program)
    tokens = jnp.full((2, 5), TARGET, jnp.int32)
    new, metrics = program.train_step(state, tokens)
    assert float(metrics["finite"]) == 1.0 and float(metrics["loss"]) == 0.0
    mu = jax.device_get(new.opt_state)          # Adam first moment = (1 - b1) * gradient
    (mu_head,) = [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(mu)
                  if jax.tree_util.keystr(path).endswith(".mu['head']")]
    grad_head = mu_head / (1 - 0.9)
    expected = np.zeros_like(head, dtype=F64)
    if flag:
        expected[:, TARGET] = bias * max_logit * 1e-4   # sum over B*T positions of 1/(B*T)
    assert (float(metrics["grad_norm"]) > 0) == flag, (
        f"train.l2wrap={flag} but the step's grad_norm is {float(metrics['grad_norm'])}")
    chex.assert_trees_all_close(grad_head, expected, rtol=1e-5, atol=1e-9)


def test_train_step_is_traced_once_for_same_shaped_steps(l2wrap_programs):
    """Three steps, each fed the state the previous one returned, plus a fresh state: one trace
    (a retrace, e.g. from a weak-typed or re-dtyped leaf in the returned state, would recompile
    every step; chex.assert_max_traces raises on the second trace)."""
    program = l2wrap_programs[True]
    state = program.init_state()
    tokens = _tokens(2, 5, seed=4, V=32)
    for _ in range(3):
        state, metrics = program.train_step(state, tokens)
    program.train_step(program.init_state(), _tokens(2, 5, seed=5, V=32))
    assert int(state.step) == 3 and float(metrics["finite"]) == 1.0


# ---- 6. the HF export layout ---------------------------------------------------------------------

HF_CFG = ModelConfig(vocab_size=96, n_layer=2, n_embd=64, head_size=32, decay_lora=8, a_lora=12,
                     v_lora=16, gate_lora=20)
# FLA's RWKV7ForCausalLM state dict for HF_CFG (V 96, C 64, H 2 x N 32, LoRA w 8 a 12 v 16 g 20,
# FFN 256), written out by hand from fla/models/rwkv7 + fla/layers/rwkv7.py: nn.Linear weights
# are [out, in]; the token-shift mixes are [1, 1, C]; k_k, k_a, ffn.x_k are [C]; layer 0 has
# pre_norm and no v_lora.
_LAYER = {
    "attn_norm.weight": (64,), "attn_norm.bias": (64,),
    "ffn_norm.weight": (64,), "ffn_norm.bias": (64,),
    "attn.x_r": (1, 1, 64), "attn.x_w": (1, 1, 64), "attn.x_k": (1, 1, 64),
    "attn.x_v": (1, 1, 64), "attn.x_a": (1, 1, 64), "attn.x_g": (1, 1, 64),
    "attn.k_k": (64,), "attn.k_a": (64,), "attn.r_k": (2, 32),
    "attn.r_proj.weight": (64, 64), "attn.k_proj.weight": (64, 64),
    "attn.v_proj.weight": (64, 64), "attn.o_proj.weight": (64, 64),
    "attn.w_lora.lora.0.weight": (8, 64), "attn.w_lora.lora.2.weight": (64, 8),
    "attn.w_lora.lora.2.bias": (64,),
    "attn.a_lora.lora.0.weight": (12, 64), "attn.a_lora.lora.2.weight": (64, 12),
    "attn.a_lora.lora.2.bias": (64,),
    "attn.g_lora.lora.0.weight": (20, 64), "attn.g_lora.lora.2.weight": (64, 20),
    "attn.g_norm.weight": (64,), "attn.g_norm.bias": (64,),
    "ffn.x_k": (64,), "ffn.key.weight": (256, 64), "ffn.value.weight": (64, 256),
}
_V_LORA = {"attn.v_lora.lora.0.weight": (16, 64), "attn.v_lora.lora.2.weight": (64, 16),
           "attn.v_lora.lora.2.bias": (64,)}
EXPECTED_HF = {
    "model.embeddings.weight": (96, 64),
    "model.layers.0.pre_norm.weight": (64,), "model.layers.0.pre_norm.bias": (64,),
    **{f"model.layers.0.{k}": s for k, s in _LAYER.items()},
    **{f"model.layers.1.{k}": s for k, s in {**_LAYER, **_V_LORA}.items()},
    "model.norm.weight": (64,), "model.norm.bias": (64,),
    "lm_head.weight": (96, 64),
}


def test_hf_export_matches_fla_layout_literally(tmp_path):
    """Names and shapes are FLA's (a literal list, not our own table), and each projection
    holds the right matrix: `r_proj.weight` is receptanceᵀ, `k_proj.weight` is keyᵀ, ...
    (a round trip through one table cannot see two same-shaped tensors swapped)."""
    model = randomize_params(RWKV7(HF_CFG, "fp32", rngs=nnx.Rngs(0)), seed=3)
    export(model, tmp_path / "hf", format="hf")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == EXPECTED_HF
    p = jax.tree.map(np.asarray, param_dict(model))
    att, ffn = p["blocks"]["att"], p["blocks"]["ffn"]
    for i in range(HF_CFG.n_layer):
        pre = f"model.layers.{i}."
        exact = {"attn.r_proj.weight": att["receptance"][i].T,
                 "attn.k_proj.weight": att["key"][i].T,
                 "attn.v_proj.weight": att["value"][i].T,
                 "attn.o_proj.weight": att["output"][i].T,
                 "attn.w_lora.lora.0.weight": att["w1"][i].T,
                 "attn.w_lora.lora.2.weight": att["w2"][i].T,
                 "attn.w_lora.lora.2.bias": att["w0"][i],
                 "attn.a_lora.lora.2.bias": att["a0"][i],
                 "attn.g_lora.lora.0.weight": att["g1"][i].T,
                 "attn.x_r": att["x_r"][i].reshape(1, 1, -1),
                 "attn.x_k": att["x_k"][i].reshape(1, 1, -1),
                 "attn.k_k": att["k_k"][i], "attn.k_a": att["k_a"][i],
                 "attn.g_norm.weight": att["ln_x"]["weight"][i],
                 "ffn.key.weight": ffn["key"][i].T, "ffn.value.weight": ffn["value"][i].T}
        for name, want in exact.items():
            assert np.array_equal(sd[pre + name], want), (
                f"{pre + name} does not hold the expected parameter of layer {i}")
    assert np.array_equal(sd["lm_head.weight"], p["head"].T), "lm_head.weight is not headᵀ"
    assert np.array_equal(sd["model.embeddings.weight"], p["emb"]), "embeddings != emb"
