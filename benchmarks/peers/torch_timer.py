"""The timer of every torch peer, the same scheme as ours (`benchmarks/wkv7.py bench`).

One warm-up call, one timed call to size a batch of >= `min_batch_s` of back-to-back calls, then
the median over `rounds` batches of the per-call time (seconds), one `torch.cuda.synchronize()`
per batch.
"""
from __future__ import annotations

import statistics
import time


def timed(fn, min_batch_s: float = 0.05, rounds: int = 7) -> float:
    """Median seconds per call of `fn()` (a CUDA workload) by the scheme above."""
    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(1, int(min_batch_s / max(time.perf_counter() - t0, 1e-5)))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def time_wkv(fn, xs, leaves, do) -> tuple[float, float, float]:
    """(fwd ms, fwd+bwd ms, peak GiB of one fwd+bwd) of a WKV op `fn(r, w, k, v, a, b)`: the
    forward on `xs` (no gradient), forward + the gradients of all of `leaves` (the same inputs,
    requiring grad) for the cotangent `do`, each by `timed`."""
    import torch
    f_ms = timed(lambda: fn(*xs)) * 1e3
    fb_ms = timed(lambda: torch.autograd.grad(fn(*leaves), leaves, do)) * 1e3
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad(fn(*leaves), leaves, do)
    torch.cuda.synchronize()
    return f_ms, fb_ms, torch.cuda.max_memory_allocated() / 2**30
