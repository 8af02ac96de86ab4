"""Peer for `benchmarks/train_step.py`: FLA's `RWKV7ForCausalLM` full training step.

The same shapes as our benchmark (0.1B 8 x 4096, 1.5B 2 x 4096, vocabulary 65536, head size 64,
the low-rank sizes of our configs = the released models'), the same work (forward with FLA's
default fused cross-entropy, backward, fused AdamW, `zero_grad`) and the same timer (per-step
wall time between `torch.cuda.synchronize()`s, median over `--steps` after `--warmup`).
Parameter count and MFU as ours: 6 x all parameters x tokens/s over 989 TFLOP/s.

Modes: `amp` = fp32 parameters + bf16 autocast (the like-for-like peer of our `bf16-mixed`),
`fp32` = no autocast, TF32 matmuls allowed (the peer of `fp32-fast`), `bf16-params` = the
whole model in bf16.

Needs torch with CUDA, transformers and the FLA wheels (`fla-core`, `flash-linear-attention`)
and einops; the project itself never imports them. FLA's Triton autotuning takes minutes on a
fresh machine (inside the warm-up steps).

    PYTHONPATH=/tmp/site python3 benchmarks/peers/fla_train.py --models 0.1b 1.5b --modes amp
"""
from __future__ import annotations

import argparse
import json
import time

import torch

MODELS = {   # name: (model kwargs, batch, ctx)
    "0.1b": (dict(hidden_size=768, num_hidden_layers=12, decay_low_rank_dim=64,
                  a_low_rank_dim=64, v_low_rank_dim=32, gate_low_rank_dim=128), 8, 4096),
    "1.5b": (dict(hidden_size=2048, num_hidden_layers=24, decay_low_rank_dim=96,
                  a_low_rank_dim=96, v_low_rank_dim=64, gate_low_rank_dim=256), 2, 4096),
}
PEAK_TFLOPS = 989.0


def run(model_name: str, mode: str, steps: int, warmup: int) -> dict:
    from fla.models import RWKV7Config, RWKV7ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = True
    kwargs, batch, ctx = MODELS[model_name]
    cfg = RWKV7Config(vocab_size=65536, head_dim=64, **kwargs)
    with torch.device("cuda"):     # FLA's init runs per-channel loops and QRs: fast on GPU
        model = RWKV7ForCausalLM(cfg)
    if mode == "bf16-params":
        model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randint(0, cfg.vocab_size, (batch, ctx), device="cuda", generator=gen)
              for _ in range(4)]

    def step(x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=(mode == "amp")):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(warmup):
        step(inputs[i % 4])
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(inputs[i % 4])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tokens = batch * ctx
    row = {"peer": "fla", "model": model_name, "mode": mode, "batch": batch, "ctx": ctx,
           "params": n_params, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "step_ms": round(step_s * 1e3, 2),
           "step_ms_min_max": [round(min(times) * 1e3, 2), round(max(times) * 1e3, 2)],
           "step_ms_all": [round(x * 1e3, 2) for x in times],
           "ktok_s": round(tokens / step_s / 1e3, 2),
           "mfu_pct": round(6 * n_params * tokens / step_s / (PEAK_TFLOPS * 1e12) * 100, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "warmup_s": round(warmup_s, 1), "last_loss": float(loss)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["0.1b", "1.5b"], choices=sorted(MODELS))
    ap.add_argument("--modes", nargs="+", default=["amp"], choices=["amp", "fp32", "bf16-params"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    for model_name in args.models:
        for mode in args.modes:
            print(json.dumps(run(model_name, mode, args.steps, args.warmup)), flush=True)
            torch.cuda.empty_cache()      # the model and optimizer died with run()'s frame


if __name__ == "__main__":
    main()
