"""The chunk chains of the GPU WKV7 kernel: the Mosaic GPU chains (`mosaic_gpu/state_pass.py`)
in place of the Pallas-Triton `seq_fwd` / `seq_bwd` launches, and the rule that picks them.

On CPU the wiring runs in the Pallas interpreter with float32 JAX stand-ins for the chains (the
Mosaic kernels compile only for Hopper): the chunk launch's bf16 hi / lo maps, the output
launch reading them and the custom_vjp's residuals must give the Triton path's outputs and
gradients. Tests marked `gpu` run the Mosaic chains themselves against float64.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from lwm_jax.ops.wkv7.pallas import Tuning, mosaic_chains, wkv7_pallas
from lwm_jax.ops.wkv7.pallas_gpu.op import Chains, wkv7_gpu
from lwm_jax.ops.wkv7.testing import (chunk_chains_f64, random_wkv7_inputs, rel_err,
                                      wkv7_reference_vjp_f64)

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST
# The wiring tests (interpreter vs float32 stand-ins) need XLA:CPU: on a GPU, XLA compiles the
# interpreted chunk launch's bf16 hi / lo split with the float32 -> bfloat16 -> float32 round
# trip dropped as excess precision (`xla_allow_excess_precision`), so every lo half is zero
# (measured: outputs 1e-3 apart). The compiled kernels split inside Triton / Mosaic, where XLA
# cannot do that; the `gpu` tests below check them against float64.
_needs_xla_cpu = pytest.mark.skipif(jax.default_backend() == "gpu",
                                    reason="XLA:GPU drops the interpreter's bf16 lo halves")
C = 32


def _pair(hi, lo):
    return hi.astype(_F32) + lo.astype(_F32)


def _forward_standin(calls):
    def forward(M_hi, M_lo, D, s0, *, block_v=64):
        calls.append("forward")
        assert block_v in (16, 32, 64)
        M = _pair(M_hi, M_lo)
        B, H = s0.shape[:2]

        def step(S, md):
            m, d = md
            return jnp.einsum("bij,bjv->biv", m, S, precision=_HI) + d, S
        S_end, states = lax.scan(step, s0.reshape((B * H,) + s0.shape[2:]),
                                 (M.swapaxes(0, 1), D.swapaxes(0, 1)))
        return states.swapaxes(0, 1), S_end.reshape(s0.shape)
    return forward


def _backward_standin(calls):
    def backward(M_hi, M_lo, Q_hi, Q_lo, do, dsT, *, H, block_v=64):
        calls.append("backward")
        assert block_v in (16, 32, 64)
        assert do.dtype == jnp.bfloat16
        M, Q = _pair(M_hi, M_lo), _pair(Q_hi, Q_lo)
        BH, NT = M.shape[:2]
        B = BH // H
        V = do.shape[-1]
        dO = do.astype(_F32).reshape(B, NT, C, H, V).transpose(0, 3, 1, 2, 4)
        dO = dO.reshape(BH, NT, C, V)

        def step(g, mqd):
            m, q, d = mqd
            new = (jnp.einsum("bji,bjv->biv", m, g, precision=_HI)
                   + jnp.einsum("bci,bcv->biv", q, d, precision=_HI))
            return new, g
        g0, dS = lax.scan(step, dsT.reshape((BH,) + dsT.shape[2:]),
                          (M.swapaxes(0, 1), Q.swapaxes(0, 1), dO.swapaxes(0, 1)), reverse=True)
        return dS.swapaxes(0, 1), g0.reshape(dsT.shape)
    return backward


def _forward_out_standin(calls):
    """The forward chain that writes the outputs: o = Q S + O0 per chunk, from the same
    states as `_forward_standin`, O0 taken transposed at 64 value columns per CTA and as is at
    fewer, as the chunk launch writes it for each."""
    forward = _forward_standin([])

    def forward_out(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, *, H, block_v=64, with_states=False):
        calls.append("forward_out" + ("+states" if with_states else ""))
        states, sT = forward(M_hi, M_lo, D, s0, block_v=block_v)
        O0 = O0.swapaxes(-1, -2) if block_v == 64 else O0
        o = jnp.einsum("nclk,nckv->nclv", _pair(Q_hi, Q_lo), states, precision=_HI) + O0
        BH, NT, Cc, V = o.shape
        B = BH // H
        o = o.reshape(B, H, NT * Cc, V).transpose(0, 2, 1, 3).astype(jnp.bfloat16)
        return (o, states, sT) if with_states else (o, sT)
    return forward_out


def _problem(seed, B, T, H, V):
    xs = random_wkv7_inputs(jax.random.PRNGKey(seed), B, T, H, 64, V, jnp.bfloat16)
    ks = jax.random.split(jax.random.PRNGKey(seed + 1), 3)
    s0 = 0.5 * jax.random.normal(ks[0], (B, H, 64, V), _F32)
    seg = jnp.asarray([[0] * 20 + [1] * (T - 20), [4] * (T - 3) + [5] * 3][:B], jnp.int32)
    do = jax.random.normal(ks[1], (B, T, H, V), jnp.bfloat16)
    dsT = jax.random.normal(ks[2], (B, H, 64, V), _F32)
    return xs, s0, seg, do, dsT


def _vjp(fn, xs, s0, do, dsT):
    (o, sT), pull = jax.vjp(fn, xs, s0)
    gxs, gs0 = pull((do, dsT))
    return [o, sT, *gxs, gs0]


def test_standins_agree_with_the_float64_chains():
    """The float32 stand-ins (used below) and `testing.chunk_chains_f64` (the GPU test's
    reference) compute the same chains: random maps (M near a contraction, as decays give),
    states and cotangents within 1e-5 of float64."""
    B, H, NT = 2, 3, 5
    ks = jax.random.split(jax.random.PRNGKey(7), 6)
    M = 0.9 * jnp.eye(64) + 0.02 * jax.random.normal(ks[0], (B * H, NT, 64, 64))
    D = jax.random.normal(ks[1], (B * H, NT, 64, 64))
    Q = jax.random.normal(ks[2], (B * H, NT, C, 64))
    do = jax.random.normal(ks[3], (B, NT * C, H, 64), jnp.bfloat16)
    s0, dsT = (jax.random.normal(k, (B, H, 64, 64)) for k in ks[4:])
    calls = []
    pair = lambda x: (x, jnp.zeros_like(x))  # noqa: E731  (exact: the maps as the hi part)
    states, sT = _forward_standin(calls)(*pair(M), D, s0)
    dS, ds0 = _backward_standin(calls)(*pair(M), *pair(Q), do, dsT, H=H)
    want = chunk_chains_f64(M, D, Q, do, s0, dsT, H)
    got = (states, sT.reshape(B * H, 64, 64), dS, ds0.reshape(B * H, 64, 64))
    errs = [rel_err(x, y) for x, y in zip(got, want)]
    assert max(errs) < 1e-5, errs


def _chains(calls, primal):
    return Chains(_forward_standin(calls), _backward_standin(calls),
                  _forward_out_standin(calls), primal=primal)


@_needs_xla_cpu
def test_standin_chains_give_the_triton_paths_outputs_and_gradients():
    """Interpreter, bf16 inputs, documents, an initial state, ragged T and V = 128 (two value
    blocks): with the chains in place of the sequential launches every output and gradient
    equals the Triton path's to the bf16 pairs' 16 bits (1e-4 relative), and both chains ran
    (the forward one writing the chunk states for the backward)."""
    xs, s0, seg, do, dsT = _problem(0, 2, 83, 2, 128)
    calls = []
    run = lambda ch: _vjp(lambda xs, s0: wkv7_gpu(*xs, s0, seg, 32, interpret=True,  # noqa: E731
                                                  chains=ch), xs, s0, do, dsT)
    got, want = run(_chains(calls, True)), run(None)
    assert sorted(set(calls)) == ["backward", "forward"]
    diffs = [rel_err(x.astype(_F32), y.astype(_F32)) for x, y in zip(got, want)]
    assert max(diffs) < 1e-4, diffs


@_needs_xla_cpu
@pytest.mark.parametrize("block_v", [64, 16])
def test_chain_outputs_under_the_gradient_give_the_same_outputs_and_gradients(block_v):
    """`Tuning.chain_outputs`: with the gradient the forward chain writes the outputs beside
    the chunk states (O0 transposed at 64 value columns per CTA), no `out_fwd`; every output
    and gradient equals the Triton path's to the bf16 pairs' 16 bits."""
    xs, s0, seg, do, dsT = _problem(5, 2, 83, 2, 64)
    calls = []
    tune = Tuning(block_v_chain=block_v, chain_outputs=True)
    got = _vjp(lambda xs, s0: wkv7_gpu(*xs, s0, seg, 32, interpret=True, tuning=tune,
                                       chains=_chains(calls, True)), xs, s0, do, dsT)
    want = _vjp(lambda xs, s0: wkv7_gpu(*xs, s0, seg, 32, interpret=True), xs, s0, do, dsT)
    assert sorted(set(calls)) == ["backward", "forward_out+states"]
    diffs = [rel_err(x.astype(_F32), y.astype(_F32)) for x, y in zip(got, want)]
    assert max(diffs) < 1e-4, diffs


@_needs_xla_cpu
@pytest.mark.parametrize("block_v", [64, 16])
def test_forward_only_calls_run_the_output_chain_only_when_primal(block_v):
    """Forward-only calls: the chain that writes the outputs (O0 from the chunk launch,
    transposed for 64 value columns per CTA) where `primal`, else the Triton launches; same
    outputs and final state."""
    xs, s0, seg, _, _ = _problem(1, 2, 83, 2, 128)
    ref = wkv7_gpu(*xs, s0, seg, 32, interpret=True)
    for primal, expect in ((False, []), (True, ["forward_out"] * 2)):   # two value blocks
        calls = []
        got = wkv7_gpu(*xs, s0, seg, 32, interpret=True, chains=_chains(calls, primal),
                       tuning=Tuning(block_v_chain=block_v))
        assert calls == expect
        assert max(rel_err(x.astype(_F32), y.astype(_F32)) for x, y in zip(got, ref)) < 1e-4


def test_the_rule_keeps_triton_where_the_chains_cannot_run():
    xs = random_wkv7_inputs(jax.random.PRNGKey(2), 1, 64, 2, 64, 64, jnp.bfloat16)
    r, v = xs[0], xs[3]
    assert mosaic_chains(r, v, 32, None, None, None, interpret=True) is None
    assert mosaic_chains(r, v, 32, None, None, Tuning(chains="triton"), False) is None
    with pytest.raises(ValueError, match="^Tuning.chains='mosaic': .*interpreter"):
        mosaic_chains(r, v, 32, None, None, Tuning(chains="mosaic"), interpret=True)
    with pytest.raises(ValueError, match="^Tuning.chains must be"):
        mosaic_chains(r, v, 32, None, None, Tuning(chains="cuda"), interpret=True)
    if jax.default_backend() != "gpu":  # off a GPU nothing applies, whatever the shapes
        assert mosaic_chains(r, v, 32, None, None, None, interpret=False) is None


# ---------------------------------------------------------------------------------------------
# GPU: the Mosaic chains themselves (Hopper, jax >= 0.11)

def _mosaic_or_skip():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        pytest.skip("needs an sm_90 (Hopper) GPU")
    try:
        from lwm_jax.ops.wkv7.mosaic_gpu import state_pass
    except ImportError as err:
        pytest.skip(f"mosaic_gpu does not import: {err}")
    return state_pass


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [64, 32, 16])
def test_mosaic_chains_match_float64_chains(block_v):
    """Both chains (`block_v` value columns per CTA) on the chunk launch's maps of random
    inputs, against the same chains in float64 on the same float32 maps: the bf16x3 products
    keep every chunk state and every state cotangent within 2e-5 (the Triton TF32 launches:
    ~1e-6 / ~2e-4, measured). The output chain's forms (two warpgroups or one; with the chunk
    states) give the same outputs bit for bit."""
    sp = _mosaic_or_skip()
    from lwm_jax.ops.wkv7.pallas_gpu import launches
    B, T, H = 2, 1024, 3
    xs, s0, _, do, dsT = _problem(3, B, T, H, 64)
    kw = dict(H=H, C=C, prec=lax.Precision.DEFAULT, interpret=False,
              tune=launches.resolve(Tuning(), C, B * H, 64))
    M_hi, M_lo, D, Q_hi, Q_lo, _ = launches.intra_fwd(*xs, None, want_inv=False, split_mq=True,
                                                      **kw)
    states, sT = sp.forward_states(M_hi, M_lo, D, s0, block_v=block_v)
    dS, ds0 = sp.backward_states(M_hi, M_lo, Q_hi, Q_lo, do, dsT, H=H, block_v=block_v)
    f64 = lambda x: np.asarray(jnp.asarray(x, _F32), np.float64)  # noqa: E731
    want_states, S, want_dS, g = chunk_chains_f64(f64(_pair(M_hi, M_lo)), D,
                                                  f64(_pair(Q_hi, Q_lo)), do, s0, dsT, H)
    errs = {"states": rel_err(states, want_states), "final": rel_err(sT, S.reshape(sT.shape)),
            "dS": rel_err(dS, want_dS), "ds0": rel_err(ds0, g.reshape(ds0.shape))}
    assert max(errs.values()) < 2e-5, errs
    # the chain that writes the outputs: the same final state, o within its bf16 rounding
    M_hi, M_lo, D, Q_hi, Q_lo, O0 = launches.intra_fwd(*xs, None, want_inv=False, split_mq=True,
                                                       o0_t=block_v == 64, **kw)
    o, sT_o = sp.forward_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, H=H, block_v=block_v)
    want_o = (np.einsum("nclk,nckv->nclv", f64(_pair(Q_hi, Q_lo)), want_states)
              + (f64(O0).swapaxes(-1, -2) if block_v == 64 else f64(O0)))
    want_o = want_o.reshape(B, H, T, 64).transpose(0, 2, 1, 3)
    rounding = rel_err(jnp.asarray(want_o, jnp.bfloat16).astype(_F32), want_o)
    errs_o = {"final": rel_err(sT_o, S.reshape(sT.shape)), "o": rel_err(o.astype(_F32), want_o)}
    assert errs_o["final"] < 2e-5 and errs_o["o"] < 1.05 * rounding + 1e-5, (errs_o, rounding)
    if block_v < 64:   # o above came from two warpgroups; one gives the same bits
        o1, sT1 = sp.forward_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, H=H, block_v=block_v,
                                     warp_specialized=False)
        assert np.array_equal(np.asarray(o1.astype(_F32)), np.asarray(o.astype(_F32)))
        assert np.array_equal(np.asarray(sT1), np.asarray(sT_o))
    # and writing both: the same outputs, bit for bit, and the chunk states as above
    o2, states2, sT2 = sp.forward_outputs(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, H=H,
                                          block_v=block_v, with_states=True)
    assert np.array_equal(np.asarray(o2.astype(_F32)), np.asarray(o.astype(_F32)))
    assert np.array_equal(np.asarray(sT2), np.asarray(sT_o))
    assert rel_err(states2, want_states) < 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,V", [(2, 300, 2, 64), (1, 256, 2, 128)])
@pytest.mark.parametrize("block_v", [64, 16])
def test_op_with_mosaic_chains_is_no_less_accurate_than_triton(B, T, H, V, block_v):
    """The whole op (bf16, documents, an initial state) with the Mosaic chains (`block_v`
    value columns per CTA; under the gradient the forward chain writing the chunk states, then
    `out_fwd`, or writing both: "mosaic+o") against float64: every output and gradient error
    at most 2% above the Triton chains' (same call), and within bf16 rounding (5e-3)."""
    _mosaic_or_skip()
    xs, s0, seg, do, dsT = _problem(4, B, T, H, V)
    ref_o, ref_s, ref_g = wkv7_reference_vjp_f64(xs, s0, seg, np.asarray(do, np.float64), dsT)
    refs = [ref_o, ref_s, *[ref_g[n] for n in "rwkvab"], ref_g["initial_state"]]
    errs = {}
    for chains in ("triton", "mosaic", "mosaic+o"):
        tune = Tuning(chains=chains.split("+")[0], chain_outputs=chains == "mosaic+o",
                      block_v_chain=None if chains == "triton" else block_v)
        fn = lambda xs, s0: wkv7_pallas(*xs, s0, seg, 32, tuning=tune)  # noqa: E731
        errs[chains] = [rel_err(x.astype(_F32), r) for x, r in zip(_vjp(fn, xs, s0, do, dsT),
                                                                   refs)]
        o, sT = fn(xs, s0)   # forward-only ("mosaic": the chain writing the outputs)
        errs[chains + " fwd"] = [rel_err(o.astype(_F32), ref_o), rel_err(sT, ref_s)]
    for name in ("mosaic", "mosaic fwd", "mosaic+o", "mosaic+o fwd"):
        got, base = errs[name], errs["triton fwd" if name.endswith(" fwd") else "triton"]
        assert max(got) < 5e-3, errs
        assert all(m <= 1.02 * t + 1e-6 for m, t in zip(got, base)), errs
