"""Device benchmark: the Mosaic GPU WKV7 forward (lwm_jax/ops/wkv7/mosaic_gpu) against our
Pallas-Triton forward (`wkv7(..., impl="pallas")`) and jla's Mosaic GPU forward, same inputs,
same process, same timer.

    python benchmarks/wkv7_mosaic.py [check] [time] [--shapes "8,4096,12,64;4,4096,32,64"]
                                     [--peers ours,jla] [--variants phase1,tf32,x3] [--reps 50]

Variants of ours-Mosaic (`--variants`): "fused" (fwd.py, one CTA per head), "phase1" /
"phase1-old" (the chunk-parallel maps of two_phase.py alone), and the two-phase forward
`wkv7_mosaic_fwd2` with phase 2 on the Pallas-Triton `seq_fwd`/`out_fwd` launches in TF32
("tf32" -> 2ph-tf32) or tf32x3 ("x3" -> 2ph-x3; "nab": x3 without automatic barriers), or on
the XLA-scan fallback ("mseq" -> 2ph-xla, slow).

jla: `pip install --no-index --no-deps --target /tmp/site
.peer/jax_linear_attention-0.1.0-py3-none-any.whl` and PYTHONPATH=/tmp/site (skipped with a
note when it does not import).

Inputs: the peer harness's (`.peer/wkv7_peers.py::make`, rebuilt here in NumPy): bf16 r, k, v,
a = -kk, b = kk * sigmoid(.), w = bf16(-e^{-1/2} sigmoid(u)). `check` prints the relative error
||o - ref|| / ||ref|| against the float64 recurrence (`reference.py`) at (1, 1024, 4, 64) for
every implementation (the harness's accuracy case), and a few extra cases for ours-Mosaic
(T not a multiple of 32, an initial state and the final state, float32 w). `time` prints the
median forward ms over `--reps` jitted calls after 3 warm-ups (block_until_ready).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from lwm_jax.ops.wkv7.reference import wkv7_reference_np  # noqa: E402

LB = -0.6065306597126334


def make(B, T, H, D, seed):
    """r, w, k, v, a, b as bf16 NumPy arrays, drawn as the peer harness draws them."""
    rng = np.random.default_rng(seed)
    rn = lambda: rng.standard_normal((B, T, H, D), dtype=np.float32)  # noqa: E731
    r, k, v = rn(), rn() * .5, rn()
    u = (rn() * 2 - 1).astype(ml_dtypes.bfloat16).astype(np.float32)
    w = (LB / (1 + np.exp(-u))).astype(np.float32)
    kk = rn()
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a = 1 / (1 + np.exp(-rn()))
    bf = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    return [bf(r), bf(w), bf(k), bf(v), bf(-kk), bf(kk * a)]


def rel(x, ref):
    x = np.asarray(x, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def triton_seq(precision):
    """Phase 2 of `wkv7_mosaic_fwd2` on our Pallas-Triton launches (`seq_fwd`, and `out_fwd`
    where `launches.resolve` splits the outputs off), matmuls in `precision` ("default" =
    TF32, "tf32x3")."""
    from lwm_jax.ops.wkv7.pallas_gpu import launches
    from lwm_jax.ops.wkv7.pallas_gpu.op import PRECISIONS

    def seq(M, D, Q, O0, s0, *, H, out_dtype):
        tune = launches.resolve(None, 32, M.shape[0], 64)
        kw = dict(H=H, C=32, prec=PRECISIONS[precision], tune=tune, interpret=False)
        o, sT, *states = launches.seq_fwd(M, D, Q, O0, s0, out_dtype=out_dtype,
                                          want_states=False, **kw)
        if o is None:
            o = launches.out_fwd(Q, O0, states[0], out_dtype=out_dtype, **kw)
        return o, sT
    seq.__name__ = f"triton_seq_{precision}"
    return seq


def two_phase_variants(names):
    """name -> (seq, no_auto_barriers) of the two-phase forward variants asked for."""
    from lwm_jax.ops.wkv7.mosaic_gpu import two_phase
    table = {}
    if "tf32" in names:
        table["2ph-tf32"] = (triton_seq("default"), False)
    if "x3" in names:
        table["2ph-x3"] = (triton_seq("tf32x3"), False)
    if "nab" in names:
        table["2ph-x3-nab"] = (table.get("2ph-x3", (triton_seq("tf32x3"),))[0], True)
    if "mseq" in names:
        table["2ph-xla"] = (None, False)
    return table, two_phase


def implementations(names):
    fns = {}
    from lwm_jax.ops.wkv7.mosaic_gpu import wkv7_mosaic_fwd
    if "fused" in names:
        fns["mosaic"] = lambda r, w, k, v, a, b: wkv7_mosaic_fwd(r, w, k, v, a, b)[0]
    table, two_phase = two_phase_variants(names)
    for name, (seq, nab) in table.items():
        fns[name] = (lambda seq, nab: lambda r, w, k, v, a, b: two_phase.wkv7_mosaic_fwd2(
            r, w, k, v, a, b, seq=seq, no_auto_barriers=nab)[0])(seq, nab)
    if "phase1" in names:
        from lwm_jax.ops.wkv7.mosaic_gpu.chunks import chunk_maps
        fns["phase1"] = lambda r, w, k, v, a, b: chunk_maps(r, (w,), k, v, a, b)
    if "phase1-old" in names:  # phase 1 on fwd._chunk_terms as the one-CTA-per-head kernel has it
        from lwm_jax.ops.wkv7.mosaic_gpu.chunks import chunk_maps
        fns["phase1-old"] = lambda r, w, k, v, a, b: chunk_maps(r, (w,), k, v, a, b, lean=False)
    if "ours" in names:
        from lwm_jax.ops.wkv7 import wkv7
        fns["ours-triton"] = lambda r, w, k, v, a, b: wkv7(r, w, k, v, a, b, impl="pallas")
    if "jla" in names:
        try:
            from jla.ops import linear_attention
            fns["jla"] = lambda r, w, k, v, a, b: linear_attention(
                "rwkv7", r, k, v, w=w, a=a, b=b, scale=1.0, impl="mosaic_gpu", chunk_size=32,
                lower_bound=-0.61)[0]
        except ImportError as err:
            print(f"NOTE jla not importable ({err}); skipped", flush=True)
    return fns


def fns_names(fns):
    """The variant keys of `two_phase_variants` that the names in `fns` came from."""
    keys = {"2ph-tf32": "tf32", "2ph-x3": "x3", "2ph-x3-nab": "nab", "2ph-xla": "mseq"}
    return [keys[n] for n in fns if n in keys]


def check(fns):
    xs = make(1, 1024, 4, 64, seed=1024)
    ref, _ = wkv7_reference_np(*[x.astype(np.float64) for x in xs])
    for name, fn in fns.items():
        if name.startswith("phase1"):
            continue
        try:
            o = jax.jit(fn)(*[jnp.asarray(x) for x in xs])
        except Exception as err:  # noqa: BLE001 - report and go on
            print("ACC", name, f"error: {type(err).__name__}: {str(err)[:2000]}", flush=True)
            continue
        print("ACC", name, json.dumps(dict(shape=[1, 1024, 4, 64], o_rel=rel(o, ref))), flush=True)
    # extra cases for the Mosaic kernels: ragged T, initial + final state, float32 w
    from lwm_jax.ops.wkv7.mosaic_gpu import wkv7_mosaic_fwd
    from lwm_jax.ops.wkv7.mosaic_gpu.two_phase import wkv7_mosaic_fwd2
    table = {"mosaic": lambda *xs, **kw: wkv7_mosaic_fwd(*xs, **kw)} if "mosaic" in fns else {}
    for name, (seq, nab) in two_phase_variants(list(fns_names(fns)))[0].items():
        table[name] = (lambda seq, nab: lambda *xs, **kw: wkv7_mosaic_fwd2(
            *xs, seq=seq, no_auto_barriers=nab, **kw))(seq, nab)
    for (B, T, H, seed, f32w), (name, fwd) in ((case, item) for case in (
            (2, 200, 3, 7, False), (1, 512, 2, 8, True)) for item in table.items()):
        xs = make(B, T, H, 64, seed)
        rng = np.random.default_rng(seed + 1)
        s0 = (0.5 * rng.standard_normal((B, H, 64, 64))).astype(np.float32)
        w = xs[1]
        if f32w:  # a float32 log-decay that bf16 cannot hold
            w = (LB / (1 + np.exp(-rng.standard_normal(w.shape)))).astype(np.float32)
        args = [xs[0], w] + xs[2:]
        ref, ref_s = wkv7_reference_np(*[np.asarray(x, np.float64) for x in args],
                                       initial_state=s0.astype(np.float64))
        try:
            o, sT = fwd(*[jnp.asarray(x) for x in args], initial_state=jnp.asarray(s0),
                        output_dtype=jnp.float32)
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"ACC {name}-extra error: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        print(f"ACC {name}-extra", json.dumps(dict(shape=[B, T, H, 64], f32_w=f32w,
                                                   o_rel_f32out=rel(o, ref),
                                                   state_rel=rel(sT, ref_s))), flush=True)


def timing(fns, shapes, reps):
    rows = []
    for shape in shapes:
        xs = [jnp.asarray(x) for x in make(*shape, seed=0)]
        row = {"shape": list(shape)}
        for name, fn in fns.items():
            f = jax.jit(fn)
            try:
                t0 = time.time()
                jax.block_until_ready(f(*xs))
                first = time.time() - t0
                for _ in range(3):
                    jax.block_until_ready(f(*xs))
                ts = []
                for _ in range(reps):
                    t = time.perf_counter()
                    jax.block_until_ready(f(*xs))
                    ts.append(time.perf_counter() - t)
                row[name] = round(float(np.median(ts)) * 1e3, 4)
                row[name + "_first_s"] = round(first, 1)
            except Exception as err:  # noqa: BLE001 - report and go on
                row[name] = f"error: {type(err).__name__}: {str(err)[:300]}"
        print("SPEED", json.dumps(row), flush=True)
        rows.append(row)
    names = list(fns)
    print("\n| shape (B,T,H,K) | " + " | ".join(f"{n} fwd ms" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for row in rows:
        print(f"| {tuple(row['shape'])} | " + " | ".join(str(row.get(n)) for n in names) + " |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("modes", nargs="*", default=["check", "time"])
    p.add_argument("--shapes", default="8,4096,12,64;4,4096,32,64;1,32768,32,64;16,2048,32,64")
    p.add_argument("--peers", default="ours,jla")
    p.add_argument("--variants", default="phase1,tf32,x3",
                   help="fused (the one-CTA-per-head kernel), phase1 / phase1-old (phase 1 "
                        "alone, lean"
                        " / fwd._chunk_terms), two-phase"
                        " with phase 2 on: tf32 / x3 (Triton, TF32 / tf32x3), nab (x3 without"
                        " automatic barriers), mseq (the XLA-scan fallback, slow)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    print("DEVICE", jax.devices()[0].device_kind, "jax", jax.__version__,
          time.strftime("%Y-%m-%d"), flush=True)
    fns = implementations(args.variants.split(",") + args.peers.split(","))
    if "check" in args.modes:
        check(fns)
    if "time" in args.modes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
        timing(fns, shapes, args.reps)


if __name__ == "__main__":
    main()
