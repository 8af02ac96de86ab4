"""The decay island's LoRA forward at several dot algorithms: time and error vs float64.

`w = -exp(-0.5) * sigmoid(w0 + tanh(x @ w1) @ w2)` on random operands at the 0.1B and 1.5B
training shapes (tokens per step x C x LoRA rank; x holds bf16 values, as the token-shift mix
hands them to the island under `bf16-mixed`, the weights float32), jitted alone; "split" is
`lwm_jax.precision.bf16_split` as `decay_log` runs it there (x one bf16 piece, the rest three). Prints
one JSON line per (model, algorithm): the best of 5 timed batches of 10 calls, scaled to all
layers of one step (forward only), and the largest relative error of `w` against the float64
formula. An algorithm the backend does not support prints its error instead.

    python3 benchmarks/decay_products.py          # on the device; a CPU runs every product IEEE
"""
from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from lwm_jax.precision.bf16_split import split_einsum

PRESET = jax.lax.DotAlgorithmPreset
ALGORITHMS = {"default": "default", "highest": "highest", "tf32x3": PRESET.TF32_TF32_F32_X3,
              "bf16x3": PRESET.BF16_BF16_F32_X3, "bf16x6": PRESET.BF16_BF16_F32_X6,
              "bf16x9": PRESET.BF16_BF16_F32_X9, "split": "split"}
# model: (tokens per step, C, decay LoRA rank, layers), as configs/rwkv7-{0.1b,1.5b}.yaml train
SHAPES = {"0.1b": (8 * 4096, 768, 64, 12), "1.5b": (2 * 4096, 2048, 96, 24)}


def decay_fn(w0_C, algorithm):
    def fn(x_NC, w1_CR, w2_RC):
        if algorithm == "split":
            def dot(a, b):
                pieces = 1 if a.dtype == jnp.bfloat16 else 3
                return split_einsum("nc,cr->nr", a, b, x_pieces=pieces, y_pieces=3)
        else:
            dot = lambda a, b: jnp.dot(a.astype(jnp.float32), b,  # noqa: E731
                                       precision=algorithm, preferred_element_type=jnp.float32)
        return -np.exp(-0.5) * jax.nn.sigmoid(w0_C + dot(jnp.tanh(dot(x_NC, w1_CR)), w2_RC))
    return jax.jit(fn)


def main() -> None:
    for model, (n, c, r, layers) in SHAPES.items():
        rng = np.random.default_rng(0)
        x = np.asarray(jnp.asarray(rng.standard_normal((n, c)), jnp.bfloat16))
        w1 = (0.3 * rng.standard_normal((c, r))).astype(np.float32)
        w2 = (0.1 * rng.standard_normal((r, c))).astype(np.float32)
        w0 = np.linspace(-8.0, 3.0, c).astype(np.float32)         # the init's range of w0
        d64 = w0 + np.tanh(x.astype(np.float64) @ w1) @ w2      # x: the bf16 values
        w64 = -np.exp(-0.5) / (1.0 + np.exp(-d64))
        args = [jax.device_put(a) for a in (x, w1, w2)]
        for name, algorithm in ALGORITHMS.items():
            row = {"model": model, "algorithm": name, "device": jax.devices()[0].device_kind}
            try:
                fn = decay_fn(w0, algorithm)
                w = np.asarray(fn(*args), np.float64)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(10):
                        out = fn(*args)
                    out.block_until_ready()
                    best = min(best, (time.perf_counter() - t0) / 10)
                row.update(ms_per_step=round(1e3 * best * layers, 3),
                           rel_max_w=float(np.max(np.abs(w - w64) / np.abs(w64))))
            except Exception as err:      # noqa: BLE001 -- an algorithm this backend lacks
                row["error"] = str(err).splitlines()[0][:200]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
