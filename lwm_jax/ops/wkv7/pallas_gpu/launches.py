"""The Pallas-Triton launches of the GPU WKV7 kernel.

Shapes (after padding T to Tp = NT * C; BH = B * H; intermediates are chunk-major per head):

  intra_fwd   grid (BH, NT), chunk-parallel. Reads r, w, k, a, b [B, Tp, H, K], v [B, Tp, H, V]
              (and the reset counter [B, Tp]); writes M [BH, NT, K, K], D [BH, NT, K, V],
              Q [BH, NT, C, K], O0 [BH, NT, C, V] (float32; for the Mosaic chains M and Q as
              bf16 hi / lo pairs, O0 transposed where the chain writes the outputs) and, for
              the backward, inv [BH, NT, C, C].
  seq_fwd     grid (BH, V / BV), sequential over chunks: S <- M S + D and o = Q S + O0. Writes o
              [B, Tp, H, V], the final state [B, H, K, V] and, for the backward, the state at
              each chunk start [BH, NT, K, V] (per-chunk states only; nothing of size T*K*V).
  out_fwd     grid (BH, NT), used instead of seq_fwd's outputs when few sequential programs
              exist (`Tuning.split_out`): o = Q S + O0 chunk-parallel from the stored states.
  seq_bwd     grid (BH, V / BV), reverse over chunks: dS <- M^T dS + Q^T dO. Writes the
              cotangent of each chunk's end state [BH, NT, K, V] and d(initial state).
  intra_bwd   grid (BH, NT), chunk-parallel: recomputes the chunk's factors from the inputs,
              start state and `inv`, and writes dr, dw, dk, dv, da, db in the inputs' dtypes;
              one launch in "stacked" form (`tiles_bwd_stacked`, all dots 64-row wgmma at C = 32) or
              row form (`tiles`), or two row-form launches (`Tuning.split_bwd`: U, dX, dv
              first, via HBM; C = 64).

`Tuning` holds the launch parameters; `resolve` fills the unset ones from measurements.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lwm_jax.ops.wkv7.pallas_gpu import tf32_round, tiles, tiles_bwd_stacked
from lwm_jax.ops.wkv7.tile_dots import mm, mm_tn, split_bf16

_F32 = jnp.float32
_SQ = pl.squeezed


class Tuning(NamedTuple):
    """Launch parameters; None = pick by `resolve` (measured choices: benchmarks/NOTES-wkv7.md)."""
    block_v: int | None = None      # V columns per program of seq_fwd
    block_v_bwd: int | None = None  # V columns per program of seq_bwd
    warps_intra: int | None = None  # intra_fwd / out_fwd
    warps_seq: int | None = None    # seq_fwd / seq_bwd
    warps_bwd: int | None = None    # intra_bwd (each launch)
    stages_seq: int | None = None   # software pipelining depth of the sequential loops
    split_bwd: bool | None = None   # intra_bwd as two launches (bwd_values, bwd_inputs)
    split_out: bool | None = None   # outputs o = Q S + O0 in a chunk-parallel launch (out_fwd)
    bwd_form: str | None = None     # one-launch backward: "rows" (tiles) or "stacked"
                                    # (tiles_bwd_stacked); IEEE-fp32 mode always uses "rows"
    block_v_chain: int | None = None  # value columns per CTA of the Mosaic chains: 16, 32, 64
    chains: str | None = None       # the chunk chains: "triton" (seq_fwd / seq_bwd) or "mosaic"
                                    # (mosaic_gpu/state_pass.py); None: lwm_jax.ops.wkv7.pallas
                                    # picks by the measured rule (`mosaic_chains`)
    round_tf32: bool | None = None  # TF32 dot operands rounded by the kernels, one instruction
                                    # each (`tf32_round`), not by XLA's pass; None: on sm_90+
    chain_outputs: bool | None = None  # with the gradient, the Mosaic forward chain writes the
                                       # outputs beside the chunk states (else `out_fwd` does)


_BWD_FORMS = {"rows": tiles.intra_backward, "stacked": tiles_bwd_stacked.intra_backward_stacked}


def resolve(tune: Tuning | None, C: int, BH: int, V: int,
            sm_count: int | None = None) -> Tuning:
    """Fill the None fields of `tune` for chunk length C, B*H heads and value size V.

    Chosen by measurement (benchmarks/NOTES-wkv7.md): C <= 32 wants 4 warps for intra_fwd;
    C = 64 wants 8 warps and the two-launch backward; the chunk-parallel output launch pays off
    only when the sequential forward has few programs (long T, few heads); when it writes
    the outputs itself it takes the widest value blocks (64, 32, 16 columns) that keep at least
    7/8 of a wave of programs (2.6x faster than 16 columns at 512 heads). C <= 32 uses the
    stacked one-launch backward with 4 warps (one warpgroup: its 64-row wgmma tiles need no
    more); the row form wanted 8 warps. The sequential launches (one program per head and
    column block, a chain over the chunks) run fastest with 3 pipeline stages and with the
    fewest columns per program that still leave at most one program per SM (`sm_count`;
    default: the first device's, 132 off a GPU): on an H100's 132 SMs, seq_bwd 32 columns at
    64 heads, 64 at 96 (`benchmarks/wkv7.py sweep` times the launches; figures in
    benchmarks/RESULTS-log.md). The Mosaic chains follow the same rule (16 value columns per
    CTA at 32 heads, 32 at 64, 64 from 96 on an H200: the chain's step is latency-bound, and
    narrower columns shorten it while the CTAs still fit one wave). Where the gradient is taken,
    the forward chain writes the outputs beside the chunk states at 32 and 64 value columns
    per CTA (no `out_fwd` launch); at 16 the extra store lengthens the chain's step by more
    than `out_fwd` costs.
    """
    tune = tune or Tuning()
    small = C <= 32
    sms = _sm_count() if sm_count is None else sm_count
    one_wave = lambda options: next((c for c in options if BH * max(V // c, 1) <= sms),
                                    options[-1])
    pick = lambda value, default: default if value is None else value
    # outputs split off below two 16-column programs per SM (264 on the H100 / H200 measured)
    split_out = pick(tune.split_out, BH * (V // min(tune.block_v or 16, V)) < 2 * sms)
    # with outputs (many heads) the forward takes the widest columns that still leave about a
    # full wave of programs: each program then reads Q and M once for more columns
    full_wave = lambda options: next((c for c in options if BH * max(V // c, 1) * 8 >= 7 * sms),
                                     options[-1])
    block_v = min(tune.block_v or (one_wave((16, 32, 64)) if split_out
                                   else full_wave((64, 32, 16))), V)
    form = pick(tune.bwd_form, "stacked" if small else "rows")
    block_v_chain = pick(tune.block_v_chain, one_wave((16, 32, 64)))
    if form not in _BWD_FORMS:
        raise ValueError(f"Tuning.bwd_form must be one of {sorted(_BWD_FORMS)}, got {form!r}")
    return Tuning(
        block_v=block_v, block_v_bwd=min(tune.block_v_bwd or one_wave((32, 64)), V),
        warps_intra=pick(tune.warps_intra, 4 if small else 8), warps_seq=pick(tune.warps_seq, 4),
        warps_bwd=pick(tune.warps_bwd, 8 if form == "rows" else 4),
        stages_seq=pick(tune.stages_seq, 3), split_bwd=pick(tune.split_bwd, not small),
        split_out=split_out, bwd_form=form,
        block_v_chain=block_v_chain, chains=tune.chains, round_tf32=tune.round_tf32,
        chain_outputs=pick(tune.chain_outputs, block_v_chain >= 32))


def _sm_count(default: int = 132) -> int:
    """Streaming multiprocessors of the first device (a GPU); `default` (an H100's 132)
    elsewhere, e.g. for interpret mode on CPU."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or default) if device.platform == "gpu" \
        else default


def _chunk_precision(prec, tune, interpret):
    """The precision of the chunk-parallel launches' products: `prec`, or its form whose operands
    the kernel rounds itself (`tf32_round.kernel_precision`, per `tune.round_tf32`). The
    sequential launches and `out_fwd` keep `prec` (XLA rounds): the kernel's own rounding
    measured no faster there (benchmarks/RESULTS-log.md, 2026-11-29)."""
    return tf32_round.kernel_precision(prec, interpret=interpret, wanted=tune.round_tf32)


def _params(num_warps, num_stages=1):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _tile_spec(C, D, H):
    """[B, Tp, H, D] -> the [C, D] tile of chunk c of head bh (grid (BH, NT))."""
    return pl.BlockSpec((_SQ, C, _SQ, D), lambda bh, c: (bh // H, c, bh % H, 0))


def _chunk_inputs(r, w, k, v, a, b, n_BT, C, H):
    """Block specs and operands of a chunk-parallel launch: one [C, K] (v: [C, V]) tile of
    r, w, k, v, a, b per (b·h, chunk), plus the reset counters `n_BT` [B, T] when given."""
    kspec, vspec = _tile_spec(C, r.shape[-1], H), _tile_spec(C, v.shape[-1], H)
    in_specs = [kspec, kspec, kspec, vspec, kspec, kspec]
    args = [r, w, k, v, a, b]
    if n_BT is not None:
        in_specs.append(pl.BlockSpec((_SQ, C), lambda bh, c: (bh // H, c)))
        args.append(n_BT)
    return kspec, vspec, in_specs, args

def _chunk_spec(X, Y):
    """[BH, NT, X, Y] -> the [X, Y] block of (bh, c) (grid (BH, NT))."""
    return pl.BlockSpec((_SQ, _SQ, X, Y), lambda bh, c: (bh, c, 0, 0))


def _io(in_names, in_refs, out_names, out_refs):
    """Loader/storer callbacks over named refs (inputs upcast to f32, outputs cast to ref dtype)."""
    ins = dict(zip(in_names, in_refs))
    outs = dict(zip(out_names, out_refs))

    def ld(name):
        return ins[name][...].astype(_F32)

    def st(name, value):
        if name in outs:
            outs[name][...] = value.astype(outs[name].dtype)
    return ld, st


def intra_fwd(r, w, k, v, a, b, n_BT, *, H, C, prec, want_inv, tune, interpret,
              split_mq=False, o0_t=False):
    """Chunk maps `(M, D, Q, O0[, inv])`, float32. With `split_mq` M and Q are each written as
    a bfloat16 pair (`tile_dots.split_bf16`, same bytes as float32): `(M_hi, M_lo, D, Q_hi, Q_lo, O0
    [, inv])`, the inputs of the Mosaic GPU chunk chains; with `o0_t` O0 is written transposed,
    [BH, NT, V, C] (the forward chain that writes the outputs takes it so)."""
    B, Tp, _, K = r.shape
    V = v.shape[-1]
    BH, NT = B * H, Tp // C
    has_n = n_BT is not None
    prec = _chunk_precision(prec, tune, interpret)

    pairs = ("M", "Q") if split_mq else ()
    names = [(nm + "_hi", nm + "_lo") if nm in pairs else (nm,) for nm in ("M", "D", "Q", "O0")]
    out_names = sum(names, ()) + (("inv",) if want_inv else ())

    def kernel(*refs):
        n = refs[6][...] if has_n else None
        ld, st_ref = _io("rwkvab", refs[:6], out_names, refs[6 + has_n:])

        def st(name, value):
            if name in pairs:
                for part, x in zip(("_hi", "_lo"), split_bf16(value)):
                    st_ref(name + part, x)
            elif name == "O0" and o0_t:
                st_ref(name, value.T)
            else:
                st_ref(name, value)
        tiles.intra_forward(ld, st, n, prec)

    kspec, vspec, in_specs, args = _chunk_inputs(r, w, k, v, a, b, n_BT, C, H)
    shapes = [(K, K), (K, V), (C, K), (V, C) if o0_t else (C, V)]
    out_shape, out_specs = [], []
    for group, s in zip(names, shapes):
        dtype = jnp.bfloat16 if len(group) == 2 else _F32
        out_shape += [jax.ShapeDtypeStruct((BH, NT) + s, dtype)] * len(group)
        out_specs += [_chunk_spec(*s)] * len(group)
    if want_inv:
        out_shape.append(jax.ShapeDtypeStruct((BH, NT, C, C), _F32))
        out_specs.append(_chunk_spec(C, C))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(BH, NT), in_specs=in_specs, out_specs=out_specs,
        compiler_params=_params(tune.warps_intra), interpret=interpret, name="wkv7_intra_fwd",
    )(*args)


def _seq_specs(NT, X, Y, BV_last):
    """[BH, NT, X, Y] -> all chunks of head bh; Y blocked by BV_last when given (grid (BH, NV))."""
    if BV_last is None:
        return pl.BlockSpec((_SQ, NT, X, Y), lambda bh, j: (bh, 0, 0, 0))
    return pl.BlockSpec((_SQ, NT, X, BV_last), lambda bh, j: (bh, 0, 0, j))


def seq_fwd(M, D, Q, O0, s0, *, H, C, prec, out_dtype, want_states, tune, interpret):
    """Sequential forward. Returns (o, final_state[, states]); with `tune.split_out` it computes
    no outputs (o is None) and always returns the states, for `out_fwd`."""
    BH, NT, K, V = D.shape
    B = BH // H
    BV = min(tune.block_v, V)
    Tp = NT * C
    with_out = not tune.split_out
    want_states = want_states or not with_out

    def kernel(*refs):
        M_ref, D_ref = refs[:2]
        if with_out:
            Q_ref, O0_ref, s0_ref, o_ref, sT_ref, *st_ref = refs[2:]
        else:
            s0_ref, sT_ref, *st_ref = refs[2:]

        def body(c, S):
            if want_states:
                st_ref[0][c] = S
            if with_out:
                o = mm(Q_ref[c], S, prec) + O0_ref[c]
                o_ref[pl.ds(c * C, C), :] = o.astype(o_ref.dtype)
            return mm(M_ref[c], S, prec) + D_ref[c]

        sT_ref[...] = jax.lax.fori_loop(0, NT, body, s0_ref[...])

    state_spec = pl.BlockSpec((_SQ, _SQ, K, BV), lambda bh, j: (bh // H, bh % H, 0, j))
    in_specs = [_seq_specs(NT, K, K, None), _seq_specs(NT, K, V, BV)]
    args = [M, D]
    out_shape, out_specs = [], []
    if with_out:
        in_specs += [_seq_specs(NT, C, K, None), _seq_specs(NT, C, V, BV)]
        args += [Q, O0]
        out_shape.append(jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype))
        out_specs.append(pl.BlockSpec((_SQ, Tp, _SQ, BV), lambda bh, j: (bh // H, 0, bh % H, j)))
    out_shape.append(jax.ShapeDtypeStruct((B, H, K, V), _F32))
    out_specs.append(state_spec)
    if want_states:
        out_shape.append(jax.ShapeDtypeStruct((BH, NT, K, V), _F32))
        out_specs.append(_seq_specs(NT, K, V, BV))
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(BH, V // BV), in_specs=in_specs + [state_spec],
        out_specs=out_specs, compiler_params=_params(tune.warps_seq, tune.stages_seq),
        interpret=interpret, name="wkv7_seq_fwd",
    )(*args, s0)
    return outs if with_out else (None, *outs)


def out_fwd(Q, O0, states, *, H, C, prec, out_dtype, tune, interpret):
    """Chunk-parallel outputs o = Q S0 + O0 -> [B, Tp, H, V] (used with `tune.split_out` and
    after the Mosaic GPU chains). `Q` is float32 or a `tile_dots.split_bf16` pair (hi, lo),
    summed."""
    BH, NT, K, V = states.shape
    B = BH // H
    qs = tuple(Q) if isinstance(Q, (tuple, list)) else (Q,)

    def kernel(*refs):
        *q_refs, O0_ref, s_ref, o_ref = refs
        q = sum(ref[...].astype(_F32) for ref in q_refs)
        o_ref[...] = (mm(q, s_ref[...], prec) + O0_ref[...]).astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((B, NT * C, H, V), out_dtype), grid=(BH, NT),
        in_specs=[_chunk_spec(C, K)] * len(qs) + [_chunk_spec(C, V), _chunk_spec(K, V)],
        out_specs=_tile_spec(C, V, H), compiler_params=_params(tune.warps_intra),
        interpret=interpret, name="wkv7_out_fwd",
    )(*qs, O0, states)


def seq_forward(M, D, Q, O0, s0, *, H, C, prec, out_dtype, want_states, tune, interpret):
    """The sequential forward as the op runs it: `seq_fwd`, then `out_fwd` where the tuning
    splits the outputs off. Returns `(o, final_state, states or None)` (the chunk states also
    when the split needed them)."""
    kw = dict(H=H, C=C, prec=prec, tune=tune, interpret=interpret)
    o, sT, *states = seq_fwd(M, D, Q, O0, s0, out_dtype=out_dtype, want_states=want_states, **kw)
    states = states[0] if states else None
    if o is None:
        o = out_fwd(Q, O0, states, out_dtype=out_dtype, **kw)
    return o, sT, states


def seq_bwd(M, Q, do, dsT, *, H, C, prec, tune, interpret):
    BH, NT, K, _ = M.shape
    B = BH // H
    V = do.shape[-1]
    BV = min(tune.block_v_bwd, V)
    Tp = NT * C

    def kernel(M_ref, Q_ref, do_ref, dsT_ref, dS_ref, ds0_ref):
        def body(i, dS):
            c = NT - 1 - i
            dS_ref[c] = dS
            dO = do_ref[pl.ds(c * C, C), :].astype(_F32)
            return mm_tn(M_ref[c], dS, prec) + mm_tn(Q_ref[c], dO, prec)

        ds0_ref[...] = jax.lax.fori_loop(0, NT, body, dsT_ref[...])

    state_spec = pl.BlockSpec((_SQ, _SQ, K, BV), lambda bh, j: (bh // H, bh % H, 0, j))
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((BH, NT, K, V), _F32),
                   jax.ShapeDtypeStruct((B, H, K, V), _F32)],
        grid=(BH, V // BV),
        in_specs=[_seq_specs(NT, K, K, None), _seq_specs(NT, C, K, None),
                  pl.BlockSpec((_SQ, Tp, _SQ, BV), lambda bh, j: (bh // H, 0, bh % H, j)),
                  state_spec],
        out_specs=[_seq_specs(NT, K, V, BV), state_spec],
        compiler_params=_params(tune.warps_seq, tune.stages_seq), interpret=interpret,
        name="wkv7_seq_bwd",
    )(M, Q, do, dsT)


def intra_bwd(r, w, k, v, a, b, n_BT, inv, states, dS_end, do, *, H, C, prec, tune,
              interpret):
    """Input gradients (dr, dw, dk, dv, da, db) in the inputs' dtypes; one or two launches."""
    B, Tp, _, K = r.shape
    V = v.shape[-1]
    BH, NT = B * H, Tp // C
    has_n = n_BT is not None
    prec = _chunk_precision(prec, tune, interpret)
    kspec, vspec, in_specs, args = _chunk_inputs(r, w, k, v, a, b, n_BT, C, H)
    grad_shape = {nm: jax.ShapeDtypeStruct(x.shape, x.dtype) for nm, x in
                  zip(("dr", "dw", "dk", "dv", "da", "db"), (r, w, k, v, a, b))}
    grad_spec = {nm: (vspec if nm == "dv" else kspec) for nm in grad_shape}

    def launch(fn, extra_names, extra_specs, extra_args, out_names, out_shape, out_specs, name,
               warps=tune.warps_bwd):
        in_names = ("r", "w", "k", "v", "a", "b") + extra_names

        def kernel(*refs):
            n = refs[6][...] if has_n else None
            in_refs = refs[:6] + refs[6 + has_n:6 + has_n + len(extra_names)]
            ld, st = _io(in_names, in_refs, out_names, refs[6 + has_n + len(extra_names):])
            fn(ld, st, n, prec)
        return pl.pallas_call(
            kernel, out_shape=out_shape, grid=(BH, NT), in_specs=in_specs + extra_specs,
            out_specs=out_specs, compiler_params=_params(warps),
            interpret=interpret, name=name)(*args, *extra_args)

    kv = _chunk_spec(K, V)
    names = ("inv", "S0", "dSC", "dO")
    specs = [_chunk_spec(C, C), kv, kv, vspec]
    if not tune.split_bwd:
        outs = ("dr", "dw", "dk", "dv", "da", "db")
        form, warps = tune.bwd_form, tune.warps_bwd
        if prec == jax.lax.Precision.HIGHEST and form != "rows":
            # IEEE fp32 dots have no tensor-core path: the 64 x 64 tiles of the other forms
            # would lower to FMA loops that spill heavily (ptxas; benchmarks/NOTES-wkv7.md), so
            # exact mode runs the row form with its 8 warps.
            form, warps = "rows", 8
        return launch(_BWD_FORMS[form], names, specs, [inv, states, dS_end, do], outs,
                      [grad_shape[o] for o in outs], [grad_spec[o] for o in outs],
                      "wkv7_intra_bwd", warps)
    cv = jax.ShapeDtypeStruct((BH, NT, C, V), _F32)
    U, dX, dv = launch(tiles.bwd_values, names, specs, [inv, states, dS_end, do],
                       ("U", "dX", "dv"), [cv, cv, grad_shape["dv"]],
                       [_chunk_spec(C, V), _chunk_spec(C, V), vspec], "wkv7_bwd_values")
    outs = ("dr", "dw", "dk", "da", "db")
    dr, dw, dk, da, db = launch(
        tiles.bwd_inputs, ("S0", "dSC", "dO", "U", "dX"),
        [kv, kv, vspec, _chunk_spec(C, V), _chunk_spec(C, V)], [states, dS_end, do, U, dX],
        outs, [grad_shape[o] for o in outs], [grad_spec[o] for o in outs], "wkv7_bwd_inputs")
    return dr, dw, dk, dv, da, db
