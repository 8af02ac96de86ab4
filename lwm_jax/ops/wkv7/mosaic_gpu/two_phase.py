"""Two-phase WKV7 forward: chunk-parallel Mosaic GPU maps, then a thin sequential pass.

    o, final_state = wkv7_mosaic_fwd2(r, w, k, v, a, b, initial_state=None, output_dtype=None,
                                      seq=None, no_auto_barriers=False)

Inputs and outputs as `fwd.wkv7_mosaic_fwd` (r, k, v, a, b bf16 `[B, T, H, 64]`, w bf16 or
float32, initial_state `[B, H, 64, 64]` or None; o `[B, T, H, 64]` in output_dtype, final state
float32 `[B, H, 64, 64]`).

Phase 1, `chunks.chunk_maps` (grid B * H * NT, chunk 32): each chunk's state-independent maps
M [BH, NT, 64, 64], D [BH, NT, 64, 64], Q [BH, NT, 32, 64], O0 [BH, NT, 32, 64] float32.
Phase 2, `seq(M, D, Q, O0, s0, H=H, out_dtype=...) -> (o [B, Tp, H, 64], final [B, H, 64, 64])`
runs S <- M S + D and o = Q S + O0 over the chunks. The caller passes it (for instance the
Pallas-Triton `seq_fwd` / `out_fwd` launches, which this package may not import; see
benchmarks/wkv7_mosaic.py); None runs `sequential_xla` (a float32 XLA scan, slow).

Not wired into `lwm_jax.ops.wkv7.wkv7`: measured slower than the Pallas-Triton forward at three
of the four anchor shapes. ptxas serialises phase 1's wgmma instructions (warning C7511,
"insufficient register resources"), so each product waits for the one before it; fixing that is
the precondition for any gain (`benchmarks/wkv7_mosaic.py`; figures in
benchmarks/RESULTS-log.md, 2026-11-27).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lwm_jax.ops.wkv7.mosaic_gpu.chunks import chunk_maps
from lwm_jax.ops.wkv7.mosaic_gpu.fwd import CHUNK, DIM, _F32, _w_parts, check_inputs


@functools.partial(jax.jit, static_argnames=("output_dtype", "seq", "no_auto_barriers"))
def wkv7_mosaic_fwd2(r, w, k, v, a, b, initial_state=None, output_dtype=None, seq=None,
                     no_auto_barriers=False):
    """WKV7 forward in two phases (module docstring). Returns `(o, final_state)`."""
    check_inputs("wkv7_mosaic_fwd2", r, w, k, v, a, b)
    B, T, H, _ = r.shape
    out_dtype = jnp.dtype(v.dtype if output_dtype is None else output_dtype)
    Tp = -(-T // CHUNK) * CHUNK
    xs = (r, k, v, a, b) + _w_parts(w)
    if Tp != T:  # padded steps: w = 0 and zero vectors leave the state unchanged
        xs = tuple(jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0))) for x in xs)
    s0 = (jnp.zeros((B, H, DIM, DIM), _F32) if initial_state is None
          else initial_state.astype(_F32))
    M, D, Q, O0 = chunk_maps(xs[0], xs[5:], *xs[1:5], no_auto_barriers=no_auto_barriers)
    if seq is None:
        seq = sequential_xla
    o, sT = seq(M, D, Q, O0, s0, H=H, out_dtype=out_dtype)
    return o[:, :T], sT


def sequential_xla(M, D, Q, O0, s0, *, H, out_dtype):
    """Reference phase 2 in XLA (float32, HIGHEST): a scan over chunks. Slow; for checks."""
    BH, NT, K, V = D.shape
    B = BH // H
    hp = jax.lax.Precision.HIGHEST

    def step(S, xs):
        m, d, q, o0 = xs
        o = jnp.einsum("nck,nkv->ncv", q, S, precision=hp) + o0
        return jnp.einsum("nij,njv->niv", m, S, precision=hp) + d, o

    sw = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731
    sT, o = jax.lax.scan(step, s0.reshape(BH, K, V), (sw(M), sw(D), sw(Q), sw(O0)))
    o = o.transpose(1, 0, 2, 3).reshape(B, H, NT * CHUNK, V).transpose(0, 2, 1, 3)
    return o.astype(out_dtype), sT.reshape(B, H, K, V)
