"""The loss chunk's cross-entropy statistics and logits gradient alone: XLA (two passes over the
float32 logits) against the one-kernel Pallas form (`lwm_jax.ops.xent`), on one GPU.

    python benchmarks/xent.py [--rows 4096] [--vocab 65536] [--warps 8 16 32] [--blocks 4096]

Prints one JSON line per variant: median ms over timed batches, the HBM bytes a two-pass and a
one-pass schedule must move (read the logits once or twice, write the bfloat16 gradient) as
GB/s at that time, and the largest difference from the XLA form (gradient in bfloat16 units).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# this checkout's lwm_jax when it is not installed; a PYTHONPATH tree (an A/B) still wins
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="tokens per loss chunk")
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--warps", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--blocks", type=int, nargs="+", default=[4096])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    from lwm_jax.ops.xent import xent_pallas, xent_reference
    N, V = args.rows, args.vocab
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x = 4 * jax.random.normal(k1, (N, V), jnp.float32)
    t = jax.random.randint(k2, (N,), 0, V, jnp.int32)
    s = jnp.ones((N,), jnp.float32)
    kw = dict(l2wrap=1e-4, grad_dtype=jnp.bfloat16)
    variants = [("xla", jax.jit(lambda x, t, s: xent_reference(x, t, s, **kw)))]
    for w in args.warps:
        for b in args.blocks:
            variants.append((f"pallas w{w} b{b}", jax.jit(
                lambda x, t, s, w=w, b=b: xent_pallas(x, t, s, num_warps=w, block=b, **kw))))
    ref = None
    for name, f in variants:
        out = jax.block_until_ready(f(x, t, s))
        if ref is None:
            ref = out
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                   for a, b in zip(out, ref) if a.dtype != jnp.int32)
        same_idx = bool(jnp.all(out[3] == ref[3]))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for _ in range(5):
                out = f(x, t, s)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / 5)
        ms = statistics.median(times) * 1e3
        one_pass, two_pass = N * V * (4 + 2), N * V * (8 + 2)
        print(json.dumps({"variant": name, "rows": N, "vocab": V, "ms": round(ms, 4),
                          "GBps_if_one_read": round(one_pass / ms / 1e6, 1),
                          "GBps_if_two_reads": round(two_pass / ms / 1e6, 1),
                          "max_abs_diff": diff, "same_argmax": same_idx,
                          "device": jax.devices()[0].device_kind}), flush=True)


if __name__ == "__main__":
    main()
