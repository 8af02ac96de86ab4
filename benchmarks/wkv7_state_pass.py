"""Device benchmark: the chunk chains of the WKV7 GPU kernel on Pallas Mosaic GPU
(`lwm_jax/ops/wkv7/mosaic_gpu/state_pass.py`) against the Pallas-Triton `seq_fwd` / `seq_bwd`
launches they would replace: same maps, same process, same timer (`wkv7.py`'s `bench`).

    python benchmarks/wkv7_state_pass.py [--shapes "8,4096,12;2,4096,32"] [--blocks-v 64,32,16]
                                         [--check-only]

Maps: the Triton chunk launch (`launches.intra_fwd`) on RWKV-7-like random bf16 inputs
(`testing.random_wkv7_inputs`); M and Q split into bf16 hi / lo by XLA here (what the chunk
launch writes for the Mosaic chains). Accuracy: every chunk state (forward) and every
end-state cotangent (backward) against the same chains in float64 NumPy on the same float32
maps (`testing.chunk_chains_f64`), `||x - ref|| / ||ref||` over all chunks, for both
backends; the outputs o = Q S + O0 (bf16) of the forward that writes them against the same in
float64. Timing: median ms of one launch: the forward chains writing the chunk states (what
the gradient needs), the forward writing the outputs (Triton as the op runs it by default:
`seq_fwd` with outputs, or states then `out_fwd`; Mosaic: `forward_outputs`), the backward
chains; the Mosaic ones at each value-block width (`block_v`: value columns per CTA). One
JSON line per result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.wkv7 import bench, emit  # noqa: E402

SHAPES = "8,4096,12;4,4096,32;1,32768,32;16,2048,32;2,4096,32"
C = 32


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="B,T,H;... (K = V = 64)")
    p.add_argument("--check-shape", default="2,1024,4")
    p.add_argument("--blocks-v", default="64,32,16", help="the Mosaic chains' value blocks")
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from lwm_jax.ops.wkv7.pallas_gpu import launches as gk
    from lwm_jax.ops.wkv7.pallas_gpu.launches import Tuning, resolve
    from lwm_jax.ops.wkv7.testing import chunk_chains_f64, random_wkv7_inputs
    from lwm_jax.ops.wkv7.tile_dots import split_bf16
    from lwm_jax.ops.wkv7.mosaic_gpu import state_pass as sp
    emit(case="env", jax=jax.__version__, device=str(jax.devices()[0].device_kind))
    prec = jax.lax.Precision.DEFAULT

    def maps(B, T, H, seed=3):
        xs = random_wkv7_inputs(jax.random.PRNGKey(seed), B, T, H, 64, 64, jnp.bfloat16)
        do = jax.random.normal(jax.random.PRNGKey(seed + 1), (B, T, H, 64), jnp.bfloat16)
        s0 = 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 2), (B, H, 64, 64), jnp.float32)
        kw = dict(H=H, C=C, prec=prec, tune=resolve(Tuning(split_out=True), C, B * H, 64),
                  interpret=False)
        M, Dm, Q, O0 = jax.jit(lambda xs: gk.intra_fwd(*xs, None, want_inv=False, **kw))(xs)
        return dict(M=M, D=Dm, Q=Q, O0=O0, do=do, s0=s0, kw=kw,
                    mh=split_bf16(M), qh=split_bf16(Q))

    def triton_fwd(p):
        kw = p["kw"]
        f = jax.jit(lambda M, Dm, Q, O0, s0: gk.seq_fwd(M, Dm, Q, O0, s0, out_dtype=jnp.bfloat16,
                                                        want_states=True, **kw))
        return f, (p["M"], p["D"], p["Q"], p["O0"], p["s0"])

    def triton_bwd(p):
        kw = p["kw"]
        f = jax.jit(lambda M, Q, do, s: gk.seq_bwd(M, Q, do, s, **kw))
        return f, (p["M"], p["Q"], p["do"], p["s0"])

    blocks = [int(x) for x in args.blocks_v.split(",")]

    def mosaic_fwd(p, bv):
        f = jax.jit(lambda mh, ml, d, s0: sp.forward_states(mh, ml, d, s0, block_v=bv))
        return f, (*p["mh"], p["D"], p["s0"])

    def triton_out(p, B, H):
        """seq_fwd as the op runs it by default (outputs, or states then `out_fwd`)."""
        kw = dict(p["kw"], tune=resolve(None, C, B * H, 64))
        f = jax.jit(lambda *a: gk.seq_forward(*a, out_dtype=jnp.bfloat16,
                                                  want_states=False, **kw)[:2])
        return f, (p["M"], p["D"], p["Q"], p["O0"], p["s0"])

    def mosaic_out(p, H, bv):
        f = jax.jit(lambda mh, ml, d, qh, ql, o0, s0: sp.forward_outputs(
            mh, ml, d, qh, ql, o0, s0, H=H, block_v=bv))
        o0 = jnp.swapaxes(p["O0"], -1, -2) if bv == 64 else p["O0"]   # as the op passes it
        return f, (*p["mh"], p["D"], *p["qh"], o0, p["s0"])

    def mosaic_bwd(p, H, bv):
        f = jax.jit(lambda mh, ml, qh, ql, do, s: sp.backward_states(mh, ml, qh, ql, do, s, H=H,
                                                                     block_v=bv))
        return f, (*p["mh"], *p["qh"], p["do"], p["s0"])

    B, T, H = (int(x) for x in args.check_shape.split(","))
    p = maps(B, T, H)
    # s0 is both the start state and the final state's cotangent, as the timed launches take it
    ref_states, ref_final, ref_dS, _ = chunk_chains_f64(p["M"], p["D"], p["Q"], p["do"], p["s0"],
                                                p["s0"], H)
    rel = lambda x, r: float(np.linalg.norm(np.asarray(x, np.float64) - r)  # noqa: E731
                             / np.linalg.norm(r))
    backends = [("triton", lambda: (triton_fwd(p), triton_bwd(p)))] + [
        (f"mosaic-bv{bv}", lambda bv=bv: (mosaic_fwd(p, bv), mosaic_bwd(p, H, bv)))
        for bv in blocks]
    for name, run in backends:
        try:
            (ff, fa), (bf, ba) = run()
            out_f = ff(*fa)
            states = out_f[-1] if name == "triton" else out_f[0]
            dS, _ = bf(*ba)
            emit(case="check", backend=name, B=B, T=T, H=H,
                 states_err=rel(states, ref_states), dS_err=rel(dS, ref_dS),
                 dS_end0_nonzero=bool(np.abs(np.asarray(dS[:, 0])).max() > 0))
        except Exception as e:  # keep going: the other backend's figures still count
            emit(case="check-error", backend=name, error=repr(e)[:1500])
    # outputs o = Q S + O0 per chunk from the float64 states, as [B, T, H, V]
    ref_o = np.einsum("ncik,nckv->nciv",
                      np.asarray(p["Q"], np.float64), ref_states) + np.asarray(p["O0"], np.float64)
    NT = T // C
    ref_o = ref_o.reshape(B, H, NT * C, 64).transpose(0, 2, 1, 3)
    for name, run in [("triton-out", lambda: triton_out(p, B, H))] + [
            (f"mosaic-out-bv{bv}", lambda bv=bv: mosaic_out(p, H, bv)) for bv in blocks]:
        try:
            f, a = run()
            o, sT = f(*a)
            emit(case="check-out", backend=name, B=B, T=T, H=H,
                 o_err=rel(np.asarray(o.astype(jnp.float32)), ref_o),
                 final_err=rel(sT, ref_final.reshape(sT.shape)))
        except Exception as e:
            emit(case="check-error", backend=name, error=repr(e)[:1500])
    if args.check_only:
        return
    for shape in args.shapes.split(";"):
        B, T, H = (int(x) for x in shape.split(","))
        p = maps(B, T, H)
        runs = [("triton-seq_fwd", lambda: triton_fwd(p)),
                ("triton-seq_fwd-default", lambda: triton_out(p, B, H)),
                ("triton-seq_bwd", lambda: triton_bwd(p))]
        for bv in blocks:
            runs += [(f"mosaic-seq_fwd-bv{bv}", lambda bv=bv: mosaic_fwd(p, bv)),
                     (f"mosaic-seq_fwd-out-bv{bv}", lambda bv=bv: mosaic_out(p, H, bv)),
                     (f"mosaic-seq_bwd-bv{bv}", lambda bv=bv: mosaic_bwd(p, H, bv))]
        for name, fn in runs:
            try:
                f, a = fn()
                emit(case="time", what=name, B=B, T=T, H=H, ms=round(bench(f, *a) * 1e3, 4))
            except Exception as e:
                emit(case="time-error", what=name, B=B, T=T, H=H, error=repr(e)[:600])


if __name__ == "__main__":
    main()
