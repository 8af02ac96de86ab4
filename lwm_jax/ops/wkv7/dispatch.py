"""Public WKV7 op: input validation and dispatch to an implementation.

Contract (docs/design.md, "WKV7 op contract"): FLA layout, per head state S [K, V] in float32,
`S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T`, `o_t = S_t^T r_t`.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from lwm_jax.hardware import platform_of
from lwm_jax.ops.wkv7.contract import (PRECISIONS, check_wkv7_inputs, resolve_output_dtype,
                                       xla_precision)
from lwm_jax.ops.wkv7.chunked import wkv7_chunked
from lwm_jax.ops.wkv7.recurrent import wkv7_recurrent

IMPLS = ("auto", "pallas", "chunked", "recurrent")
PLATFORMS = ("cpu", "gpu", "tpu")
CHUNKED_DEFAULT_CHUNK = 64


@functools.cache
def _load_pallas():
    """`(wkv7_pallas, None)` if the Pallas kernel imports, else `(None, reason)`."""
    try:
        from lwm_jax.ops.wkv7.pallas import wkv7_pallas
    except ImportError as err:
        return None, f"{type(err).__name__}: {err}"
    return wkv7_pallas, None


def _resolve_impl(impl: str, platform: str | None = None) -> str:
    """The implementation `impl` runs as on `platform` (None: JAX's default devices')."""
    if impl == "auto":
        on_accelerator = (platform or platform_of()) in ("gpu", "tpu")
        return "pallas" if on_accelerator and _load_pallas()[0] is not None else "chunked"
    if impl == "pallas" and _load_pallas()[0] is None:
        raise RuntimeError("wkv7: impl='pallas' needs lwm_jax.ops.wkv7.pallas.wkv7_pallas, which "
                           f"did not import ({_load_pallas()[1]}); use impl='chunked' or "
                           "'recurrent'")
    return impl



def _validate(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, impl, output_dtype,
              precision=None, platform=None):
    """Check shapes, dtypes and options; return the output dtype. One-line errors."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"wkv7: impl must be one of {IMPLS}, got {impl!r}")
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"wkv7: platform must be None or one of {PLATFORMS}, got {platform!r}")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"wkv7: precision must be None or one of {PRECISIONS}, got "
                         f"{precision!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"wkv7: chunk_size must be None (the implementation's default) or an "
                         f"int >= 1, got {chunk_size!r}")
    dtype = check_wkv7_inputs(r, w, k, v, a, b, initial_state, segment_ids)

    return resolve_output_dtype(output_dtype, dtype, "wkv7")


def wkv7(r, w, k, v, a, b, *, initial_state=None, return_state=False, segment_ids=None,
         chunk_size=None, impl="auto", output_dtype=None, precision=None, platform=None):
    """RWKV-7 WKV (generalized delta rule) over a sequence, FLA layout.

    Args:
      r, k: receptance and key `[B, T, H, K]`; v: value `[B, T, H, V]`.
      w: log-decay `[B, T, H, K]` (<= 0; per-step decay exp(w)), float32 or the inputs' dtype.
      a, b: the rank-1 update vectors `[B, T, H, K]` (`a = -kk`, `b = kk * a_icl` in RWKV-7).
        r, k, v, a, b share one dtype (bfloat16, float16 or float32).
      initial_state: `[B, H, K, V]` float32 state before position 0, or None (zeros).
      return_state: also return the float32 state after the last position.
      segment_ids: optional int `[B, T]`; the state resets to zero wherever the id differs from
        the previous position's (packed documents). See `segment_ids_from_cu_seqlens`.
      chunk_size: chunk length of the "chunked" and "pallas" implementations; None = the
        implementation's default (chunked: 64; pallas: 32 on GPU, its measured fastest, 64 on TPU).
      impl: "recurrent" (token scan), "chunked" (chunk-parallel JAX), "pallas" (kernel), or
        "auto" (pallas on GPU/TPU when it imports, else chunked).
      output_dtype: dtype of `o` (default: v.dtype). Arithmetic is float32 whatever it is.
      precision: matmul precision of the chunked forms' products ("default" | "high" |
        "highest" | "tf32x3"; the model passes `Policy.wkv_precision`). "chunked": as XLA
        defines it per backend ("tf32x3" = "highest"); Pallas GPU: "default"/"high" = TF32,
        "highest" = IEEE fp32, "tf32x3" = three TF32 passes (fp32-level error); Pallas TPU:
        "default" = one bf16 pass, "high"/"highest"/"tf32x3" = fp32. None = the implementation's own
        default (chunked and TPU: "highest"; GPU: "highest" for float32 inputs, else TF32).
        "recurrent" has no matmuls: exact fp32 whatever this says.
      platform: the platform the surrounding program is compiled for ("cpu" | "gpu" | "tpu";
        the model passes its mesh's, `lwm_jax.hardware.platform_of`); it picks "auto"'s
        implementation and the Pallas kernel family. None = JAX's default devices.

    Returns:
      `o [B, T, H, V]`, or `(o, final_state [B, H, K, V] float32)` when `return_state`.
    """
    out_dtype = _validate(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, impl,
                          output_dtype, precision, platform)
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
    if initial_state is not None:
        initial_state = jnp.asarray(initial_state).astype(jnp.float32)
    chosen = _resolve_impl(impl, platform)
    if chosen == "recurrent":
        o, state = wkv7_recurrent(r, w, k, v, a, b, initial_state, segment_ids, out_dtype)
    elif chosen == "chunked":
        o, state = wkv7_chunked(r, w, k, v, a, b, initial_state, segment_ids,
                                chunk_size or CHUNKED_DEFAULT_CHUNK, out_dtype,
                                xla_precision(precision))
    else:
        wkv7_pallas = _load_pallas()[0]
        o, state = wkv7_pallas(r, w, k, v, a, b, initial_state, segment_ids, chunk_size,
                               out_dtype, precision=precision, platform=platform)
    return (o, state) if return_state else o
