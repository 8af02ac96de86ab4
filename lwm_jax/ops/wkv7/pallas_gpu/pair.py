"""WKV7 and its identity pass in one `jax.custom_vjp`: the two per-device calls of sequence
parallelism (`lwm_jax.ops.wkv7.sequence_parallel`) sharing their chunk factors.

Sequence parallelism runs the op on each device's slice twice: with the values v from a zero
state (outputs `o`, final state `D`) and with v = 0 from the identity (outputs `q`, final state
`M`). The chunk factors that `intra_fwd` computes — the maps M and Q and the triangular inverse —
depend only on r, w, k, a, b; with v = 0 its value-side results (the chunk offsets D and outputs
O0) are zero. So one `intra_fwd` serves both passes: the identity pass is `seq_fwd` over
(M, 0, Q, 0) from the identity. M, Q and the inverse are saved once for the backward instead
of twice (float32 `[BH, NT, K, K]`, `[BH, NT, C, K]`, `[BH, NT, C, C]`), and each forward
(and each rematerialised forward) runs one `intra_fwd` launch fewer. The backward is the two
passes' backwards: `seq_bwd` and `intra_bwd` for each, the input gradients summed.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.ops.wkv7.pallas_gpu import launches
from lwm_jax.ops.wkv7.pallas_gpu.launches import resolve
from lwm_jax.ops.wkv7.pallas_gpu.op import MAX_V, prepare, validate
from lwm_jax.remat_names import WKV7_RESIDUALS_NAME

_F32 = jnp.float32


def _kw(cfg):
    return dict(H=cfg.H, C=cfg.C, prec=cfg.prec, tune=cfg.tune, interpret=cfg.interpret)


def _identity_pass(M, Q, eye, cfg_q, want_states):
    """`seq_fwd` over (M, 0, Q, 0) from `eye` `[B, H, K, K]`: `(q, M_end[, states])`."""
    BH, NT, K, _ = M.shape
    zeros_D = jnp.zeros((BH, NT, K, K), _F32)
    zeros_O0 = jnp.zeros((BH, NT, cfg_q.C, K), _F32)
    q, M_end, *states = launches.seq_fwd(M, zeros_D, Q, zeros_O0, eye, out_dtype=_F32,
                                         want_states=want_states, **_kw(cfg_q))
    if q is None:
        q = launches.out_fwd(Q, zeros_O0, states[0], out_dtype=_F32, **_kw(cfg_q))
    return (q, M_end, states[0]) if want_states else (q, M_end)


def _value_pass(M, D, Q, O0, s0, cfg, want_states):
    """`seq_fwd` over (M, D, Q, O0) from `s0` `[B, H, K, V]`: `(o, final_state[, states])`."""
    o, sT, *states = launches.seq_fwd(M, D, Q, O0, s0, out_dtype=cfg.out_dtype,
                                      want_states=want_states, **_kw(cfg))
    if o is None:
        o = launches.out_fwd(Q, O0, states[0], out_dtype=cfg.out_dtype, **_kw(cfg))
    return (o, sT, states[0]) if want_states else (o, sT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _pair_core(r, w, k, v, a, b, s0, eye, n, cfg, cfg_q):
    M, D, Q, O0 = launches.intra_fwd(r, w, k, v, a, b, n, want_inv=False, **_kw(cfg))
    o, sT = _value_pass(M, D, Q, O0, s0, cfg, want_states=False)
    q, M_end = _identity_pass(M, Q, eye, cfg_q, want_states=False)
    return o, sT, q, M_end


def _pair_fwd(r, w, k, v, a, b, s0, eye, n, cfg, cfg_q):
    M, D, Q, O0, inv = launches.intra_fwd(r, w, k, v, a, b, n, want_inv=True, **_kw(cfg))
    o, sT, states = _value_pass(M, D, Q, O0, s0, cfg, want_states=True)
    q, M_end, states_q = _identity_pass(M, Q, eye, cfg_q, want_states=True)
    # named like the single call's residuals, so a remat policy treats both alike
    M, Q, inv, states, states_q = checkpoint_name((M, Q, inv, states, states_q),
                                                 WKV7_RESIDUALS_NAME)
    return (o, sT, q, M_end), (r, w, k, v, a, b, n, M, Q, inv, states, states_q)


def _pair_bwd(cfg, cfg_q, res, cts):
    r, w, k, v, a, b, n, M, Q, inv, states, states_q = res
    do, dsT, dq, dM_end = cts
    dS_end, ds0 = launches.seq_bwd(M, Q, do, dsT.astype(_F32), **_kw(cfg))
    dS_end_q, deye = launches.seq_bwd(M, Q, dq.astype(_F32), dM_end.astype(_F32), **_kw(cfg_q))
    grads = launches.intra_bwd(r, w, k, v, a, b, n, inv, states, dS_end, do, **_kw(cfg))
    zeros_v = jnp.zeros(r.shape, v.dtype)            # the identity pass's values, [B, Tp, H, K]
    grads_q = launches.intra_bwd(r, w, k, zeros_v, a, b, n, inv, states_q, dS_end_q,
                                 dq.astype(_F32), **_kw(cfg_q))
    dr, dw, dk, dv, da, db = grads
    dr_q, dw_q, dk_q, _, da_q, db_q = grads_q
    return (dr + dr_q, dw + dw_q, dk + dk_q, dv, da + da_q, db + db_q, ds0, deye, None)


_pair_core.defvjp(_pair_fwd, _pair_bwd)


def wkv7_gpu_pair(r, w, k, v, a, b, initial_state, identity_state, segment_ids=None,
                  chunk_size=32, output_dtype=None, *, precision=None, interpret=False,
                  tuning=None):
    """The value pass and the identity pass of sequence parallelism in one custom_vjp.

    Args: as `wkv7_gpu` (r, w, k, a, b `[B, T, H, K]`, v `[B, T, H, V]` with V <= 64,
    `initial_state` `[B, H, K, V]` float32 or None), plus `identity_state` `[B, H, K, K]`
    float32: the identity pass's start state (the identity, or zeros in rows whose slice starts
    a new document). Returns `(o [B, T, H, V] in output_dtype, final_state [B, H, K, V],
    q [B, T, H, K], M_end [B, H, K, K])`, the last three float32; the same values as
    `wkv7_gpu(..., v, initial_state)` and `wkv7_gpu(..., zeros [B, T, H, K], identity_state,
    output_dtype=float32)`, gradients included.
    """
    validate(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype)
    B, T, H, K = r.shape
    if v.shape[-1] > MAX_V:
        raise ValueError(f"wkv7_gpu_pair: V = {v.shape[-1]} exceeds {MAX_V}; run the two "
                         "passes as separate wkv7 calls")
    if tuple(identity_state.shape) != (B, H, K, K):
        raise ValueError(f"wkv7_gpu_pair: identity_state shape {tuple(identity_state.shape)} "
                         f"must be {(B, H, K, K)}")
    (r, w, k, v, a, b), s0, n, cfg = prepare(r, w, k, v, a, b, initial_state, segment_ids,
                                             chunk_size, output_dtype, precision, interpret,
                                             tuning)
    cfg_q = cfg._replace(out_dtype=jnp.dtype(_F32),
                         tune=resolve(tuning, cfg.C, B * H, min(K, MAX_V)))
    o, sT, q, M_end = _pair_core(r, w, k, v, a, b, s0, identity_state.astype(_F32), n, cfg,
                                 cfg_q)
    if r.shape[1] != T:
        o, q = o[:, :T], q[:, :T]
    return o, sT, q, M_end
