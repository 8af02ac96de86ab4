"""The 1.5B train step's bf16 GEMM shapes jitted alone: ms and TFLOP/s under the XLA_FLAGS given.

    python3 benchmarks/gemm_shapes.py                      # XLA's default (its Triton GEMMs)
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 benchmarks/gemm_shapes.py   # cuBLAS

One JSON line per shape (M x K x N as the step runs it: 2 x 4096 tokens, C 2048, ChannelMix
8192): bf16 operands, float32 accumulation, bf16 output; the median of 5 batches of 20
back-to-back calls; `library`: whether the compiled program is a Triton GEMM fusion or a
cuBLAS call.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

SHAPES = {"channel_mix_key": (8192, 2048, 8192), "channel_mix_value": (8192, 8192, 2048),
          "time_mix_projection": (8192, 2048, 2048)}


def _batch_ms(fn, *args, calls=20):
    out = fn(*args)
    out.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    for name, (M, K, N) in SHAPES.items():
        x = jax.random.normal(kx, (M, K), jnp.bfloat16)
        w = jax.random.normal(kw, (K, N), jnp.bfloat16)
        fn = jax.jit(lambda a, b: jnp.einsum("mk,kn->mn", a, b,
                                             preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16))
        hlo = fn.lower(x, w).compile().as_text()
        ms = statistics.median(_batch_ms(fn, x, w) for _ in range(5))
        print(json.dumps({"shape": name, "M": M, "K": K, "N": N, "ms": round(ms, 4),
                          "tflops": round(2 * M * K * N / ms / 1e9, 1),
                          "library": "triton" if "gemm_fusion" in hlo else
                          "cublas" if "cublas" in hlo else "other",
                          "device": jax.devices()[0].device_kind,
                          "xla_flags": os.environ.get("XLA_FLAGS", "")}), flush=True)


if __name__ == "__main__":
    main()
