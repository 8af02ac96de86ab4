"""Peer for `benchmarks/wkv7.py speed`: FLA's `chunk_rwkv7` timed exactly as ours is timed.

Same shapes and input distribution as ours (`lwm_jax.ops.wkv7.testing.random_wkv7_inputs`: r, v
standard normal, k 0.5 x normal, log-decay -exp(-0.5) x sigmoid(2 n - 1), a = -kk, b = kk x
sigmoid(n) with kk unit per head), bf16, FLA's own layer settings (chunk 64, safe gate, lower
bound -exp(-0.5)). Timer (the same as `benchmarks/wkv7.py bench`): one warm-up call, one timed
call to size a batch of >= 50 ms of back-to-back calls, then the median over 7 batches of the
per-call time, one `torch.cuda.synchronize()` per batch. fwd+bwd = forward and the gradients of
all six inputs for a fixed random cotangent.

    PYTHONPATH=/tmp/site python benchmarks/peers/fla_wkv7.py       # prints one JSON line per shape
"""
from __future__ import annotations

import json
import math
import os

import torch

os.environ.setdefault("FLA_TILELANG", "0")   # FLA_TILELANG=1 runs its TileLang backend instead
from fla.ops.rwkv7 import chunk_rwkv7  # noqa: E402
from torch_timer import timed  # noqa: E402  (benchmarks/peers/, the script's folder)

LOWER = -math.exp(-0.5)
SHAPES = [(8, 4096, 12, 64), (4, 4096, 32, 64), (1, 32768, 32, 64), (16, 2048, 32, 64)]


def make_inputs(B, T, H, D, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    normal = lambda: torch.randn(B, T, H, D, device="cuda", generator=g)  # noqa: E731
    r, k, v = normal(), 0.5 * normal(), normal()
    w = LOWER * torch.sigmoid(2 * normal() - 1)
    kk = torch.nn.functional.normalize(normal(), dim=-1)
    icl = torch.sigmoid(normal())
    return [x.to(dtype) for x in (r, w, k, v, -kk, kk * icl)]


def main():
    for B, T, H, D in SHAPES:
        xs = make_inputs(B, T, H, D)
        fwd = lambda: chunk_rwkv7(*xs, scale=1.0, safe_gate=True,  # noqa: E731
                                  lower_bound=LOWER, chunk_size=64)[0]
        leaves = [x.detach().requires_grad_(True) for x in xs]
        do = torch.randn(B, T, H, D, device="cuda", dtype=xs[0].dtype)

        def fwd_bwd():
            o = chunk_rwkv7(*leaves, scale=1.0, safe_gate=True, lower_bound=LOWER,
                            chunk_size=64)[0]
            return torch.autograd.grad(o, leaves, do)

        fwd_ms, fwdbwd_ms = timed(fwd) * 1e3, timed(fwd_bwd) * 1e3
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        print(json.dumps({"impl": "fla", "B": B, "T": T, "H": H, "D": D, "fwd_ms": fwd_ms,
                          "fwdbwd_ms": fwdbwd_ms,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)


if __name__ == "__main__":
    main()
