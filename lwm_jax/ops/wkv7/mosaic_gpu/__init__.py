"""WKV7 kernels on Pallas Mosaic GPU (Hopper, sm_90a: wgmma + TMA).

    from lwm_jax.ops.wkv7.mosaic_gpu import wkv7_mosaic_fwd, wkv7_mosaic_fwd2
    o, final_state = wkv7_mosaic_fwd(r, w, k, v, a, b, initial_state=None)   # one CTA per head
    o, final_state = wkv7_mosaic_fwd2(r, w, k, v, a, b, seq=...)  # chunk-parallel + sequential

Needs jax >= 0.11 (its `jax.experimental.pallas.mosaic_gpu` API); on older jax importing this
package raises an ImportError that says so (`lwm_jax.ops.wkv7.pallas` then keeps the Triton
launches).
See `fwd.py` for the per-chunk algebra, shapes and precision, `chunks.py` (the chunk-parallel
maps) and `two_phase.py` (the two-phase forward; its phase 2 is passed in, e.g. the Triton
launches, since this package may not import pallas_gpu). `state_pass.py` holds the chunk chains
the GPU op runs on Hopper; `pair_maps.py` the chunk maps in the chains' format, two chunks per
CTA (not wired: slower than the Triton launch).
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

from lwm_jax.ops.wkv7.mosaic_gpu.fwd import CHUNK, wkv7_mosaic_fwd  # noqa: E402
from lwm_jax.ops.wkv7.mosaic_gpu.two_phase import sequential_xla, wkv7_mosaic_fwd2  # noqa: E402

__all__ = ["CHUNK", "sequential_xla", "wkv7_mosaic_fwd", "wkv7_mosaic_fwd2"]
