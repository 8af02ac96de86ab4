"""WKV7 kernel benchmark and GPU checks: correctness vs float64, accuracy, speed (vs FLA peer).

Subcommands (run on a GPU machine; each prints JSON lines, then a short table):

  check                     GPU correctness: fresh random inputs, GPU memory poisoned with NaN
                            first, outputs / final state / every gradient vs float64 recurrence
                            (segments, initial state, T % C != 0, f32 exact mode, bf16, f16).
  accuracy --save F.npz     bf16 inputs (B=1, H=4, D=64): forward rel. error (T=1024, 4096) and
                            every gradient's rel. error (T=1024) vs float64; saves the inputs.
  peer --inputs F --out G   FLA's chunk_rwkv7 outputs/gradients on the same saved inputs
                            (needs torch + fla-core; imported only here, never by the kernel).
  compare --acc F --peer G  gradient errors of ours and FLA side by side (same inputs).
  speed [--chunk C --tuning JSON --shapes S] [--recurrent]
                            fwd and fwd+bwd ms on the 4 anchor shapes (or --shapes "B,T,H,D;...",
                            bf16) and the pure-JAX `recurrent` at (8,4096,12,64).
  precision --names P ...   per kernel precision, float32 inputs: compile seconds and fwd+bwd ms at
                            (8, 4096, 12, 64), and forward / gradient rel. error vs float64 at
                            (1, 1024, 4, 64). Compile time is what a user of the `fp32` policy
                            waits for before the first step.
  breakdown --shape B T H D each launch timed alone, for the launch variants listed below.
  sweep --variants JSON     intra_bwd / intra_fwd / seq_fwd (alone, or with out_fwd: "seqo") /
                            seq_bwd for a list of `Tuning`s (one process, shared inputs).
  ptxas --triton-site DIR   (CPU, no GPU needed) compile every kernel for sm_90 with the triton
                            wheel and print registers / spills / shared memory / wgmma count /
                            SASS instructions, with XLA's TF32 operand rounding put in first as
                            the GPU's compiler does (--no-xla-rounding: without it).

Inputs follow the FLA benchmark's distribution (`lwm_jax.ops.wkv7.testing.random_wkv7_inputs`).
Timing: jitted call, warm-up, then batches of back-to-back calls ended by one
`block_until_ready`; the median batch time over the call count.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

# this checkout's lwm_jax when it is not installed; a PYTHONPATH tree (an A/B) still wins
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(8, 4096, 12, 64), (4, 4096, 32, 64), (1, 32768, 32, 64), (16, 2048, 32, 64)]
NAMES = ("r", "w", "k", "v", "a", "b")


def shape_list(text: str) -> list[tuple[int, int, int, int]]:
    """`--shapes`: "B,T,H,D;..." -> [(B, T, H, D), ...], four positive integers each."""
    shapes = []
    for one in text.split(";"):
        parts = one.split(",")
        if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(
                f"{one!r} is not B,T,H,D (four positive integers); write e.g. \"8,4096,12,64\"")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def emit(**kw):
    print(json.dumps(kw), flush=True)


def _jax():
    import jax
    import jax.numpy as jnp
    return jax, jnp


def poison_gpu_memory(gib=8.0):
    """Fill then free a large NaN buffer so that unwritten kernel outputs read as NaN."""
    jax, jnp = _jax()
    x = jnp.full((int(gib * 2**30 / 4),), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


def bench(fn, *args, min_batch_s=0.05, rounds=7):
    """Median seconds per call of a jitted `fn` (batches of async calls, one sync per batch)."""
    jax, _ = _jax()
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - t0, 1e-5)
    n = max(1, int(min_batch_s / once))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def _vjp_fn(op, with_state):
    """Jitted `(fwd, fwdbwd)` of `op`. `fwdbwd` returns the outputs beside the gradients, as a
    training step uses both: a timed function returning the gradients alone lets XLA drop any
    launch that only forms the outputs (our `out_fwd` beside the Mosaic chains), which a peer
    whose forward forms them together with its states cannot drop."""
    jax, jnp = _jax()

    def fwd(xs, s0):
        return op(*xs, s0 if with_state else None)

    def fwdbwd(xs, s0, do, dsT):
        (o, sT), vjp = jax.vjp(fwd, xs, s0)
        return o, vjp((do, dsT))
    return jax.jit(fwd), jax.jit(fwdbwd)


def cmd_check(args):
    jax, jnp = _jax()
    from lwm_jax.ops.wkv7.pallas import wkv7_pallas
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
    cases = [  # (B, T, H, K, V, dtype, segments, initial_state, chunk, out_dtype)
        (2, 300, 3, 64, 64, jnp.bfloat16, True, True, 32, jnp.float32),   # stacked bwd, docs
        (1, 256, 2, 64, 64, jnp.bfloat16, False, False, 32, None),        # stacked, bf16 out
        (2, 200, 2, 32, 64, jnp.float16, True, True, 32, jnp.float32),    # stacked, K = 32
        (2, 300, 3, 64, 64, jnp.float32, True, True, 32, jnp.float32),    # exact: rows at C=32
        (1, 1000, 2, 64, 128, jnp.float32, False, True, 64, jnp.float32), # C = 64, V = 128
        (2, 300, 3, 64, 64, jnp.bfloat16, True, True, 64, jnp.float32),   # C = 64 two launches
    ][: args.max_cases]
    failures = 0
    for i, (B, T, H, K, V, dt, use_seg, use_s0, C, odt) in enumerate(cases):
        key = jax.random.PRNGKey(100 + i)
        xs = random_wkv7_inputs(key, B, T, H, K, V, dt)
        ks = jax.random.split(key, 4)
        s0 = 0.5 * jax.random.normal(ks[0], (B, H, K, V)) if use_s0 else None
        seg = None
        if use_seg:
            seg = jnp.cumsum(jax.random.uniform(ks[1], (B, T)) < 0.01, axis=1).astype(jnp.int32)
        do = jax.random.normal(ks[2], (B, T, H, V), jnp.float32)
        dsT = jax.random.normal(ks[3], (B, H, K, V), jnp.float32)
        odt_eff = odt or dt

        def fwd(xs, s0):
            return wkv7_pallas(*xs, s0, seg, C, odt)
        poison_gpu_memory()
        (o, sT), vjp = jax.vjp(jax.jit(fwd), xs, s0)
        gxs, gs0 = vjp((do.astype(odt_eff), dsT))
        ref_o, ref_s, ref_g = wkv7_reference_vjp_f64(
            xs, s0, seg, np.asarray(do.astype(odt_eff), np.float64), dsT)
        errs = {"o": rel_err(o, ref_o), "sT": rel_err(sT, ref_s)}
        errs.update({f"d{n}": rel_err(g, ref_g[n]) for n, g in zip(NAMES, gxs)})
        if use_s0:
            errs["ds0"] = rel_err(gs0, ref_g["initial_state"])
        finite = all(bool(jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32))))
                     for x in (o, sT, *gxs))
        tol = 1e-5 if dt == jnp.float32 and odt_eff == jnp.float32 else 2e-2
        ok = finite and all(e <= tol for e in errs.values())
        failures += not ok
        emit(case="check", i=i, B=B, T=T, H=H, K=K, V=V, dtype=jnp.dtype(dt).name,
             segments=use_seg, initial_state=use_s0, C=C, finite=finite, tol=tol, ok=ok,
             **{k: float(f"{v:.3e}") for k, v in errs.items()})
    emit(case="check-summary", failures=failures)
    return failures


def cmd_accuracy(args):
    jax, jnp = _jax()
    from lwm_jax.ops.wkv7.pallas import wkv7_pallas
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
    from lwm_jax.ops.wkv7.reference import wkv7_reference_np
    save = {}
    for T in (1024, 4096):
        xs = random_wkv7_inputs(jax.random.PRNGKey(T), 1, T, 4, 64, 64, jnp.bfloat16)
        C = args.chunk
        o, _ = jax.jit(lambda xs: wkv7_pallas(*xs, None, None, C, None))(xs)
        if T == 1024:
            do = jax.random.normal(jax.random.PRNGKey(7), o.shape, jnp.float32).astype(jnp.bfloat16)
            dsT = jnp.zeros((1, 4, 64, 64), jnp.float32)
            _, vjp = jax.vjp(lambda xs: wkv7_pallas(*xs, None, None, C, None), xs)
            grads = vjp((do, dsT))[0]
            ref_o, _, ref_g = wkv7_reference_vjp_f64(xs, None, None, np.asarray(do, np.float64),
                                                     np.zeros((1, 4, 64, 64)))
            errs = {f"d{n}": rel_err(g, ref_g[n]) for n, g in zip(NAMES, grads)}
            save.update({f"x_{n}": np.asarray(x.astype(jnp.float32)) for n, x in zip(NAMES, xs)})
            save["do"] = np.asarray(do.astype(jnp.float32))
            save.update({f"ref_d{n}": ref_g[n] for n in NAMES})
            save.update({f"ours_d{n}": np.asarray(g.astype(jnp.float32))
                         for n, g in zip(NAMES, grads)})
        else:
            ref_o, _ = wkv7_reference_np(*xs)
            errs = {}
        emit(case="accuracy", impl="ours", B=1, T=T, H=4, D=64, C=C, rel_err_fwd=rel_err(o, ref_o),
             **errs)
    if args.save:
        np.savez(args.save, **save)


def cmd_peer(args):
    import torch
    from fla.ops.rwkv7 import chunk_rwkv7
    d = np.load(args.inputs)
    xs = [torch.tensor(d[f"x_{n}"], device="cuda").to(torch.bfloat16).requires_grad_(True)
          for n in NAMES]
    o = chunk_rwkv7(*xs, scale=1.0, safe_gate=True, lower_bound=-0.6065306597126334,
                    chunk_size=64)[0]
    o.backward(torch.tensor(d["do"], device="cuda").to(o.dtype))
    np.savez(args.out, **{f"fla_d{n}": x.grad.float().cpu().numpy() for n, x in zip(NAMES, xs)})


def cmd_compare(args):
    from lwm_jax.ops.wkv7.testing import rel_err
    d, p = np.load(args.acc), np.load(args.peer)
    for n in NAMES:
        ours = rel_err(d[f"ours_d{n}"], d[f"ref_d{n}"])
        fla = rel_err(p[f"fla_d{n}"], d[f"ref_d{n}"])
        emit(case="grad-accuracy", arg=n, T=1024, ours=ours, fla=fla, ok=ours <= fla)


def cmd_speed(args):
    jax, jnp = _jax()
    from lwm_jax.ops.wkv7.pallas import Tuning, wkv7_pallas
    from lwm_jax.ops.wkv7.pallas_gpu.launches import resolve
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs

    def run(B, T, H, D, chunk=64, tuning=None, label="ours", impl=None):
        xs = random_wkv7_inputs(jax.random.PRNGKey(B * T + H), B, T, H, D, D, jnp.bfloat16)
        op = impl or (lambda *x: wkv7_pallas(*x, None, chunk, None, tuning=tuning))
        fwd, fwdbwd = _vjp_fn(op, with_state=False)
        do = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, D), jnp.bfloat16)
        dsT = jnp.zeros((B, H, D, D), jnp.float32)
        t_f = bench(fwd, xs, None)
        t_fb = bench(fwdbwd, xs, None, do, dsT)
        mem = fwdbwd.lower(xs, None, do, dsT).compile().memory_analysis()
        peak = None
        if mem is not None:
            peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                    + mem.temp_size_in_bytes) / 2**30
        emit(case="speed", impl=label, B=B, T=T, H=H, D=D, C=chunk,
             tuning=None if impl else resolve(tuning, chunk, B * H, D)._asdict(), fwd_ms=t_f * 1e3,
             fwdbwd_ms=t_fb * 1e3, fwdbwd_mem_gib=peak)
        return t_f, t_fb

    if not args.no_shapes:
        tune = Tuning(**json.loads(args.tuning)) if args.tuning else None
        shapes = SHAPES if args.shapes is None else args.shapes
        for i, (B, T, H, D) in enumerate(shapes):
            if args.shape_index is None or i in args.shape_index:
                run(B, T, H, D, args.chunk, tune)
    if args.recurrent:
        from lwm_jax.ops.wkv7.recurrent import wkv7_recurrent
        rec = lambda r, w, k, v, a, b, s0: wkv7_recurrent(r, w, k, v, a, b, s0, None,
                                                           output_dtype=jnp.bfloat16)
        run(*SHAPES[0], label="recurrent", impl=rec)


def cmd_precision(args):
    jax, jnp = _jax()
    from lwm_jax.ops.wkv7.pallas import wkv7_pallas
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
    small = random_wkv7_inputs(jax.random.PRNGKey(11), 1, 1024, 4, 64, 64, jnp.float32)
    do_small = jax.random.normal(jax.random.PRNGKey(12), (1, 1024, 4, 64), jnp.float32)
    zeros = np.zeros((1, 4, 64, 64))
    ref_o, _, ref_g = wkv7_reference_vjp_f64(small, None, None, np.asarray(do_small, np.float64),
                                             zeros)
    B, T, H, D = SHAPES[0]
    big = random_wkv7_inputs(jax.random.PRNGKey(13), B, T, H, D, D, jnp.float32)
    do_big = jax.random.normal(jax.random.PRNGKey(14), (B, T, H, D), jnp.float32)
    for name in args.names:
        op = lambda *x: wkv7_pallas(*x, None, args.chunk, None, precision=name)
        fwd, fwdbwd = _vjp_fn(op, with_state=False)
        t0 = time.perf_counter()
        compiled = fwdbwd.lower(big, None, do_big, jnp.zeros((B, H, D, D))).compile()
        compile_s = time.perf_counter() - t0
        ms = bench(compiled, big, None, do_big, jnp.zeros((B, H, D, D))) * 1e3
        (o, _), vjp = jax.vjp(jax.jit(lambda xs: op(*xs, None)), small)
        grads = vjp((do_small, jnp.zeros((1, 4, 64, 64))))[0]
        errs = {f"d{n}": float(f"{rel_err(g, ref_g[n]):.3e}") for n, g in zip(NAMES, grads)}
        emit(case="precision", precision=name, C=args.chunk, compile_s=round(compile_s, 1),
             fwdbwd_ms=round(ms, 3), shape=[B, T, H, D],
             rel_err_o=float(f"{rel_err(o, ref_o):.3e}"),
             **errs)


BREAKDOWN_VARIANTS = [  # (chunk, Tuning kwargs); None fields are filled by `resolve`
    (32, {}), (32, dict(bwd_form="rows")), (64, {}), (32, dict(split_bwd=True)), (64, dict(split_bwd=False)),
    (32, dict(split_out=True)), (32, dict(block_v_bwd=64)),
]


def cmd_breakdown(args):
    """Time each launch alone (shape args.shape) for several launch variants."""
    jax, jnp = _jax()
    from lwm_jax.ops.wkv7.pallas import Tuning
    from lwm_jax.ops.wkv7.pallas_gpu import launches as gk
    from lwm_jax.ops.wkv7.pallas_gpu.launches import resolve
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs
    B, T, H, D = args.shape
    xs = random_wkv7_inputs(jax.random.PRNGKey(3), B, T, H, D, D, jnp.bfloat16)
    do = jax.random.normal(jax.random.PRNGKey(4), (B, T, H, D), jnp.bfloat16)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)
    prec = jax.lax.Precision.DEFAULT
    for C, tkw in BREAKDOWN_VARIANTS[: args.max_variants]:
        tune = resolve(Tuning(**tkw), C, B * H, D)
        kw = dict(H=H, C=C, prec=prec, tune=tune, interpret=False)
        try:
            f1 = jax.jit(lambda xs: gk.intra_fwd(*xs, None, want_inv=True, **kw))
            M, Dm, Q, O0, inv = f1(xs)
            f2 = jax.jit(lambda M, Dm, Q, O0, s0: gk.seq_fwd(
                M, Dm, Q, O0, s0, out_dtype=jnp.bfloat16, want_states=True, **kw))
            o, sT, states = f2(M, Dm, Q, O0, s0)
            f2b = jax.jit(lambda Q, O0, st: gk.out_fwd(Q, O0, st, out_dtype=jnp.bfloat16, **kw))
            f3 = jax.jit(lambda M, Q, do, s: gk.seq_bwd(M, Q, do, s, **kw))
            dS, ds0 = f3(M, Q, do, s0)
            f4 = jax.jit(lambda xs, inv, st, dS, do: gk.intra_bwd(*xs, None, inv, st, dS, do,
                                                                   **kw))
            ms = {"intra_fwd": bench(f1, xs), "seq_fwd": bench(f2, M, Dm, Q, O0, s0),
                  "seq_bwd": bench(f3, M, Q, do, s0),
                  "intra_bwd": bench(f4, xs, inv, states, dS, do)}
            if tune.split_out:
                ms["out_fwd"] = bench(f2b, Q, O0, states)
            emit(case="breakdown", B=B, T=T, H=H, D=D, C=C, tuning=tkw,
                 **{k + "_ms": round(v * 1e3, 4) for k, v in ms.items()},
                 sum_ms=round(sum(ms.values()) * 1e3, 4))
        except Exception as e:  # keep going: one bad variant must not hide the others
            emit(case="breakdown-error", C=C, tuning=tkw, error=repr(e)[:300])


def cmd_ptxas(args):
    """The offline compile route (CPU only): `wkv7_ptxas.py` beside this script."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from wkv7_ptxas import run
    run(args, emit)


def cmd_sweep(args):
    """Time single launches for several `Tuning`s: intra_bwd / intra_fwd (shape --shape) and
    seq_fwd / seq_bwd (shape --seq-shape). Variants: JSON list of [kind, chunk, tuning-dict],
    kind in bwd / fwd / seq / seqo (seq_fwd plus out_fwd when the tuning splits the outputs off)
    / seqb."""
    jax, jnp = _jax()
    from lwm_jax.ops.wkv7.pallas import Tuning
    from lwm_jax.ops.wkv7.pallas_gpu import launches as gk
    from lwm_jax.ops.wkv7.pallas_gpu.launches import resolve
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs
    prec = jax.lax.Precision.DEFAULT
    cache = {}

    def prepared(shape, C):
        if (shape, C) not in cache:
            B, T, H, D = shape
            xs = random_wkv7_inputs(jax.random.PRNGKey(3), B, T, H, D, D, jnp.bfloat16)
            do = jax.random.normal(jax.random.PRNGKey(4), (B, T, H, D), jnp.bfloat16)
            s0 = jnp.zeros((B, H, D, D), jnp.float32)
            kw = dict(H=H, C=C, prec=prec, tune=resolve(Tuning(split_out=False), C, B * H, D),
                      interpret=False)
            M, Dm, Q, O0, inv = jax.jit(lambda xs: gk.intra_fwd(*xs, None, want_inv=True, **kw))(xs)
            _, _, states = jax.jit(lambda *a: gk.seq_fwd(*a, out_dtype=jnp.bfloat16,
                                                         want_states=True, **kw))(M, Dm, Q, O0, s0)
            dS, _ = jax.jit(lambda M, Q, do, s: gk.seq_bwd(M, Q, do, s, **kw))(M, Q, do, s0)
            cache[(shape, C)] = dict(xs=xs, do=do, s0=s0, M=M, Dm=Dm, Q=Q, O0=O0, inv=inv,
                                     states=states, dS=dS)
        return cache[(shape, C)]

    for kind, C, tkw in json.loads(args.variants):
        shape = tuple(args.shape if kind in ("bwd", "fwd") else args.seq_shape)
        B, T, H, D = shape
        try:
            p = prepared(shape, C)
            tune = resolve(Tuning(**tkw), C, B * H, D)
            kw = dict(H=H, C=C, prec=prec, tune=tune, interpret=False)
            if kind == "bwd":
                f = jax.jit(lambda xs, inv, st, dS, do: gk.intra_bwd(*xs, None, inv, st, dS, do,
                                                                     **kw))
                ms = bench(f, p["xs"], p["inv"], p["states"], p["dS"], p["do"]) * 1e3
            elif kind == "fwd":  # the chunk-parallel forward launch, as the training step runs it
                f = jax.jit(lambda xs: gk.intra_fwd(*xs, None, want_inv=True, **kw))
                ms = bench(f, p["xs"]) * 1e3
            elif kind == "seq":
                f = jax.jit(lambda *a: gk.seq_fwd(*a, out_dtype=jnp.bfloat16, want_states=True,
                                                  **kw))
                ms = bench(f, p["M"], p["Dm"], p["Q"], p["O0"], p["s0"]) * 1e3
            elif kind == "seqo":  # the forward's sequential part as the step runs it: seq_fwd,
                # then out_fwd when the tuning writes states only (`split_out`)
                def fwd_out(M, Dm, Q, O0, s0):
                    return gk.seq_forward(M, Dm, Q, O0, s0, out_dtype=jnp.bfloat16,
                                              want_states=True, **kw)[:2]
                ms = bench(jax.jit(fwd_out), p["M"], p["Dm"], p["Q"], p["O0"], p["s0"]) * 1e3
            else:  # "seqb": the reverse sequential launch
                f = jax.jit(lambda M, Q, do, s: gk.seq_bwd(M, Q, do, s, **kw))
                ms = bench(f, p["M"], p["Q"], p["do"], p["s0"]) * 1e3
            emit(case="sweep", kind=kind, B=B, T=T, H=H, D=D, C=C, tuning=tkw, ms=round(ms, 4))
        except Exception as e:  # keep going: one bad variant must not hide the others
            emit(case="sweep-error", kind=kind, C=C, tuning=tkw, error=repr(e)[:400])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("check")
    a.add_argument("--max-cases", type=int, default=99)
    a = sub.add_parser("accuracy")
    a.add_argument("--save", default=None)
    a.add_argument("--chunk", type=int, default=64)
    a = sub.add_parser("peer")
    a.add_argument("--inputs", required=True)
    a.add_argument("--out", required=True)
    a = sub.add_parser("compare")
    a.add_argument("--acc", required=True)
    a.add_argument("--peer", required=True)
    a = sub.add_parser("speed")
    a.add_argument("--recurrent", action="store_true")
    a.add_argument("--no-shapes", action="store_true")
    a.add_argument("--chunk", type=int, default=64)
    a.add_argument("--tuning", default=None, help="JSON dict of Tuning fields")
    a.add_argument("--shape-index", type=int, nargs="*", default=None,
                   help="run only these entries of SHAPES (default: all)")
    a.add_argument("--shapes", default=None, type=shape_list,
                   help='"B,T,H,D;..." to run instead of SHAPES (e.g. a model\'s own shape)')
    a = sub.add_parser("precision")
    a.add_argument("--names", nargs="+", default=["default", "tf32x3", "highest"])
    a.add_argument("--chunk", type=int, default=32)
    a = sub.add_parser("breakdown")
    a.add_argument("--shape", type=int, nargs=4, default=list(SHAPES[1]))
    a.add_argument("--max-variants", type=int, default=99)
    a = sub.add_parser("sweep")
    a.add_argument("--shape", type=int, nargs=4, default=list(SHAPES[1]))
    a.add_argument("--seq-shape", type=int, nargs=4, default=list(SHAPES[3]))
    a.add_argument("--variants", required=True, help='JSON [[kind, chunk, tuning], ...]')
    a = sub.add_parser("ptxas")
    a.add_argument("--shape", type=int, nargs=4, default=[1, 128, 2, 64])
    a.add_argument("--chunk", type=int, default=32)
    a.add_argument("--tuning", default=None, help="JSON dict of Tuning fields")
    a.add_argument("--triton-site", required=True, help="folder holding the triton wheel")
    a.add_argument("--out", default="/tmp/wkv7_ptxas")
    a.add_argument("--no-xla-rounding", action="store_true",
                   help="compile the IR as lowered, without XLA's TF32 operand rounding")
    args = p.parse_args(argv)
    if args.cmd not in ("peer", "compare"):
        jax, _ = _jax()
        import jaxlib
        emit(case="env", jax=jax.__version__, jaxlib=jaxlib.__version__,
             device=str(jax.devices()[0].device_kind), backend=jax.default_backend())
    result = {"check": cmd_check, "accuracy": cmd_accuracy, "peer": cmd_peer,
              "compare": cmd_compare, "speed": cmd_speed, "precision": cmd_precision,
              "breakdown": cmd_breakdown, "sweep": cmd_sweep, "ptxas": cmd_ptxas}[args.cmd](args)
    return 1 if result else 0


if __name__ == "__main__":
    sys.exit(main())
