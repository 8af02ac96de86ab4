"""Device benchmark: one block GEMM (forward, or forward + both gradient products) as the
`bf16-mixed` policy runs it against the FP8 forms of `lwm_jax.precision.fp8.fp8_einsum`, at
the 0.1B and 1.5B models' GEMM shapes, and what the compiler made of each.

    python benchmarks/fp8_gemm.py [--shapes 0.1b-att,1.5b-ffn-key] [--variants bf16,flax,xla]
                                  [--reps 20] [--out rows.jsonl] [--hlo-dir DIR]
    python benchmarks/fp8_gemm.py --step [bf16-mixed fp8-mixed]   # a 2-layer train step's HLO
    python benchmarks/fp8_gemm.py --ceiling [--models 0.1b,1.5b] [--step-ms 0.1b=134.7,...]

Variants: `bf16` (`Policy("bf16-mixed").einsum`: bf16 operands, float32 accumulation, bf16
cotangent in the backward), `flax` (`fp8_einsum(impl="flax")`: Flax's fp8_ops), `xla`
(`impl="xla"`: our own VJP around XLA dots of float8 operands, gradient products at
precision HIGHEST), `xla-fast` (the same with the gradient products at DEFAULT, which lets
cuBLASLt use its fast FP8 accumulation) and `xla-dq` (`impl="xla-dq"`: the dots take
dequantized float32 conversions of the float8 operands). Each timing is the median of `--reps` jitted calls
after 3 warm-ups (block_until_ready on every output); inputs are fresh normal bf16
activations and a float32 weight at the model's init scale. Per variant the compiled HLO's
custom-call targets are counted (`__cublas$lt$matmul$f8` is a cuBLASLt FP8 GEMM,
`__gpu$xla.gpu.triton` a Triton fusion) with `aot.plan.matmul_operand_types` (dots the
compiler kept as dots, by operand types, e.g. inside Triton fusions). One JSON line per
(shape, variant).

`--ceiling`: what FP8 could give a train step at most. Each of a block GEMM's three products
(forward `x w`, input gradient `g w^T`, weight gradient `x^T g`) is timed alone on operands
already in the GEMM's input type and layout, with no amax, scaling or quantization pass and
no transposed copy: bfloat16 against e4m3 (e5m2 for the output gradient), float32
accumulation (the faster of two FP8 forms that compiled to an FP8 GEMM: a dot of float8
operands, a dot of their bf16 conversions), bfloat16 results (the weight gradient float32).
Times are the mean of a batch of back-to-back calls with one synchronisation (median of 7
batches). Summed over the model's FP8 GEMM sites (`CEILING_SITES`: TimeMix r, k, v, o and
ChannelMix key, value, per layer; the LM head and the low-rank projections stay bf16), the
bf16 - FP8 difference is the most an FP8 policy can take off the step; with `--step-ms` (the
bf16-mixed step in ms) the row also gives the step speed-up that bound allows. Each product
compiles three times (GEMM autotuning): one model's three shapes take ~5 minutes on an H200.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {   # name: (tokens, in, out): the 0.1B run is 8 x 4096 tokens, the 1.5B 2 x 4096
    "0.1b-att": (8 * 4096, 768, 768),
    "0.1b-ffn-key": (8 * 4096, 768, 3072),
    "0.1b-ffn-value": (8 * 4096, 3072, 768),
    "1.5b-att": (2 * 4096, 2048, 2048),
    "1.5b-ffn-key": (2 * 4096, 2048, 8192),
    "1.5b-ffn-value": (2 * 4096, 8192, 2048),
}
VARIANTS = ("bf16", "flax", "xla", "xla-fast", "xla-dq")


def _fn(variant):
    import jax.numpy as jnp

    from lwm_jax.precision import fp8, parse_policy
    spec = "btc,cd->btd"
    if variant == "bf16":
        pol = parse_policy("bf16-mixed")
        return lambda x, w, m: pol.einsum(spec, x, w)
    impl, fast = {"flax": ("flax", False), "xla": ("xla", False),
                  "xla-fast": ("xla", True), "xla-dq": ("xla-dq", False)}[variant]
    return lambda x, w, m: fp8.fp8_einsum(spec, x, w, m, compute_dtype=jnp.bfloat16,
                                          impl=impl, fast_grad_accum=fast)


def _time(f, args, reps):
    import jax
    for _ in range(3):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def run_case(name, variant, reps, hlo_dir=None):
    import jax
    import jax.numpy as jnp

    from lwm_jax.precision import fp8
    tokens, c_in, c_out = SHAPES[name]
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (tokens // 4096, 4096, c_in), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (c_in, c_out), jnp.float32) * c_in ** -0.5
    g = jax.random.normal(kg, (tokens // 4096, 4096, c_out), jnp.float32).astype(jnp.bfloat16)
    meta = fp8.init_meta()
    f = _fn(variant)
    def fwd_bwd(x, w, m, g):
        y, vjp = jax.vjp(f, x, w, m)
        return y, vjp(g.astype(y.dtype))

    # compiled once each (the timed executables are the ones whose HLO is read)
    fwd = jax.jit(f).lower(x, w, meta).compile()
    fwd_bwd = jax.jit(fwd_bwd).lower(x, w, meta, g).compile()
    # two steps so the scales are the delayed ones of a running job, not the initial 1s
    if variant != "bf16":
        for _ in range(2):
            meta = fwd_bwd(x, w, meta, g)[1][2]
    row = {"case": "fp8-gemm", "shape": name, "tokens": tokens, "in": c_in, "out": c_out,
           "variant": variant, "fwd_ms": _time(fwd, (x, w, meta), reps),
           "fwd_bwd_ms": _time(fwd_bwd, (x, w, meta, g), reps)}
    flops = 2.0 * tokens * c_in * c_out
    row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3 * flops / row["fwd_bwd_ms"] / 1e9
    text = fwd_bwd.as_text()
    row.update(_summary(text))
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{name}_{variant}.txt"), "w") as fh:
            fh.write(text)
    return row


def _summary(text):
    from lwm_jax.aot.plan import matmul_operand_types
    calls: dict[str, int] = {}
    for m in re.finditer(r'custom_call_target="([^"]+)"', text):
        calls[m.group(1)] = calls.get(m.group(1), 0) + 1
    return {"custom_calls": calls, "dots": matmul_operand_types(text)}


CEILING_SITES = {   # model: (layers, [(tokens, in, out) per FP8 GEMM site of one layer])
    "0.1b": (12, [(8 * 4096, 768, 768)] * 4 + [(8 * 4096, 768, 3072), (8 * 4096, 3072, 768)]),
    "1.5b": (24, [(2 * 4096, 2048, 2048)] * 4
             + [(2 * 4096, 2048, 8192), (2 * 4096, 8192, 2048)]),
}


def _time_batch(f, args, calls=20, batches=7):
    """ms per call: median over `batches` of (`calls` back-to-back calls, one sync) / calls."""
    import jax
    for _ in range(3):
        jax.block_until_ready(f(*args))
    per = []
    for _ in range(batches):
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        per.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(per)


def ceiling_products(tokens, c_in, c_out):
    """ms of the three products of one GEMM site, bf16 and FP8 (`--ceiling` in the module
    docstring), and the custom calls each FP8 product compiled to."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    e4, e5, bf = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
    kx, kw, kg = jax.random.split(jax.random.key(tokens + c_in + c_out), 3)
    x = jax.random.normal(kx, (tokens, c_in), jnp.float32)
    w = jax.random.normal(kw, (c_in, c_out), jnp.float32) * c_in ** -0.5
    g = jax.random.normal(kg, (tokens, c_out), jnp.float32)

    def dot(a, b, contract, out):   # a [.., K] x b [.., K] or as `contract` says
        return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=out)

    # cuBLASLt's FP8 GEMM takes both operands K-major: each product gets that layout given
    products = {
        "fwd": (lambda a, b: dot(a, b, ((1,), (1,)), bf), (x, w.T)),        # x [M,K] . w^T [N,K]
        "dgrad": (lambda a, b: dot(a, b, ((1,), (1,)), bf), (g, w)),        # g [M,N] . w [K,N]
        "wgrad": (lambda a, b: dot(a, b, ((1,), (1,)), jnp.float32), (x.T, g.T)),  # [K,M].[N,M]
    }
    row = {"tokens": tokens, "in": c_in, "out": c_out}
    for name, (f, (a, b)) in products.items():
        f = jax.jit(f)
        lhs_fp8 = e5 if name == "dgrad" else e4
        rhs_fp8 = e5 if name == "wgrad" else e4
        a16, b16 = a.astype(bf), b.astype(bf)
        a8, b8 = a.astype(lhs_fp8), b.astype(rhs_fp8)
        row[f"{name}_bf16_ms"] = _time_batch(f, (a16, b16))
        row[f"{name}_fp8_ms"] = _time_batch(f, (a8, b8))
        row[f"{name}_fp8_calls"] = _summary(f.lower(a8, b8).compile().as_text())["custom_calls"]
        # the same product written as a dot of converted float8 operands, the pattern XLA's
        # GEMM rewriter also turns into an FP8 GEMM: the faster of the two forms is the bound
        fdq = jax.jit(lambda a, b, f=f: f(a.astype(bf), b.astype(bf)))
        row[f"{name}_fp8dq_ms"] = _time_batch(fdq, (a8, b8))
        row[f"{name}_fp8dq_calls"] = _summary(fdq.lower(a8, b8).compile().as_text())["custom_calls"]
        print(f"# {tokens}x{c_in}x{c_out} {name}: bf16 {row[f'{name}_bf16_ms']:.4f} ms, fp8 "
              f"{row[f'{name}_fp8_ms']:.4f} {row[f'{name}_fp8_calls']}, fp8dq "
              f"{row[f'{name}_fp8dq_ms']:.4f} {row[f'{name}_fp8dq_calls']}",
              file=sys.stderr, flush=True)
    return row


def _fp8_ms(r, p):
    """The faster FP8 form of product `p` that compiled to an FP8 GEMM (inf if none did)."""
    forms = [r[f"{p}_{k}_ms"] for k in ("fp8", "fp8dq")
             if any("f8" in c for c in r[f"{p}_{k}_calls"])]
    return min(forms, default=float("inf"))


def ceiling(models, step_ms):
    """One row per GEMM shape, then one per model: the FP8 GEMM sites' bf16 and FP8 time per
    step and, given the bf16-mixed step time, the step speed-up that FP8 GEMMs allow at most."""
    rows, cache = [], {}
    for model in models:
        layers, sites = CEILING_SITES[model]
        t16 = t8 = 0.0
        for shape in sites:
            if shape not in cache:
                cache[shape] = ceiling_products(*shape)
                rows.append({"case": "fp8-ceiling-gemm", **cache[shape]})
            r = cache[shape]
            t16 += layers * sum(r[f"{p}_bf16_ms"] for p in ("fwd", "dgrad", "wgrad"))
            t8 += layers * sum(_fp8_ms(r, p) for p in ("fwd", "dgrad", "wgrad"))
        row = {"case": "fp8-ceiling-step", "model": model, "layers": layers,
               "sites_bf16_ms": round(t16, 2)}
        if t8 == float("inf"):
            rows.append({**row, "error": "a product compiled to no FP8 GEMM (see its calls)"})
            continue
        row.update(sites_fp8_ms=round(t8, 2), saving_ms=round(t16 - t8, 2))
        if model in step_ms:
            row["bf16_step_ms"] = step_ms[model]
            row["fp8_step_ms_at_best"] = round(step_ms[model] - (t16 - t8), 2)
            row["speedup_at_best"] = round(step_ms[model] / (step_ms[model] - (t16 - t8)), 3)
        rows.append(row)
    return rows


def step_case(precision, hlo_dir=None):
    """The compiled train step of a 2-layer, 256-channel model (no layer scan, so each
    layer's GEMMs appear once): 2 x 6 FP8 GEMM sites x 3 products under `fp8-mixed`."""
    import jax.numpy as jnp

    from lwm_jax.train.config import load_config
    from lwm_jax.train.trainer import build_program
    cfg = load_config(None, [f"precision={precision}", "model.n_layer=2", "model.n_embd=256",
                             "runtime.scan_layers=false", "train.batch_size=4",
                             "train.ctx_len=256"])
    prog = build_program(cfg)
    text = prog.train_step.lower(prog.abstract_state, jnp.zeros((4, 257), jnp.int32)) \
        .compile().as_text()
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"step_{precision}.txt"), "w") as fh:
            fh.write(text)
    return {"case": "fp8-step-hlo", "precision": precision, **_summary(text)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--hlo-dir", default=None, help="also write each fwd+bwd's compiled HLO here")
    ap.add_argument("--step", nargs="*", default=None, metavar="PRECISION",
                    help="instead: the compiled train step of a 2-layer model per precision")
    ap.add_argument("--ceiling", action="store_true",
                    help="instead: the FP8 products alone, no scaling work (module docstring)")
    ap.add_argument("--models", default="0.1b,1.5b", help="--ceiling: models to sum over")
    ap.add_argument("--step-ms", default="",
                    help="--ceiling: bf16-mixed step ms per model, e.g. 0.1b=134.7,1.5b=223.7")
    args = ap.parse_args()
    if args.ceiling:
        models = [m for m in args.models.split(",") if m]
        for m in models:
            if m not in CEILING_SITES:
                raise SystemExit(f"fp8_gemm: --models: unknown {m!r}; known: "
                                 f"{', '.join(CEILING_SITES)}")
        try:
            step_ms = {k: float(v) for k, v in (p.split("=") for p in args.step_ms.split(",") if p)}
        except ValueError:
            raise SystemExit(f"fp8_gemm: --step-ms must be MODEL=MS[,MODEL=MS], got "
                             f"{args.step_ms!r}") from None
        for row in ceiling(models, step_ms):
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
        return 0
    if args.step is not None:
        for precision in args.step or ["bf16-mixed", "fp8-mixed"]:
            print(json.dumps(step_case(precision, args.hlo_dir)), flush=True)
        return 0
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"fp8_gemm: --shapes: unknown {name!r}; known: {', '.join(SHAPES)}")
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"fp8_gemm: --variants: unknown {v!r}; known: {', '.join(VARIANTS)}")
    for name in args.shapes.split(","):
        for variant in args.variants.split(","):
            row = run_case(name, variant, args.reps, args.hlo_dir)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
