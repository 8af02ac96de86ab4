"""The WKV7 contract shared by every entry point (the op and the Pallas kernels): shape and
dtype checks, the input dtypes and the matmul precision names. A leaf: imports nothing of
`lwm_jax`.

Each failure is a one-line ValueError/TypeError that names the argument and says what it must be.
"""
from __future__ import annotations

import jax.numpy as jnp

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Matmul precision names of the chunked forms' in-chunk products (`wkv7(..., precision=)`):
# each backend maps them in its own module (chunked: XLA names; pallas_gpu / pallas_tpu: their
# dot precisions); "tf32x3" runs as "highest" where there is no 3xTF32.
PRECISIONS = ("default", "high", "highest", "tf32x3")


def xla_precision(name: str | None) -> str:
    """The XLA precision name an XLA (non-kernel) path runs a WKV precision name at: None and
    "tf32x3" (no 3xTF32 there) run as "highest"."""
    return "highest" if name in (None, "tf32x3") else name

# RWKV-7's decay bound: w = -exp(-0.5) * sigmoid(.) > W_MIN, so -(sum of w over C steps) < C * 0.61.
# Exponent-range strategies (each path's longest chunk is set so that its largest exponent stays
# below ~40 at this bound, half of float32's e^88 overflow; `tests/ops/wkv7/test_wkv7_limits.py`
# runs every path at its longest chunk with every w at the bound):
#   chunked (XLA): exponents are sums over forward intervals inside 16-token sub-blocks: <= 0
#     for any w <= 0 and any chunk length (no limit);
#   pallas_gpu:    e^{+-g} factors around the chunk start: |exponent| <= C * 0.61 -> C <= 64;
#   pallas_tpu:    factors around the chunk's middle: |exponent| <= C * 0.61 / 2 -> C <= 128.
W_MIN = -0.6065306597126334          # -exp(-0.5)
GPU_MAX_CHUNK = 64
TPU_MAX_CHUNK = 128


def check_wkv7_inputs(r, w, k, v, a, b, initial_state=None, segment_ids=None):
    """Check r, w, k, a, b `[B, T, H, K]`, v `[B, T, H, V]`, one input dtype (w may be f32),
    `initial_state` `[B, H, K, V]` float, `segment_ids` `[B, T]` integer. Returns the inputs'
    dtype."""
    args = {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b}
    for name, x in args.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"wkv7: {name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            want = "[B, T, H, V]" if name == "v" else "[B, T, H, K]"
            raise ValueError(f"wkv7: {name} must be 4-D {want}, got shape {tuple(x.shape)}")
    B, T, H, K = r.shape
    for name in ("w", "k", "a", "b"):
        if tuple(args[name].shape) != (B, T, H, K):
            raise ValueError(f"wkv7: {name} has shape {tuple(args[name].shape)} but r has "
                             f"{(B, T, H, K)}; r, w, k, a, b must all be [B, T, H, K]")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"wkv7: v has shape {tuple(v.shape)}; it must be [B, T, H, V] with "
                         f"B, T, H = {(B, T, H)} from r")
    if T < 1:
        raise ValueError(f"wkv7: sequence length T must be >= 1, got r shape {(B, T, H, K)}")
    V = v.shape[3]

    dtype = jnp.dtype(r.dtype)
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"wkv7: r has dtype {dtype}; inputs must be bfloat16, float16 or float32")
    for name in ("k", "v", "a", "b"):
        if jnp.dtype(args[name].dtype) != dtype:
            raise TypeError(f"wkv7: {name} has dtype {jnp.dtype(args[name].dtype)} but r has "
                            f"{dtype}; r, k, v, a, b must share one dtype (cast {name} to {dtype})")
    if jnp.dtype(w.dtype) not in (dtype, jnp.dtype(jnp.float32)):
        raise TypeError(f"wkv7: w has dtype {jnp.dtype(w.dtype)}; it must be float32 or the "
                        f"inputs' dtype {dtype}")

    if initial_state is not None:
        if not hasattr(initial_state, "shape") or tuple(initial_state.shape) != (B, H, K, V):
            got = tuple(getattr(initial_state, "shape", ())) or type(initial_state).__name__
            raise ValueError(f"wkv7: initial_state must be [B, H, K, V] = {(B, H, K, V)}, "
                             f"got {got}")
        if not jnp.issubdtype(initial_state.dtype, jnp.floating):
            raise TypeError(f"wkv7: initial_state has dtype {initial_state.dtype}; it must be "
                            "float32")
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape") or tuple(segment_ids.shape) != (B, T):
            got = tuple(getattr(segment_ids, "shape", ())) or type(segment_ids).__name__
            raise ValueError(f"wkv7: segment_ids must be [B, T] = {(B, T)}, got {got}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"wkv7: segment_ids has dtype {segment_ids.dtype}; it must be an "
                            "integer type (int32)")
    return dtype


def resolve_output_dtype(output_dtype, default, where: str):
    """`output_dtype` as a numpy dtype (`default` when None); TypeError unless bf16/f16/f32."""
    if output_dtype is None:
        return jnp.dtype(default)
    try:
        out = jnp.dtype(output_dtype)
    except TypeError:
        out = None
    if out not in INPUT_DTYPES:
        raise TypeError(f"{where}: output_dtype must be bfloat16, float16 or float32, "
                        f"got {output_dtype!r}")
    return out
