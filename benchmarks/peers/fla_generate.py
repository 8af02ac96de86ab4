"""Peer for `benchmarks/generate.py`: FLA's `RWKV7ForCausalLM` prefill and decode throughput.

Same shapes, dtype (bf16 weights) and work as our benchmark: prefill = one forward over
`[1, 4096]` random tokens with the cache on; decode = from 1-token prompts, 128 new tokens per
row sampled at temperature 1 (softmax + multinomial on the fp32 logits), one model call per
token with FLA's cache, the loop a Hugging Face `generate` runs. FLA takes its recurrent kernel
(`fused_mul_recurrent_rwkv7`) for one-token calls under `no_grad`. Random weights (FLA's init):
throughput does not depend on them.

Needs torch with CUDA, transformers and the FLA wheels (`fla-core`, `flash-linear-attention`);
the project itself never imports them.

    PYTHONPATH=/tmp/site python3 benchmarks/peers/fla_generate.py

Prints one JSON line per measurement.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

MODELS = {
    "0.1b": dict(hidden_size=768, num_hidden_layers=12),
    "1.5b": dict(hidden_size=2048, num_hidden_layers=24, decay_low_rank_dim=96,
                 a_low_rank_dim=96, v_low_rank_dim=64, gate_low_rank_dim=256),
}


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def decode(model, batch: int, new_tokens: int, vocab: int, gen: torch.Generator):
    ids = torch.randint(0, vocab, (batch, 1), device="cuda", generator=gen)
    out = model(input_ids=ids, use_cache=True)
    for _ in range(new_tokens):
        probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
        ids = torch.multinomial(probs, 1, generator=gen)
        out = model(input_ids=ids, past_key_values=out.past_key_values, use_cache=True)
    return ids


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["0.1b", "1.5b"], choices=sorted(MODELS))
    p.add_argument("--prefill", type=int, nargs=2, default=[1, 4096], metavar=("B", "T"))
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 64],
                   help="decode batch sizes (none: prefill only)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    for name in args.models:
        run_model(name, args)
        torch.cuda.empty_cache()


def run_model(name: str, args) -> None:
    import fla
    from fla.models import RWKV7Config, RWKV7ForCausalLM
    V = 65536
    gen = torch.Generator(device="cuda").manual_seed(0)
    cfg = RWKV7Config(vocab_size=V, head_dim=64, **MODELS[name])
    with torch.device("cuda"):     # FLA's init runs per-channel loops and QRs: fast on GPU
        model = RWKV7ForCausalLM(cfg).to(dtype=torch.bfloat16).eval()
    base = {"peer": f"fla {getattr(fla, '__version__', '?')}", "model": name,
            "params_M": round(sum(x.numel() for x in model.parameters()) / 1e6, 2),
            "dtype": "bf16", "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    B, T = args.prefill
    tokens = torch.randint(0, V, (B, T), device="cuda", generator=gen)
    with torch.no_grad():
        model(input_ids=tokens, use_cache=True)                            # warm-up / autotune
        sec = _median_s(lambda: model(input_ids=tokens, use_cache=True), args.reps)
    print(json.dumps({**base, "kind": "prefill", "batch": B, "tokens": T, "ms": sec * 1e3,
                      "tok_per_s": B * T / sec}), flush=True)
    for batch in args.decode_batches:
        decode(model, batch, 4, V, gen)                                       # warm-up
        sec = _median_s(lambda: decode(model, batch, args.new_tokens, V, gen), args.reps)
        print(json.dumps({**base, "kind": "decode", "batch": batch, "tokens": args.new_tokens,
                          "ms": sec * 1e3, "tok_per_s": batch * args.new_tokens / sec,
                          "ms_per_token": sec * 1e3 / args.new_tokens}), flush=True)

if __name__ == "__main__":
    main()
