"""Inference throughput: prefill tokens/s and RNN-mode decode tokens/s (batch 1 and 64).

Random-weight models of the released shapes (throughput does not depend on the weights), built
with the official init, run through the public `lwm_jax.generate.Generator` (decode: blocks of
`--decode-block` steps on the device, one host sync per block, every token handed to the host
as a streaming user sees it) and the model's stateful forward (prefill, WKV `auto` = Pallas
kernel on GPU). Decode from 1-token prompts runs `new_tokens + 1` steps (the last one consumes
the last token), rounded up to whole blocks: `device_steps` in the JSON row.

    python benchmarks/generate.py                      # 0.1B and 1.5B, policy bf16
    python benchmarks/generate.py --decode-block 1 16 64 --models 0.1b   # compare block sizes
    python benchmarks/generate.py --models tiny        # smoke run on CPU

Prints one JSON line per measurement and a table at the end.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.models.rwkv7.config import ModelConfig
from lwm_jax.generate import Generator
from lwm_jax.models.rwkv7 import RWKV7
from lwm_jax.runtime import Runtime

MODELS = {
    "0.1b": ModelConfig(vocab_size=65536, n_layer=12, n_embd=768),
    "1.5b": ModelConfig(vocab_size=65536, n_layer=24, n_embd=2048, decay_lora=96, a_lora=96,
                        v_lora=64, gate_lora=256),
    "tiny": ModelConfig(vocab_size=256, n_layer=2, n_embd=128),
}


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_prefill(model, batch: int, length: int, reps: int) -> dict:
    """Stateful forward over `[batch, length]` random tokens returning the logits of every
    position and the state: the same work as the peer's `model(input_ids, use_cache=True)`
    (benchmarks/peers/fla_generate.py). Earlier versions returned only the state, which let XLA
    drop the LM head: those prefill numbers measured less work than FLA's."""
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def prefill(params, tokens_BT):
        m = nnx.merge(graph, params, rest)
        return m(tokens_BT, return_state=True)

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, (batch, length)), jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(prefill(params, tokens))
    compile_s = time.perf_counter() - t0
    sec = _median_time(lambda: prefill(params, tokens), reps)
    return {"kind": "prefill", "batch": batch, "tokens": length, "ms": sec * 1e3,
            "tok_per_s": batch * length / sec, "first_call_s": compile_s}


def bench_decode(model, batch: int, new_tokens: int, reps: int, block: int) -> dict:
    """`Generator.generate` from 1-token prompts: `new_tokens` sampled tokens per row, decoding
    `block` steps per compiled call."""
    gen = Generator(model, decode_block=block)
    prompts = [[int(i % model.cfg.vocab_size)] for i in range(batch)]
    t0 = time.perf_counter()
    gen.generate(prompts, max_new_tokens=4)
    compile_s = time.perf_counter() - t0
    sec = _median_time(lambda: gen.generate(prompts, max_new_tokens=new_tokens).state.wkv, reps)
    steps = -(-(new_tokens + 1) // block) * block     # whole blocks, see the module docstring
    return {"kind": "decode", "decode_block": block, "batch": batch, "tokens": new_tokens,
            "ms": sec * 1e3, "tok_per_s": batch * new_tokens / sec,
            "ms_per_token": sec * 1e3 / new_tokens,
            "device_steps": steps, "ms_per_device_step": sec * 1e3 / steps,
            "first_call_s": compile_s}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["0.1b", "1.5b"], choices=sorted(MODELS))
    p.add_argument("--policy", default="bf16")
    p.add_argument("--prefill", type=int, nargs=2, default=[1, 4096], metavar=("B", "T"))
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 64],
                   help="decode batch sizes (none: prefill only)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-block", type=int, nargs="+", default=[16],
                   help="decode steps per compiled call; several values are each measured")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    if min(args.decode_block) < 1:
        p.error(f"--decode-block: must be positive integers, got {args.decode_block}")
    dev = jax.devices()[0]
    rows = []
    for name in args.models:
        model = RWKV7(MODELS[name], args.policy, runtime=Runtime(scan_layers=True),
                      rngs=nnx.Rngs(0))
        base = {"model": name, "params_M": round(model.param_count() / 1e6, 2),
                "policy": args.policy, "device": dev.device_kind, "jax": jax.__version__}
        results = [bench_prefill(model, *args.prefill, args.reps)]
        results += [bench_decode(model, b, args.new_tokens, args.reps, k)
                    for k in args.decode_block for b in args.decode_batches]
        for r in results:
            row = {**base, **r}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
    print("\n| model | policy | kind | decode block | batch | tokens | ms | tokens/s | device |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} ({r['params_M']}M) | {r['policy']} | {r['kind']} | "
              f"{r.get('decode_block', '-')} | {r['batch']} | {r['tokens']} | {r['ms']:.1f} | "
              f"{r['tok_per_s']:,.0f} | {r['device']} |")


if __name__ == "__main__":
    main()
