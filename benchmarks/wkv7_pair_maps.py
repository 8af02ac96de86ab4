"""Device benchmark: the WKV7 chunk maps on Pallas Mosaic GPU, two chunks per CTA
(`lwm_jax/ops/wkv7/mosaic_gpu/pair_maps.py`), against the Pallas-Triton chunk launch they would
replace (`launches.intra_fwd` with `split_mq=True, o0_t=True`, what forward-only calls run
before the Mosaic output chain): same inputs, same process, same timer (`wkv7.py`'s `bench`).

    python benchmarks/wkv7_pair_maps.py [--shapes "8,4096,12;4,4096,32"] [--check-only]

Accuracy, at `--check-shape` on RWKV-7-like random bf16 inputs (`testing.random_wkv7_inputs`):
each map (M, D, Q, O0; the bf16 pairs summed in float32) of both launches against the Triton
launch at precision "highest" (IEEE float32 products), `||x - ref|| / ||ref||`; and the
forward's outputs o and final state, each launch followed by the Mosaic output chain
(`state_pass.forward_outputs`), against the float64 token recurrence
(`testing.wkv7_reference_vjp_f64`). Timing: median ms of the chunk launch alone (Triton; the
Mosaic one with and without the XLA chunk cumsum of w that feeds it) and of the whole
forward-only call (chunk launch + output chain). One JSON line per result.
"""
from __future__ import annotations

import argparse
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
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--once", default=None, help="B,T,H: run the Mosaic launch 3 times and stop "
                   "(for a profiler)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from lwm_jax.ops.wkv7.pallas_gpu import launches as gk
    from lwm_jax.ops.wkv7.pallas_gpu.launches import resolve
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
    from lwm_jax.ops.wkv7.mosaic_gpu import pair_maps as pm
    from lwm_jax.ops.wkv7.mosaic_gpu import state_pass as sp
    emit(case="env", jax=jax.__version__, device=str(jax.devices()[0].device_kind))

    def inputs(B, T, H, seed=3):
        xs = random_wkv7_inputs(jax.random.PRNGKey(seed), B, T, H, 64, 64, jnp.bfloat16)
        s0 = 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 2), (B, H, 64, 64), jnp.float32)
        return xs, s0

    def triton(B, H, prec=jax.lax.Precision.DEFAULT):
        kw = dict(H=H, C=C, prec=prec, tune=resolve(None, C, B * H, 64), interpret=False)
        return jax.jit(lambda r, w, k, v, a, b: gk.intra_fwd(
            r, w, k, v, a, b, None, want_inv=False, split_mq=True, o0_t=True, **kw))

    @jax.jit
    def mosaic(r, w, k, v, a, b):
        return pm.pair_maps(r, k, v, a, b, pm.chunk_log_decay(w))

    def forward(maps_fn, H):
        @jax.jit
        def f(xs, s0):
            mh, ml, d, qh, ql, o0t = maps_fn(*xs)
            return sp.forward_outputs(mh, ml, d, qh, ql, o0t, s0, H=H)
        return f

    def as_maps(out):
        mh, ml, d, qh, ql, o0t = (np.asarray(x.astype(jnp.float32), np.float64) for x in out)
        return dict(M=mh + ml, D=d, Q=qh + ql, O0_t=o0t)

    if args.once:
        B, T, H = (int(x) for x in args.once.split(","))
        xs, _ = inputs(B, T, H)
        for _ in range(3):
            jax.block_until_ready(mosaic(*xs))
        return
    B, T, H = (int(x) for x in args.check_shape.split(","))
    xs, s0 = inputs(B, T, H)
    hi = triton(B, H, jax.lax.Precision.HIGHEST)(*xs)
    ref = dict(M=hi[0].astype(jnp.float32) + hi[1].astype(jnp.float32), D=hi[2],
               Q=hi[3].astype(jnp.float32) + hi[4].astype(jnp.float32), O0_t=hi[5])
    ref = {k: np.asarray(v, np.float64) for k, v in ref.items()}
    o_ref, s_ref, _ = wkv7_reference_vjp_f64(xs, s0, None, np.zeros((B, T, H, 64)),
                                             np.zeros((B, H, 64, 64)))
    for name, fn in (("triton", triton(B, H)), ("mosaic", mosaic)):
        try:
            got = as_maps(fn(*xs))
            emit(case="check-maps", backend=name, B=B, T=T, H=H,
                 **{k + "_err": rel_err(got[k], ref[k]) for k in ref},
                 finite=bool(all(np.isfinite(v).all() for v in got.values())))
            o, sT = forward(fn, H)(xs, s0)
            emit(case="check-forward", backend=name, B=B, T=T, H=H,
                 o_err=rel_err(np.asarray(o.astype(jnp.float32)), o_ref),
                 final_err=rel_err(sT, s_ref))
        except Exception as e:  # keep going: the other launch's figures still count
            emit(case="check-error", backend=name, error=repr(e)[:2000])
    if args.check_only:
        return
    for shape in args.shapes.split(";"):
        B, T, H = (int(x) for x in shape.split(","))
        xs, s0 = inputs(B, T, H)
        g = jax.jit(pm.chunk_log_decay)(xs[1])
        maps_only = jax.jit(lambda r, k, v, a, b, g: pm.pair_maps(r, k, v, a, b, g))
        cases = (("triton-intra_fwd", triton(B, H), xs),
                 ("mosaic-pair_maps+cumsum", mosaic, xs),
                 ("mosaic-pair_maps", maps_only, (xs[0], xs[2], xs[3], xs[4], xs[5], g)),
                 ("xla-chunk_cumsum", jax.jit(pm.chunk_log_decay), (xs[1],)),
                 ("forward-triton-maps", forward(triton(B, H), H), (xs, s0)),
                 ("forward-mosaic-maps", forward(mosaic, H), (xs, s0)))
        for name, f, a in cases:
            try:
                emit(case="time", what=name, B=B, T=T, H=H, ms=round(bench(f, *a) * 1e3, 4))
            except Exception as e:
                emit(case="time-error", what=name, B=B, T=T, H=H, error=repr(e)[:600])


if __name__ == "__main__":
    main()
