"""Peer for `benchmarks/wkv7.py speed` / `accuracy`: jla's RWKV-7 op, timed exactly as ours is.

jla = jax-linear-attention 0.1.0 (JAX, Pallas Mosaic GPU, sm_90 only), at its best settings,
stated: `linear_attention("rwkv7", r, k, v, w=w, a=a, b=b, scale=1.0, impl="mosaic_gpu",
chunk_size=32, lower_bound=-0.61)[0]`, which is what its own RWKV-7 layer passes (bounded mode:
one dense score product per chunk, BF16x3 products, its Mosaic GPU forward and backward kernels;
no final state asked for). `--exact` drops `lower_bound` (its exact sub-chunk mode, any w <= 0).
`--wab-f32` passes w, a, b in float32 as its layer does (same values: the bf16 draws upcast).

Inputs, timer and rows are ours (`benchmarks/wkv7.py`, imported, not copied): bf16 [B, T, H, K]
from `lwm_jax.ops.wkv7.testing.random_wkv7_inputs(PRNGKey(B*T+H), ...)` (w is the log-decay,
the same parameterisation as ours and FLA's), the four anchor shapes, fwd+bwd = the gradients
of all six inputs for the fixed cotangent `normal(PRNGKey(1))` in bf16; `bench`: jit, one
warm-up, one call to size a batch of >= 50 ms, median over 7 batches, one `block_until_ready`
per batch. Accuracy as `benchmarks/wkv7.py accuracy`: the same inputs (PRNGKey(T), B=1, H=4,
D=64), the same cotangent (PRNGKey(7)), forward rel. error at T=1024 and 4096 and every input's
gradient rel. error at T=1024 against the float64 recurrence. Rows carry `impl="jla"`.

    python3 -m pip install --no-index --no-deps --target /tmp/site \
        .peer/jax_linear_attention-0.1.0-py3-none-any.whl
    PYTHONPATH=/tmp/site python3 benchmarks/peers/jla_wkv7.py [--exact] [--wab-f32]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)          # this checkout's lwm_jax: the inputs and the float64 reference


def _ours():
    """`benchmarks/wkv7.py` as a module (its `bench`, `emit`, `SHAPES`, `NAMES`)."""
    spec = importlib.util.spec_from_file_location("lwm_bench_wkv7",
                                                  os.path.join(ROOT, "benchmarks", "wkv7.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


OURS = _ours()
JLA_LOWER_BOUND = -0.61   # jla.layers.rwkv7.RWKV7_LOWER_BOUND
JLA_CHUNK = 32            # jla.ops.mosaic_gpu.rwkv7.CHUNK: the only chunk its kernels take


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exact", action="store_true",
                   help="lower_bound=None: jla's exact mode (default: -0.61, its layer's setting)")
    p.add_argument("--wab-f32", action="store_true",
                   help="pass w, a, b as float32, as jla's RWKV-7 layer does (r, k, v stay bf16)")
    p.add_argument("--shape-index", type=int, nargs="*", default=None,
                   help="run only these entries of SHAPES (default: all)")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--impl", default="mosaic_gpu", choices=["mosaic_gpu", "chunked"],
                   help="jla's implementation (the peer is mosaic_gpu; chunked: a CPU check)")
    return p.parse_args(argv)


def settings(args) -> dict:
    return {"impl": args.impl, "chunk_size": JLA_CHUNK, "scale": 1.0,
            "lower_bound": None if args.exact else JLA_LOWER_BOUND,
            "wab_dtype": "float32" if args.wab_f32 else "bfloat16"}


def make_op(args):
    """jla's op as `(r, w, k, v, a, b) -> o`, in our argument order."""
    import jax.numpy as jnp
    from jla.ops import linear_attention
    opts = {} if args.exact else {"lower_bound": JLA_LOWER_BOUND}
    cast = (lambda x: x.astype(jnp.float32)) if args.wab_f32 else (lambda x: x)

    def op(r, w, k, v, a, b):
        return linear_attention("rwkv7", r, k, v, w=cast(w), a=cast(a), b=cast(b), scale=1.0,
                                impl=args.impl, chunk_size=JLA_CHUNK, **opts)[0]
    return op


def run_accuracy(op, args):
    import jax
    import jax.numpy as jnp
    from lwm_jax.ops.wkv7.reference import wkv7_reference_np
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs, rel_err, wkv7_reference_vjp_f64
    for T in (1024, 4096):
        xs = random_wkv7_inputs(jax.random.PRNGKey(T), 1, T, 4, 64, 64, jnp.bfloat16)
        f = jax.jit(lambda xs: op(*xs))
        if T == 1024:
            do = jax.random.normal(jax.random.PRNGKey(7), (1, T, 4, 64),
                                   jnp.float32).astype(jnp.bfloat16)
            o, vjp = jax.vjp(f, xs)
            grads = vjp(do.astype(o.dtype))[0]
            ref_o, _, ref_g = wkv7_reference_vjp_f64(xs, None, None, np.asarray(do, np.float64),
                                                     np.zeros((1, 4, 64, 64)))
            errs = {f"d{n}": rel_err(g, ref_g[n]) for n, g in zip(OURS.NAMES, grads)}
        else:
            o = f(xs)
            ref_o, _ = wkv7_reference_np(*xs)
            errs = {}
        OURS.emit(case="accuracy", impl="jla", B=1, T=T, H=4, D=64, C=JLA_CHUNK,
                  rel_err_fwd=rel_err(o, ref_o), settings=settings(args), **errs)


def run_speed(op, args):
    import jax
    import jax.numpy as jnp
    from lwm_jax.ops.wkv7.testing import random_wkv7_inputs
    fwd = jax.jit(lambda xs: op(*xs))

    @jax.jit
    def fwdbwd(xs, do):   # the outputs too, as `benchmarks/wkv7.py`'s `_vjp_fn` returns them
        o, vjp = jax.vjp(lambda xs: op(*xs), xs)
        return o, vjp(do.astype(o.dtype))[0]

    for i, (B, T, H, D) in enumerate(OURS.SHAPES):
        if args.shape_index is not None and i not in args.shape_index:
            continue
        try:
            xs = random_wkv7_inputs(jax.random.PRNGKey(B * T + H), B, T, H, D, D, jnp.bfloat16)
            do = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, D), jnp.bfloat16)
            t_f = OURS.bench(fwd, xs)
            t_fb = OURS.bench(fwdbwd, xs, do)
            mem = fwdbwd.lower(xs, do).compile().memory_analysis()
            peak = None
            if mem is not None:
                peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                        + mem.temp_size_in_bytes) / 2**30
            OURS.emit(case="speed", impl="jla", B=B, T=T, H=H, D=D, C=JLA_CHUNK,
                      settings=settings(args), fwd_ms=t_f * 1e3, fwdbwd_ms=t_fb * 1e3,
                      fwdbwd_mem_gib=peak)
        except Exception as e:  # one shape's failure (memory, say) must not hide the others
            OURS.emit(case="speed-error", impl="jla", B=B, T=T, H=H, D=D,
                      error=f"{type(e).__name__}: {e}"[:400])
        finally:
            xs = do = None


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jaxlib
    from importlib.metadata import PackageNotFoundError, version
    op = make_op(args)            # imports jla: a missing wheel fails here, saying so
    try:
        jla_version = version("jax-linear-attention")
    except PackageNotFoundError:  # jla importable from a source tree
        jla_version = None
    OURS.emit(case="env", impl="jla", jla=jla_version, jax=jax.__version__,
              jaxlib=jaxlib.__version__, device=str(jax.devices()[0].device_kind),
              backend=jax.default_backend(), settings=settings(args))
    if not args.skip_speed:
        run_speed(op, args)
    if not args.skip_accuracy:
        run_accuracy(op, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
