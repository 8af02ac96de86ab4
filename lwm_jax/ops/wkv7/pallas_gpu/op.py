"""WKV7 on NVIDIA GPUs: validation, padding, packed documents and the `jax.custom_vjp`.

Forward  = `intra_fwd` (chunk-parallel) + `seq_fwd` (sequential over chunks, V split across
programs). Backward = `seq_bwd` (reverse sequential, state cotangents) + `intra_bwd`
(chunk-parallel input gradients). See `launches.py` for shapes, `tiles.py` for the math
and `tiles_bwd_stacked.py` for the stacked backward used at C <= 32.

Value columns evolve independently, so V > 64 runs as blocks of 64 columns (the key-side work
is repeated per block). Saved for the backward (float32, per chunk, nothing of size T*K*V):
the chunk-start states [B*H, NT, K, V], the maps M [B*H, NT, K, K] and Q [B*H, NT, C, K], the
triangular inverse [B*H, NT, C, C], plus the inputs themselves.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.ops.wkv7.pallas_gpu import launches
from lwm_jax.ops.wkv7.contract import INPUT_DTYPES as _FLOATS
from lwm_jax.ops.wkv7.contract import GPU_MAX_CHUNK, check_wkv7_inputs
from lwm_jax.ops.segments import chunk_reset_counter
from lwm_jax.ops.wkv7.pallas_gpu.launches import Tuning, resolve
from lwm_jax.remat_names import WKV7_RESIDUALS_NAME

MAX_K = 64  # larger key sizes are untested (V = 128 in one program exceeded an H200's 227 KiB
            # of shared memory at C = 64, so K = 128 very likely does too)
MAX_V = 64  # larger value sizes are split into column blocks of MAX_V
# Pallas-Triton runs DEFAULT and HIGH as TF32 tensor-core matmuls, HIGHEST as IEEE fp32.
PRECISIONS = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH,
              "highest": jax.lax.Precision.HIGHEST,
              "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


class Chains(NamedTuple):
    """Chunk chains run instead of the Triton `seq_fwd` / `seq_bwd` launches: the Mosaic GPU
    ones (`mosaic_gpu/state_pass.py`), passed in by `lwm_jax.ops.wkv7.pallas` because kernel
    packages import no other kernel package. `forward(M_hi, M_lo, D, s0, block_v=bv) ->
    (states, final)`, `backward(M_hi, M_lo, Q_hi, Q_lo, do, dsT, H=H, block_v=bv) -> (dS_end,
    d_s0)` and `forward_out(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, H=H, block_v=bv) -> (o, final)`
    (the forward chain writing the outputs instead of the chunk states; O0 transposed, [BH, NT,
    V, C], at bv = 64; with `with_states=True` it writes both: `(o, states, final)`), with M
    and Q as `tile_dots.split_bf16` pairs, K = V = 64, C = 32, `do` and `o` bfloat16 (the
    caller checks), bv = `Tuning.block_v_chain` value columns per CTA. Where the gradient is
    taken `backward` runs after `forward_out(..., with_states=True)` or, as
    `Tuning.chain_outputs` says, after `forward` and the Triton `out_fwd`; `primal`:
    forward-only calls run `forward_out` (else the Triton launches)."""
    forward: Callable
    backward: Callable
    forward_out: Callable
    primal: bool


class _Cfg(NamedTuple):
    H: int
    C: int
    prec: Any
    out_dtype: Any
    tune: Tuning
    interpret: bool
    chains: Chains | None = None


def _kw(cfg):
    return dict(H=cfg.H, C=cfg.C, prec=cfg.prec, tune=cfg.tune, interpret=cfg.interpret)


def _forward(r, w, k, v, a, b, s0, n, cfg, want_inv):
    """`(o, sT, M, Q, states[, inv])`. With `cfg.chains` M and Q are bf16 pairs; the states
    come back where the backward needs them (`want_inv`), else they are None unless the Triton
    launches keep them."""
    kw = _kw(cfg)
    if cfg.chains is not None:
        # Forward-only, the chain writes the outputs itself. With the gradient it writes the
        # chunk states too, or (`chain_outputs` off: the narrowest value blocks, where that
        # measured slower) only them, and `out_fwd` the outputs (benchmarks/NOTES-wkv7.md).
        bv = cfg.tune.block_v_chain
        outputs = not want_inv or cfg.tune.chain_outputs
        M_hi, M_lo, D, Q_hi, Q_lo, O0, *inv = launches.intra_fwd(
            r, w, k, v, a, b, n, want_inv=want_inv, split_mq=True, o0_t=outputs and bv == 64,
            **kw)
        M, Q = (M_hi, M_lo), (Q_hi, Q_lo)
        if outputs:
            o, *states, sT = cfg.chains.forward_out(M_hi, M_lo, D, Q_hi, Q_lo, O0, s0, H=cfg.H,
                                                    block_v=bv, with_states=want_inv)
            return (o, sT, M, Q, *(states or [None]), *inv)
        states, sT = cfg.chains.forward(M_hi, M_lo, D, s0, block_v=bv)
        o = launches.out_fwd(Q, O0, states, out_dtype=cfg.out_dtype, **kw)
        return (o, sT, M, Q, states, *inv)
    M, D, Q, O0, *inv = launches.intra_fwd(r, w, k, v, a, b, n, want_inv=want_inv, **kw)
    o, sT, states = launches.seq_forward(M, D, Q, O0, s0, out_dtype=cfg.out_dtype,
                                         want_states=want_inv, **kw)
    return (o, sT, M, Q, states, *inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _core(r, w, k, v, a, b, s0, n, cfg):
    if cfg.chains is not None and not cfg.chains.primal:
        cfg = cfg._replace(chains=None)
    o, sT, *_ = _forward(r, w, k, v, a, b, s0, n, cfg, want_inv=False)
    return o, sT


def _core_fwd(r, w, k, v, a, b, s0, n, cfg):
    o, sT, M, Q, states, inv = _forward(r, w, k, v, a, b, s0, n, cfg, want_inv=True)
    # named so that a remat policy can keep them instead of re-running the forward kernels
    M, Q, inv, states = checkpoint_name((M, Q, inv, states), WKV7_RESIDUALS_NAME)
    return (o, sT), (r, w, k, v, a, b, n, M, Q, inv, states)


def _core_bwd(cfg, res, cts):
    r, w, k, v, a, b, n, M, Q, inv, states = res
    do, dsT = cts
    kw = _kw(cfg)
    if cfg.chains is not None:
        dS_end, ds0 = cfg.chains.backward(*M, *Q, do, dsT.astype(jnp.float32), H=cfg.H,
                                          block_v=cfg.tune.block_v_chain)
    else:
        dS_end, ds0 = launches.seq_bwd(M, Q, do, dsT.astype(jnp.float32), **kw)
    grads = launches.intra_bwd(r, w, k, v, a, b, n, inv, states, dS_end, do, **kw)
    return (*grads, ds0, None)


_core.defvjp(_core_fwd, _core_bwd)


def _pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def validate(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype):
    """One-line ValueError/TypeError naming the offending argument."""
    check_wkv7_inputs(r, w, k, v, a, b, initial_state, segment_ids)
    K, V = r.shape[-1], v.shape[-1]
    for name, d in (("K (head size of r/k)", K), ("V (head size of v)", V)):
        if not _pow2(d) or d < 16:
            raise ValueError(f"{name} must be a power of two >= 16 for the GPU kernel, got {d}")
    if K > MAX_K:
        raise ValueError(f"K (head size of r/k) = {K} exceeds the GPU kernel's limit {MAX_K}; "
                         "use impl='chunked' for larger heads")
    if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 16
            or not _pow2(chunk_size) or chunk_size > GPU_MAX_CHUNK):
        raise ValueError(f"chunk_size must be a power of two in [16, {GPU_MAX_CHUNK}] for the GPU "
                         f"kernel (longer chunks can overflow float32 exponents at RWKV-7's "
                         f"strongest decay), got {chunk_size!r}")
    if output_dtype is not None and jnp.dtype(output_dtype) not in _FLOATS:
        raise TypeError(f"output_dtype must be float32, bfloat16 or float16, got {output_dtype}")


def launch_choices(r, v, chunk_size, output_dtype, precision):
    """`(C, output dtype, precision name)` a call runs with: the chunk lowered to the next power
    of two >= T (>= 16) for short T, v's dtype for a None output, and for a None precision
    "highest" with float32 inputs, else "default" (TF32)."""
    T = r.shape[1]
    if precision is None:
        precision = "highest" if jnp.dtype(r.dtype) == jnp.float32 else "default"
    out_dtype = jnp.dtype(v.dtype if output_dtype is None else output_dtype)
    return min(chunk_size, max(16, 1 << (T - 1).bit_length())), out_dtype, precision


def prepare(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype, precision,
            interpret, tuning, chains=None):
    """What every GPU entry point does after `validate`: T padded to a multiple of the chunk C
    (padded steps: w = 0, everything else 0, leave the state unchanged), the float32 start
    state, the per-chunk reset counter and the launch config. Returns `((r, w, k, v, a, b)
    padded to [B, Tp, H, *], s0 [B, H, K, V] float32, n or None, _Cfg)`."""
    C, out_dtype, precision = launch_choices(r, v, chunk_size, output_dtype, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    B, T, H, K = r.shape
    V = v.shape[-1]
    T_pad = -(-T // C) * C
    if T_pad != T:
        pad = lambda x: jnp.pad(x, ((0, 0), (0, T_pad - T), (0, 0), (0, 0)))  # noqa: E731
        r, w, k, v, a, b = (pad(x) for x in (r, w, k, v, a, b))
    if initial_state is None:
        s0 = jnp.zeros((B, H, K, V), jnp.float32)
    else:
        s0 = initial_state.astype(jnp.float32)
    n = None if segment_ids is None else chunk_reset_counter(segment_ids, T_pad, C)
    prec = PRECISIONS["highest" if interpret and precision == "tf32x3" else precision]
    cfg = _Cfg(H=H, C=C, prec=prec, out_dtype=out_dtype,
               tune=resolve(tuning, C, B * H, min(V, MAX_V)), interpret=bool(interpret),
               chains=chains)
    return (r, w, k, v, a, b), s0, n, cfg


def wkv7_gpu(r, w, k, v, a, b, initial_state=None, segment_ids=None, chunk_size=32,
             output_dtype=None, *, precision=None, interpret=False, tuning=None, chains=None):
    """WKV7 forward (and, through `jax.custom_vjp`, backward) with Pallas-Triton kernels.

    Args:
      r, w, k, a, b: `[B, T, H, K]`; v: `[B, T, H, V]`. r/k/v/a/b share one dtype (float32,
        bfloat16 or float16); w (log-decay, <= 0) is float32 or that dtype. K <= 64 and V:
        powers of 2 >= 16.
        Precondition: -(sum of w over one chunk) < ~80 (RWKV-7's w > -exp(-0.5) gives <= 38.8
        at C = 64); beyond that e^{-cumsum} overflows. Use a smaller chunk for larger decays.
      initial_state: `[B, H, K, V]` float32 or None (zeros). Differentiable.
      segment_ids: int `[B, T]` or None; the state resets where the id changes.
      chunk_size: C, a power of two >= 16 (lowered to the next power of two >= T for short T).
        Default 32, the measured fastest with the stacked backward (`tiles_bwd_stacked`);
        C = 64 runs the row-form two-launch backward (benchmarks/NOTES-wkv7.md).
      output_dtype: dtype of `o` (default: v's dtype).
      precision: "default" or "high" (TF32 tensor-core matmuls, fp32 accumulation) or "highest"
        (IEEE fp32 matmuls: the exact mode) or "tf32x3" (each fp32 operand split into two TF32
        halves, three tensor-core products: fp32-level error at tensor-core speed; the
        interpreter, which runs on XLA:CPU, computes it as "highest"). None picks "highest" for
        float32 inputs, else "default".
      interpret: run the kernels in the Pallas interpreter (CPU tests).
      tuning: a `Tuning` (launch parameters) or None for the defaults.
      chains: a `Chains` run instead of the sequential Triton launches, or None. Only for
        K = V-block = 64, C = 32, TF32 precision and a bfloat16 output (`lwm_jax.ops.wkv7.pallas`
        decides).

    Returns:
      `(o [B, T, H, V] in output_dtype, final_state [B, H, K, V] float32)`.
    """
    validate(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype)
    T, V = r.shape[1], v.shape[-1]
    (r, w, k, v, a, b), s0, n, cfg = prepare(r, w, k, v, a, b, initial_state, segment_ids,
                                             chunk_size, output_dtype, precision, interpret,
                                             tuning, chains)
    if V <= MAX_V:
        o, sT = _core(r, w, k, v, a, b, s0, n, cfg)
    else:  # value columns evolve independently: run blocks of MAX_V columns and concatenate
        parts = [_core(r, w, k, v[..., j:j + MAX_V], a, b, s0[..., j:j + MAX_V], n, cfg)
                 for j in range(0, V, MAX_V)]
        o = jnp.concatenate([p[0] for p in parts], axis=-1)
        sT = jnp.concatenate([p[1] for p in parts], axis=-1)
    if r.shape[1] != T:
        o = o[:, :T]
    return o, sT
