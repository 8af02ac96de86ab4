"""WKV7 kernels on Pallas Mosaic GPU (Hopper, sm_90a: wgmma + TMA).

    from lwm_jax.ops.wkv7.mosaic_gpu import state_pass, pair_maps

`state_pass.py` holds the chunk chains the GPU op runs on Hopper (`lwm_jax.ops.wkv7.pallas`
takes them when `mosaic_chains` says so): the forward chain (chunk states, or the outputs in
forward-only calls) and the backward chain of state cotangents; `output_chain.py` the
forward-only output chain at 16 or 32 value columns per CTA on two warpgroups. `pair_maps.py`
holds the chunk maps in the chains' format, two chunks per CTA (exact, but not wired: slower
than the Triton chunk launch). `tiles.py` is what they share.

Needs jax >= 0.11 (its `jax.experimental.pallas.mosaic_gpu` API); on older jax importing this
package raises an ImportError that says so (`lwm_jax.ops.wkv7.pallas` then keeps the Triton
launches).
"""
from __future__ import annotations

import jax

_MIN_JAX = (0, 11)


def _jax_version() -> tuple[int, ...]:
    parts = []
    for piece in jax.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


if _jax_version() < _MIN_JAX:
    raise ImportError(f"lwm_jax.ops.wkv7.mosaic_gpu needs jax >= 0.11 (Pallas Mosaic GPU API), "
                      f"found jax {jax.__version__}")
