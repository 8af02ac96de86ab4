"""Device benchmark: one block GEMM (forward, or forward + both gradient products) as the
`bf16-mixed` policy runs it against the FP8 forms of `lwm_jax.precision.fp8.fp8_einsum`, at
the 0.1B and 1.5B models' GEMM shapes, and what the compiler made of each.

    python benchmarks/fp8_gemm.py [--shapes 0.1b-att,1.5b-ffn-key] [--variants bf16,flax,xla]
                                  [--reps 20] [--out rows.jsonl] [--hlo-dir DIR]
    python benchmarks/fp8_gemm.py --step [bf16-mixed fp8-mixed]   # a 2-layer train step's HLO

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
    args = ap.parse_args()
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
