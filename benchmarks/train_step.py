"""Training throughput: the full train step exactly as `lwm-jax train` builds it.

Each case builds `lwm_jax.train.trainer.build_program` from a config file (with dotted
overrides, as on the `lwm-jax train` command line), initialises the state on the device, and
times `--steps` steps on random tokens after `--warmup` steps (the first one compiles):
forward + backward + global-norm clip + AdamW + the non-finite guard, state donated, one
`block_until_ready` per step on its metrics. Every case runs in its own Python process, so
each peak memory is that case's alone and one case running out of memory does not end the
others.

Reported per case (one JSON line each, then a table): median step time, tokens/s, MFU
(6 x parameters x tokens/s over the dense bf16 peak, 989 TFLOP/s for H100 and H200, the
formula of the FLA peer `benchmarks/peers/fla_train.py`; the same denominator for every
precision), peak device memory (`peak_bytes_in_use` of the JAX allocator, the peer reports
torch's `max_memory_allocated`), the step's compile time, and the loss of the last step
(finite, or the case says so).

    python benchmarks/train_step.py                                  # 0.1B 8x4096, 1.5B 2x4096, bf16-mixed
    python benchmarks/train_step.py --precisions bf16-mixed fp32-fast fp32
    python benchmarks/train_step.py --models 0.1b --set runtime.remat=true \
        train.loss_chunk=8192
    python benchmarks/train_step.py --models 0.1b --profile $OUT/prof   # + top ops by GPU time
    python benchmarks/train_step.py --models tiny --steps 2            # CPU smoke run
    python benchmarks/train_step.py --models 0.1b --doc-len 1000 \
        --set data.reset_at_document_boundary=true

`fp32` cases run with `XLA_FLAGS=--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0`
unless `--fp32-autotune` is given: with XLA's default GEMM autotuning the first fp32 step
compiles for ~8 minutes on an H200 (see benchmarks/RESULTS.md, "Training trust").
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {   # name: (config file, batch, ctx) — the throughput issue's shapes
    "0.1b": ("configs/rwkv7-0.1b.yaml", 8, 4096),
    "1.5b": ("configs/rwkv7-1.5b.yaml", 2, 4096),
    "tiny": ("configs/tiny.yaml", 2, 128),
    "llama-0.1b": ("configs/llama-0.1b.yaml", 8, 4096),   # the transformer beside RWKV-7
    "llama-1b": ("configs/llama-1b.yaml", 2, 4096),
    "llama-tiny": ("configs/llama-tiny.yaml", 2, 128),
    "hybrid-tiny": ("configs/rwkv7-hybrid-tiny.yaml", 2, 128),
}
PEAK_TFLOPS = 989.0
FP32_XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"


def case_config(model: str, precision: str, overrides: list[str]):
    """The run config of one case: the model's config file at its benchmark shape, `precision`,
    no data files, every device data-parallel, then `overrides` (dotted, last wins)."""
    from lwm_jax.train.config import load_config

    path, batch, ctx = MODELS[model]
    return load_config(os.path.join(REPO, path),
                       [f"precision={precision}", f"train.batch_size={batch}",
                        f"train.ctx_len={ctx}", "train.grad_accum=1", "mesh.data=-1",
                        "mesh.fsdp=1", "data.path=null", "data.val_path=null", *overrides])


def run_case(model: str, precision: str, overrides: list[str], steps: int, warmup: int,
             profile: str | None, doc_len: int = 0) -> dict:
    """Build and time one case in this process; returns its JSON row."""
    import jax
    import numpy as np

    from lwm_jax.models.registry import get_arch
    from lwm_jax.train.params import count_params
    from lwm_jax.train.preflight import device_memory, step_bytes
    from lwm_jax.train.sharding import tokens_sharding
    from lwm_jax.train.trainer import build_program

    cfg = case_config(model, precision, overrides)
    t = cfg.train
    prog = build_program(cfg)
    t_init = time.perf_counter()
    state = prog.init_state()
    jax.block_until_ready(state)
    # progress on stderr, so a case cut off by a time limit still says where its time went
    print(f"STAGE init {time.perf_counter() - t_init:.1f} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    tokens_sh = tokens_sharding(prog.mesh)

    def batch_at() -> jax.Array:
        host = rng.integers(1, cfg.model.vocab_size, (t.batch_size, t.ctx_len + 1), np.int32)
        if doc_len:       # documents of mean length doc_len: token 0 (the World EOD) ends each
            host[rng.random(host.shape) < 1.0 / doc_len] = 0
        return jax.device_put(host, tokens_sh)

    t0 = time.perf_counter()
    compiled = prog.train_step.lower(state, batch_at()).compile()
    compile_s = time.perf_counter() - t0
    print(f"STAGE compile {compile_s:.1f} s", file=sys.stderr, flush=True)
    analysis = step_bytes(compiled)
    limit = device_memory()[0]
    # printed before the first step, so a case that then runs out of memory still says how
    # much XLA planned for it and what the device offers
    print("ANALYSIS " + json.dumps({
        "xla_analysis_gib": round(analysis["peak"] / 2**30, 2) if analysis else None,
        "device_limit_gib": round(limit / 2**30, 2) if limit else None}), flush=True)
    batches = [batch_at() for _ in range(4)]
    for i in range(warmup):
        state, metrics = compiled(state, batches[i % 4])
        jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i % 4])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    if profile:
        from profile_summary import summary

        from lwm_jax.train.profiling import trace
        os.makedirs(profile, exist_ok=True)
        with open(os.path.join(profile, "step.hlo.txt"), "w", encoding="utf-8") as f:
            f.write(compiled.as_text())      # op paths of the trace's kernels (profile_summary)
        with trace(profile):          # the helper `train.profile_steps` uses
            for i in range(3):
                state, metrics = compiled(state, batches[i % 4])
                jax.block_until_ready(metrics)
    step_s = float(np.median(times))
    tokens = t.batch_size * t.ctx_len
    n_params = count_params(prog.abstract_state.params)
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() or {}
    row = {"model": model, "precision": precision, "overrides": overrides,
           "batch": t.batch_size, "ctx": t.ctx_len, "doc_len": doc_len, "params": n_params,
           "device": dev.device_kind, "jax": jax.__version__,
           "lwm_jax": os.path.dirname(sys.modules["lwm_jax"].__file__),
           "step_ms": round(step_s * 1e3, 2),
           "step_ms_min_max": [round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
           "step_ms_all": [round(x * 1e3, 2) for x in times],
           "ktok_s": round(tokens / step_s / 1e3, 2),
           "devices": jax.device_count(),   # MFU is per GPU, like the trainer's metrics
           "mfu_pct": round(6 * n_params * tokens / step_s
                            / (PEAK_TFLOPS * 1e12 * jax.device_count()) * 100, 2),
           # the field's convention (models/flops.py): 6 x non-embedding parameters + the
           # mixers' own FLOPs, per token
           "model_mfu_pct": round(get_arch(cfg.arch).model_flops_per_token(cfg.model, t.ctx_len)
                                  * tokens / step_s
                                  / (PEAK_TFLOPS * 1e12 * jax.device_count()) * 100, 2),
           "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
           "xla_analysis_gib": round(analysis["peak"] / 2**30, 2) if analysis else None,
           "compile_s": round(compile_s, 1),
           "last_loss": float(metrics["loss"]), "finite": float(metrics["finite"]),
           "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if profile:
        row["profile"] = summary(profile, n=40)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["0.1b", "1.5b"], choices=sorted(MODELS))
    ap.add_argument("--precisions", nargs="+", default=["bf16-mixed"])
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="dotted config overrides applied to every case")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", default=None,
                    help="directory: trace 3 more steps per case and list the top GPU ops")
    ap.add_argument("--fp32-autotune", action="store_true",
                    help="keep XLA's default GEMM autotuning for fp32 cases")
    ap.add_argument("--doc-len", type=int, default=0,
                    help="plant end-of-document tokens (id 0) at mean spacing N (packed "
                         "documents, for data.reset_at_document_boundary); 0 = none")
    ap.add_argument("--out", default=None, help="also append the JSON rows to this file")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "PRECISION"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        prof = args.profile
        row = run_case(args.one[0], args.one[1], args.set, args.steps, args.warmup, prof,
                       args.doc_len)
        print("ROW " + json.dumps(row), flush=True)
        return

    rows = []
    for model in args.models:
        for precision in args.precisions:
            env = dict(os.environ)
            # the caller's PYTHONPATH first: `tools/device_throughput.sh ab` points it at an
            # older commit's lwm_jax; this repo's is the fallback
            env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), REPO) if p)
            if precision == "fp32" and not args.fp32_autotune:
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FP32_XLA_FLAGS).strip()
            cmd = [sys.executable, os.path.abspath(__file__), "--one", model, precision,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--doc-len", str(args.doc_len)]
            if args.set:
                cmd += ["--set", *args.set]
            if args.profile:
                cmd += ["--profile", os.path.join(args.profile, f"{model}-{precision}")]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                row = {"model": model, "precision": precision, "overrides": args.set,
                       "error": " | ".join(tail)[-400:]}
                planned = [ln for ln in proc.stdout.splitlines() if ln.startswith("ANALYSIS ")]
                if planned:
                    row.update(json.loads(planned[-1][len("ANALYSIS "):]))
            else:
                row = json.loads(lines[-1][4:])
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
            rows.append(row)

    print("\n| model | precision | batch x ctx | step ms | ktok/s | MFU % (6N) | model MFU % | "
          "peak GiB | compile s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['precision']} | | failed: {r['error'][:80]} | | | | | |")
            continue
        print(f"| {r['model']} | {r['precision']} | {r['batch']}x{r['ctx']} | {r['step_ms']} | "
              f"{r['ktok_s']} | {r['mfu_pct']} | {r['model_mfu_pct']} | {r['peak_gib']} | "
              f"{r['compile_s']} |")


if __name__ == "__main__":
    main()
