"""Tests of the GPU Pallas WKV7 kernel (`lwm_jax.ops.wkv7.pallas`).

On CPU the kernels run in the Pallas interpreter (small shapes); tests marked `gpu` run the
compiled Triton kernels and are skipped without a CUDA GPU. Every numeric check compares against
the float64 token-by-token recurrence on fresh random RWKV-7-like inputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lwm_jax.ops.wkv7.pallas import Tuning, wkv7_pallas
from lwm_jax.ops.segments import chunk_reset_counter
from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
from lwm_jax.ops.wkv7.chunked import wkv7_chunked
from lwm_jax.ops.wkv7.recurrent import wkv7_recurrent

NAMES = ("r", "w", "k", "v", "a", "b")
ON_GPU = jax.default_backend() == "gpu"


def _problem(seed, B, T, H, K, V, dtype, with_state=True, with_segments=True):
    key = jax.random.PRNGKey(seed)
    xs = random_wkv7_inputs(key, B, T, H, K, V, dtype)
    ks = jax.random.split(jax.random.fold_in(key, 1), 4)
    s0 = 0.5 * jax.random.normal(ks[0], (B, H, K, V)) if with_state else None
    seg = None
    if with_segments:  # resets at a chunk boundary (16), one-token documents, id re-used later
        row0 = [0] * 7 + [1] * 9 + [2] + [3] * (T - 17)
        row1 = [5] * (T - 3) + [6, 5, 5]
        seg = jnp.asarray([row0, row1][:B], jnp.int32)
    do = jax.random.normal(ks[2], (B, T, H, V), jnp.float32)
    dsT = jax.random.normal(ks[3], (B, H, K, V), jnp.float32)
    return xs, s0, seg, do, dsT


def _run_vjp(xs, s0, seg, do, dsT, chunk, **kw):
    def f(xs, s0):
        return wkv7_pallas(*xs, s0, seg, chunk, kw.pop("output_dtype", None), **kw)
    (o, sT), vjp = jax.vjp(f, xs, s0)
    gxs, gs0 = vjp((do.astype(o.dtype), dsT))
    return o, sT, gxs, gs0


def _errors(xs, s0, seg, do, dsT, o, sT, gxs, gs0):
    ref_o, ref_s, ref_g = wkv7_reference_vjp_f64(
        xs, s0, seg, np.asarray(do.astype(o.dtype), np.float64), dsT)
    errs = {"o": rel_err(o, ref_o), "sT": rel_err(sT, ref_s)}
    errs.update({f"d{n}": rel_err(g, ref_g[n]) for n, g in zip(NAMES, gxs)})
    if s0 is not None:
        errs["ds0"] = rel_err(gs0, ref_g["initial_state"])
    return errs


def test_exact_mode_f32_segments_state_ragged_T(pallas_mode):
    """f32 inputs -> IEEE fp32 matmuls: outputs, final state and all 7 gradients to 1e-5
    (interpreted everywhere, compiled too on a GPU)."""
    args = _problem(0, 2, 40, 2, 16, 32, jnp.float32)
    out = _run_vjp(*args, chunk=16, interpret=pallas_mode)
    errs = _errors(*args, *out)
    assert out[0].shape == (2, 40, 2, 32) and out[1].dtype == jnp.float32
    assert max(errs.values()) < 1e-5, errs


def test_split_launch_variants_agree():
    """Two-launch backward and chunk-parallel output launch compute the same function."""
    args = _problem(1, 2, 40, 2, 16, 16, jnp.float32)
    base = _run_vjp(*args, chunk=16, tuning=Tuning(split_bwd=False, split_out=False))
    alt = _run_vjp(*args, chunk=16, tuning=Tuning(split_bwd=True, split_out=True))
    flat = lambda out: [out[0], out[1], *out[2], out[3]]
    diffs = [rel_err(x, y) for x, y in zip(flat(alt), flat(base))]
    assert max(diffs) < 1e-6, diffs


@pytest.mark.parametrize("block_v", [16, 32, 64])
def test_sequential_forward_with_outputs_value_blocks(pallas_mode, block_v):
    """The sequential forward writing the outputs itself (no output launch) at each value-block
    width `resolve` picks for many heads: bf16 inputs at chunk 32, documents and an initial
    state; outputs, final state and every gradient within bf16 rounding of float64."""
    args = _problem(10, 2, 96, 2, 64, 64, jnp.bfloat16)
    out = _run_vjp(*args, chunk=32, interpret=pallas_mode,
                   tuning=Tuning(split_out=False, block_v=block_v))
    errs = _errors(*args, *out)
    assert max(errs.values()) < 5e-3, errs


def test_stacked_backward_agrees_with_rows():
    """Stacked backward (TF32 path, so `precision="default"`; the interpreter computes its dots
    in fp32) = row-form backward, with documents, an initial state and K = 32 < 64."""
    args = _problem(8, 2, 70, 2, 32, 16, jnp.float32)
    flat = lambda out: [out[0], out[1], *out[2], out[3]]
    run = lambda f: flat(_run_vjp(*args, chunk=32, precision="default",
                                  tuning=Tuning(split_bwd=False, bwd_form=f)))
    diffs = [rel_err(x, y) for x, y in zip(run("stacked"), run("rows"))]
    assert max(diffs) < 1e-5, diffs


def test_bf16_inputs_default_precision():
    """bf16 inputs / bf16 output: errors at the level of bf16 rounding of o and the gradients."""
    args = _problem(2, 1, 48, 2, 16, 16, jnp.bfloat16, with_segments=False)
    out = _run_vjp(*args, chunk=16)
    assert out[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in out[2])
    errs = _errors(*args, *out)
    assert max(errs.values()) < 5e-3, errs


def test_f16_inputs_f32_decay_and_output():
    """f16 r/k/v/a/b with an f32 log-decay; gradients come back in each input's dtype."""
    xs, s0, seg, do, dsT = _problem(3, 2, 24, 1, 16, 16, jnp.float16)
    xs = tuple(x.astype(jnp.float32) if n == "w" else x for n, x in zip(NAMES, xs))
    out = _run_vjp(xs, s0, seg, do, dsT, chunk=16, output_dtype=jnp.float32)
    assert out[0].dtype == jnp.float32
    assert out[2][1].dtype == jnp.float32 and out[2][0].dtype == jnp.float16
    errs = _errors(xs, s0, seg, do, dsT, *out)
    assert max(errs.values()) < 5e-3, errs


def test_value_dim_above_block_is_split():
    """V = 128 > 64 runs as two column blocks; gradients of r/w/k/a/b sum over both."""
    args = _problem(4, 1, 20, 1, 16, 128, jnp.float32, with_segments=False)
    out = _run_vjp(*args, chunk=16)
    errs = _errors(*args, *out)
    assert max(errs.values()) < 1e-5, errs


def test_matches_chunked_and_recurrent_impls():
    """Same outputs and gradients as the pure-JAX `chunked` and `recurrent` references."""
    xs, s0, seg, do, dsT = _problem(5, 2, 33, 2, 16, 16, jnp.float32)

    def loss(fn):
        def f(xs, s0):
            o, sT = fn(*xs, s0, seg)
            return jnp.sum(o * do) + jnp.sum(sT * dsT)
        return jax.value_and_grad(f, argnums=(0, 1))(xs, s0)

    ours = loss(lambda *a: wkv7_pallas(*a, 16, None))
    refs = [loss(lambda *a: wkv7_chunked(*a, 16, jnp.float32)),
            loss(lambda *a: wkv7_recurrent(*a, jnp.float32))]
    leaves = lambda t: jax.tree_util.tree_leaves(t)
    for ref in refs:
        diffs = [rel_err(x, y) for x, y in zip(leaves(ours), leaves(ref))]
        assert max(diffs) < 1e-5, diffs


def test_chunk_reset_counter_counts_resets_within_chunks():
    seg = jnp.asarray([[4, 4, 7, 7, 7, 4, 4, 9, 9, 9]], jnp.int32)
    got = np.asarray(chunk_reset_counter(seg, 12, 4))
    # chunks [4 4 7 7] [7 4 4 9] [9 9 | pad 9 9]; padding repeats the last id.
    np.testing.assert_array_equal(got, [[0, 0, 1, 1, 0, 1, 1, 2, 0, 0, 0, 0]])


@pytest.mark.parametrize("change, err, match", [
    (dict(k=jnp.zeros((1, 16, 1, 16), jnp.float16)), TypeError, "k has dtype"),
    (dict(r=jnp.zeros((1, 16, 1, 24)), w=jnp.zeros((1, 16, 1, 24)), k=jnp.zeros((1, 16, 1, 24)),
          a=jnp.zeros((1, 16, 1, 24)), b=jnp.zeros((1, 16, 1, 24))), ValueError, "power of two"),
    (dict(chunk_size=24), ValueError, "chunk_size"),
    (dict(segment_ids=jnp.zeros((1, 16), jnp.float32)), TypeError, "segment_ids"),
    (dict(initial_state=jnp.zeros((1, 1, 16, 8))), ValueError, "initial_state"),
    (dict(precision="tf32"), ValueError, "precision"),
])
def test_bad_arguments_raise_one_clear_error(change, err, match):
    kw = dict(r=jnp.zeros((1, 16, 1, 16)), w=jnp.zeros((1, 16, 1, 16)),
              k=jnp.zeros((1, 16, 1, 16)), v=jnp.zeros((1, 16, 1, 16)),
              a=jnp.zeros((1, 16, 1, 16)), b=jnp.zeros((1, 16, 1, 16)), initial_state=None,
              segment_ids=None, chunk_size=16, output_dtype=None)
    kw.update(change)
    with pytest.raises(err, match=match):
        wkv7_pallas(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [32, 64])
def test_gpu_bf16_accuracy_and_gradients(chunk):
    """Compiled kernels: bf16 forward error <= 2e-3 (bf16 output) and gradients <= 3e-3."""
    args = _problem(6, 1, 1000, 4, 64, 64, jnp.bfloat16, with_segments=False)
    out = _run_vjp(*args, chunk=chunk)
    errs = _errors(*args, *out)
    assert errs["o"] <= 2e-3, errs
    assert max(errs.values()) <= 3e-3, errs


@pytest.mark.gpu
def test_gpu_exact_mode_segments():
    """Compiled kernels, f32 inputs (IEEE matmuls), packed documents, initial state: <= 1e-5."""
    args = _problem(7, 2, 300, 3, 64, 64, jnp.float32)
    out = _run_vjp(*args, chunk=64)
    errs = _errors(*args, *out)
    assert max(errs.values()) <= 1e-5, errs


@pytest.mark.parametrize("chunk,dtype", [(32, jnp.bfloat16), (64, jnp.float32)])
def test_lowers_to_triton_for_gpu(chunk, dtype):
    """Forward + backward lower through Pallas' Triton rules for the CUDA platform (no GPU
    needed: `jax.export` runs the lowering and stops before compiling the Triton IR), at the
    production shape K = V = 64 with segment ids. Catches constructs Pallas-Triton rejects
    before they reach a GPU."""
    from jax import export
    from lwm_jax.ops.wkv7.pallas_gpu.op import wkv7_gpu
    B, T, H, K = 1, 128, 2, 64
    spec = lambda dt, shape=(B, T, H, K): jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    xs = [spec(dtype), spec(jnp.float32)] + [spec(dtype)] * 4

    def loss(xs, h0, seg):
        o, sT = wkv7_gpu(*xs, h0, seg, chunk, jnp.float32)    # compiled, not interpreted
        return jnp.sum(o ** 2) + jnp.sum(sT ** 2)

    triton = "__gpu$xla.gpu.triton"
    exported = export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=("cuda",),
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
        xs, spec(jnp.float32, (B, H, K, K)), spec(jnp.int32, (B, T)))
    assert exported.platforms == ("cuda",)
    assert exported.mlir_module().count(f"custom_call @{triton}") >= 4   # fwd and bwd kernels


def test_sequential_launch_defaults_leave_one_program_per_sm():
    """`resolve`'s measured rule (`benchmarks/wkv7.py sweep`; figures in
    benchmarks/RESULTS-log.md): the sequential launches take the fewest value columns per program
    that keep B*H*V/columns programs <= the SM count, except the forward that writes the
    outputs itself (many heads): the most columns that keep 7/8 of a wave; 3 pipeline stages;
    explicit `Tuning` fields still win."""
    from lwm_jax.ops.wkv7.pallas_gpu.launches import resolve
    big = resolve(None, 32, 64, 64, sm_count=132)        # 1.5B, batch 2: 64 heads
    assert (big.block_v, big.block_v_bwd, big.split_out, big.stages_seq) == (32, 32, True, 3)
    small = resolve(None, 32, 96, 64, sm_count=132)      # 0.1B, batch 8: 96 heads
    assert (small.block_v, small.block_v_bwd, small.split_out) == (32, 64, False)
    many = resolve(None, 32, 512, 64, sm_count=132)      # 16 x 32 heads: 64-column programs
    assert (many.block_v, many.block_v_bwd, many.split_out) == (64, 64, False)
    assert resolve(None, 32, 128, 64, sm_count=132).block_v == 64   # 128 >= 7/8 of 132
    long = resolve(None, 32, 32, 64, sm_count=132)       # one long sequence of 32 heads
    assert (long.block_v, long.block_v_bwd) == (16, 32)
    assert resolve(None, 32, 64, 64, sm_count=264).block_v_bwd == 32
    assert resolve(None, 32, 96, 64, sm_count=264).block_v_bwd == 32
    assert resolve(None, 32, 96, 64, sm_count=264).split_out     # < 2 16-column programs/SM
    assert not resolve(None, 32, 66, 64, sm_count=132).split_out  # 264 = 2 x 132
    fixed = resolve(Tuning(block_v=16, block_v_bwd=16, stages_seq=2), 32, 64, 64, sm_count=132)
    assert (fixed.block_v, fixed.block_v_bwd, fixed.stages_seq) == (16, 16, 2)
    # the Mosaic chains' value blocks: the same one-wave rule
    assert [resolve(None, 32, bh, 64, sm_count=132).block_v_chain
            for bh in (8, 32, 64, 96, 512)] == [16, 16, 32, 64, 64]
    assert resolve(Tuning(block_v_chain=64), 32, 32, 64, sm_count=132).block_v_chain == 64
    # with the gradient the forward chain writes the outputs too, from 32 columns per CTA
    assert [resolve(None, 32, bh, 64, sm_count=132).chain_outputs
            for bh in (8, 32, 64, 96, 512)] == [False, False, True, True, True]
    assert not resolve(Tuning(block_v_chain=64, chain_outputs=False), 32, 96, 64).chain_outputs
    assert resolve(Tuning(block_v_chain=64), 32, 32, 64, sm_count=132).chain_outputs
