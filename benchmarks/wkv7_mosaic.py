"""Device benchmark: the Mosaic GPU WKV7 forward (lwm_jax/ops/wkv7/mosaic_gpu) against our
Pallas-Triton forward (`wkv7(..., impl="pallas")`) and jla's Mosaic GPU forward, same inputs,
same process, same timer.

    python benchmarks/wkv7_mosaic.py [check] [time] [--shapes "8,4096,12,64;4,4096,32,64"]
                                     [--peers ours,jla] [--reps 50]

jla: `pip install --no-index --no-deps --target /tmp/site
.peer/jax_linear_attention-0.1.0-py3-none-any.whl` and PYTHONPATH=/tmp/site (skipped with a note when it does not import).

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


def implementations(names):
    fns = {}
    from lwm_jax.ops.wkv7.mosaic_gpu import wkv7_mosaic_fwd
    fns["mosaic"] = lambda r, w, k, v, a, b: wkv7_mosaic_fwd(r, w, k, v, a, b)[0]
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


def check(fns):
    xs = make(1, 1024, 4, 64, seed=1024)
    ref, _ = wkv7_reference_np(*[x.astype(np.float64) for x in xs])
    for name, fn in fns.items():
        o = jax.jit(fn)(*[jnp.asarray(x) for x in xs])
        print("ACC", name, json.dumps(dict(shape=[1, 1024, 4, 64], o_rel=rel(o, ref))), flush=True)
    # extra cases for the Mosaic kernel: ragged T, initial + final state, float32 w
    from lwm_jax.ops.wkv7.mosaic_gpu import wkv7_mosaic_fwd
    for B, T, H, seed, f32w in ((2, 200, 3, 7, False), (1, 512, 2, 8, True)):
        xs = make(B, T, H, 64, seed)
        rng = np.random.default_rng(seed + 1)
        s0 = (0.5 * rng.standard_normal((B, H, 64, 64))).astype(np.float32)
        w = xs[1]
        if f32w:  # a float32 log-decay that bf16 cannot hold
            w = (LB / (1 + np.exp(-rng.standard_normal(w.shape)))).astype(np.float32)
        args = [xs[0], w] + xs[2:]
        ref, ref_s = wkv7_reference_np(*[np.asarray(x, np.float64) for x in args],
                                       initial_state=s0.astype(np.float64))
        o, sT = wkv7_mosaic_fwd(*[jnp.asarray(x) for x in args], initial_state=jnp.asarray(s0),
                                output_dtype=jnp.float32)
        print("ACC mosaic-extra", json.dumps(dict(shape=[B, T, H, 64], f32_w=f32w,
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
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    print("DEVICE", jax.devices()[0].device_kind, "jax", jax.__version__,
          time.strftime("%Y-%m-%d"), flush=True)
    fns = implementations(args.peers.split(","))
    if "check" in args.modes:
        check(fns)
    if "time" in args.modes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
        timing(fns, shapes, args.reps)


if __name__ == "__main__":
    main()
