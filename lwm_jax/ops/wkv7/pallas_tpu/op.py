"""WKV7 (RWKV-7 generalized delta rule) on TPU: Pallas/Mosaic forward and backward kernels.

`wkv7_tpu` validates the inputs, lays them out head-major (`[B, T, H, K] -> [B*H, T, K]`, state
`[B, H, K, V] -> [B*H, V, K]`), pads T to a multiple of the chunk length, and calls a
`jax.custom_vjp` whose forward (`fwd.py`) and backward (`bwd.py`) are Pallas kernels.
The per-chunk math lives in `tiles.py`.

Numerics: inputs are upcast to float32 inside the kernels; the state, every accumulation and all
in-kernel matmuls are float32 (`precision="highest"` by default: on TPU that is full fp32 on the
MXU). float16 inputs are upcast to float32 before the kernels (TPUs have no native f16 math).
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.ops.wkv7.pallas_tpu.bwd import wkv7_bwd_pallas
from lwm_jax.ops.wkv7.pallas_tpu.fwd import wkv7_fwd_pallas
from lwm_jax.ops.wkv7.contract import INPUT_DTYPES as _FLOATS
from lwm_jax.ops.wkv7.contract import TPU_MAX_CHUNK, check_wkv7_inputs
from lwm_jax.ops.segments import chunk_reset_counter
from lwm_jax.remat_names import WKV7_RESIDUALS_NAME

# Mosaic lowers DEFAULT (one bf16 MXU pass) and HIGHEST (full fp32); "high" (3 bf16 passes in
# XLA) and "tf32x3" (no TF32 on TPU) run as HIGHEST here: never less precise than asked.
# Keyed by the contract's names (`lwm_jax.ops.wkv7.contract.PRECISIONS`).
_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "high": jax.lax.Precision.HIGHEST,
               "tf32x3": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}


class _Config(NamedTuple):
    H: int
    C: int
    output_dtype: Any
    precision: Any
    interpret: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _wkv7_core(r, w, k, v, a, b, h0, seg_col, seg_row, cfg: _Config):
    o, hT = wkv7_fwd_pallas(r, w, k, v, a, b, h0, seg_col, seg_row, H=cfg.H, C=cfg.C,
                            output_dtype=cfg.output_dtype, save_states=False,
                            precision=cfg.precision, interpret=cfg.interpret)
    return o, hT


def _wkv7_core_fwd(r, w, k, v, a, b, h0, seg_col, seg_row, cfg: _Config):
    o, hT, states = wkv7_fwd_pallas(r, w, k, v, a, b, h0, seg_col, seg_row, H=cfg.H, C=cfg.C,
                                    output_dtype=cfg.output_dtype, save_states=True,
                                    precision=cfg.precision, interpret=cfg.interpret)
    states = checkpoint_name(states, WKV7_RESIDUALS_NAME)   # a remat policy may keep them
    return (o, hT), (r, w, k, v, a, b, states, seg_col, seg_row)


def _wkv7_core_bwd(cfg: _Config, residuals, cotangents):
    r, w, k, v, a, b, states, seg_col, seg_row = residuals
    do, dhT = cotangents
    dr, dw, dk, dv, da, db, dh0 = wkv7_bwd_pallas(
        r, w, k, v, a, b, states, do, dhT.astype(jnp.float32), seg_col, seg_row, H=cfg.H,
        C=cfg.C, precision=cfg.precision, interpret=cfg.interpret)
    return dr, dw, dk, dv, da, db, dh0, None, None


_wkv7_core.defvjp(_wkv7_core_fwd, _wkv7_core_bwd)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _validate(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype, precision):
    check_wkv7_inputs(r, w, k, v, a, b, initial_state, segment_ids)
    if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 16
            or chunk_size % 16 or chunk_size > TPU_MAX_CHUNK):
        raise ValueError(f"chunk_size must be a multiple of 16 (TPU bf16 sublane tile) in "
                         f"[16, {TPU_MAX_CHUNK}] (longer chunks can overflow float32 exponents at "
                         f"RWKV-7's strongest decay), got {chunk_size!r}")
    if output_dtype is not None and jnp.dtype(output_dtype) not in _FLOATS:
        raise TypeError(f"output_dtype must be float32, bfloat16 or float16, got {output_dtype}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(_PRECISIONS)} (Mosaic supports no "
                         f"other), got {precision!r}")


def _segment_counters(segment_ids, T_pad, C):
    """Per-chunk reset counters: `[B, T_pad, 1]` (column form) and `[B, NT, 1, C]` (row form).

    Entry t counts the resets (id differs from the previous position's) from the chunk's first
    position up to t; padding positions repeat the last id, so they never reset.
    """
    B = segment_ids.shape[0]
    local_BNC = chunk_reset_counter(segment_ids, T_pad, C).reshape(B, T_pad // C, C)
    return local_BNC.reshape(B, T_pad, 1), local_BNC[:, :, None, :]


def wkv7_tpu(r, w, k, v, a, b, initial_state=None, segment_ids=None, chunk_size=64,
             output_dtype=None, interpret=False, precision="highest"):
    """WKV7 with Pallas TPU kernels (forward and backward), differentiable via `jax.custom_vjp`.

    Args:
      r, w, k, a, b: `[B, T, H, K]`; `w` is the log-decay (<= 0). r/k/a/b share one dtype
        (float32, bfloat16 or float16); `w` is float32 or that dtype.
      v: `[B, T, H, V]`, same dtype as r.
      initial_state: `[B, H, K, V]` float32 or None (zeros). Differentiable.
      segment_ids: int `[B, T]` or None; the state resets to zero where the id differs from the
        previous position's.
      chunk_size: chunk length C (multiple of 16; capped at T rounded up to 16). The kernels
        assume |sum of w over C/2 steps| < ~80 (true for RWKV-7's w >= -exp(-0.5) up to C=256).
      output_dtype: dtype of `o` (default: v's dtype).
      interpret: False on TPU; True (or a `pltpu.InterpretParams`) runs the kernels on CPU.
      precision: "highest" (fp32 MXU matmuls) or "default" (one bf16 MXU pass: faster, ~1e-3
        error; the in-chunk cumulative sums of w stay fp32). A `jax.lax.Precision` also works.

    Returns:
      `(o [B, T, H, V] in output_dtype, final_state [B, H, K, V] float32)`.
    """
    if isinstance(precision, jax.lax.Precision):
        precision = precision.name.lower()
    _validate(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype, precision)
    B, T, H, K = r.shape
    V = v.shape[-1]
    out_dtype = jnp.dtype(v.dtype if output_dtype is None else output_dtype)
    if jnp.dtype(r.dtype) == jnp.float16:
        r, k, v, a, b = (x.astype(jnp.float32) for x in (r, k, v, a, b))
    if jnp.dtype(w.dtype) == jnp.float16:
        w = w.astype(jnp.float32)
    kernel_out_dtype = jnp.float32 if out_dtype == jnp.float16 else out_dtype
    C = min(chunk_size, _round_up(T, 16))
    T_pad = _round_up(T, C)

    def to_heads(x):  # [B, T, H, D] -> [B*H, T_pad, D]; padding steps are exact no-ops
        x = jnp.pad(x, ((0, 0), (0, T_pad - T), (0, 0), (0, 0)))
        return jnp.transpose(x, (0, 2, 1, 3)).reshape(B * H, T_pad, x.shape[-1])

    if initial_state is None:
        h0 = jnp.zeros((B * H, V, K), jnp.float32)
    else:
        h0 = jnp.swapaxes(initial_state.astype(jnp.float32), -1, -2).reshape(B * H, V, K)
    seg_col = seg_row = None
    if segment_ids is not None:
        seg_col, seg_row = _segment_counters(segment_ids, T_pad, C)
    cfg = _Config(H=H, C=C, output_dtype=kernel_out_dtype, precision=_PRECISIONS[precision],
                  interpret=interpret)
    o, hT = _wkv7_core(*(to_heads(x) for x in (r, w, k, v, a, b)), h0, seg_col, seg_row, cfg)
    o = jnp.transpose(o.reshape(B, H, T_pad, V), (0, 2, 1, 3))[:, :T].astype(out_dtype)
    final_state = jnp.swapaxes(hT.reshape(B, H, V, K), -1, -2)
    return o, final_state
