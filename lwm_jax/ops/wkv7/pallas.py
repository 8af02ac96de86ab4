"""Pallas WKV7 (RWKV-7 generalized delta rule) kernels, forward + backward via `jax.custom_vjp`.

    o, final_state = wkv7_pallas(r, w, k, v, a, b, initial_state, segment_ids, chunk_size,
                                 output_dtype)

FLA layout: r, w, k, a, b `[B, T, H, K]`, v `[B, T, H, V]`, w = log-decay (<= 0), state
`[B, H, K, V]` float32: `S_t = diag(e^{w_t}) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T`,
`o_t = S_t^T r_t`. `initial_state` / `segment_ids` may be None.

Dispatch on the platform the program is compiled for (`platform`; None: JAX's default
devices, `lwm_jax.hardware.platform_of`):
  gpu -> Pallas-Triton kernels (`pallas_gpu/`: `op.py`, `launches.py`, `tiles.py`,
         `tiles_bwd_stacked.py`), with the chunk chains on Pallas Mosaic GPU
         (`mosaic_gpu/state_pass.py`) where `mosaic_chains` says (Hopper, jax >= 0.11);
  tpu -> `lwm_jax.ops.wkv7.pallas_tpu.op.wkv7_tpu` (Pallas/Mosaic TPU);
  cpu -> the GPU kernels in the Pallas interpreter (tests; slow).

Accuracy and speed against FLA and a float64 reference: `benchmarks/RESULTS.md` (WKV7 kernel
sections); `benchmarks/wkv7.py` reproduces them.

Lowering choice (GPU). The kernels are written for the Pallas *Triton* backend
(`pl.pallas_call` with `plgpu.CompilerParams`, `from jax.experimental.pallas import triton`).
Reasons: it lowers the same source on jax 0.10.x and 0.11.x (the explicit Triton compiler params
select the Triton backend on both, whatever `jax_pallas_use_mosaic_gpu` says), it handles
tensor-core dots on register tiles of any power-of-two shape (TF32 or IEEE fp32), forward
`cumsum`, and `fori_loop` over dynamically indexed refs, which is all this algorithm needs; and it
needs no warpgroup/barrier bookkeeping. Mosaic GPU (`plgpu.kernel`) gives more control (TMA,
wgmma pipelines) at the price of explicit warpgroup, barrier and shared-memory code.
On jax 0.11.2 every launch emits a DeprecationWarning ("The Pallas Triton backend is deprecated
and will be removed in a future JAX version"); it still compiles and runs.
Migration path if Pallas-Triton is removed from JAX: keep `pallas_gpu/tiles.py` (pure tile algebra, no
backend calls) and port the launches in `pallas_gpu/launches.py` to `plgpu.kernel` with
`plgpu.emit_pipeline` over chunks: the chunk-parallel kernels map to one warpgroup per
(head, chunk) with TMA loads of the [C, K] tiles, the sequential kernels to a loop that
double-buffers M/Q/D/O0 through shared memory. The custom_vjp wiring in `gpu.py` stays.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lwm_jax.hardware import platform_of
from lwm_jax.ops.wkv7.pallas_gpu.op import PRECISIONS, Chains, launch_choices, wkv7_gpu
from lwm_jax.ops.wkv7.pallas_gpu.launches import Tuning

__all__ = ["wkv7_pallas", "wkv7_pallas_pair", "pallas_pair_applies", "wkv7_gpu", "Tuning",
           "PRECISIONS", "mosaic_chains"]

# Where the gradient is taken both Mosaic chains run (faster than the Triton launches at the
# four anchor shapes, 32-512 heads: their forward writes the chunk states the backward needs,
# and the outputs too as `Tuning.chain_outputs` says; benchmarks/RESULTS.md). Forward-only
# calls run the Mosaic forward chain that writes the outputs from this many heads (B * H) on:
# 0.18-1.56 ms against the Triton forward's 0.29-1.69 ms at 32-512 heads (H200, 2026-11-28),
# and with 16 value columns per CTA 8-22% faster than Triton's at 12-24 heads (2026-11-29;
# `benchmarks/wkv7_state_pass.py`); fewer heads are unmeasured.
MOSAIC_PRIMAL_MIN_HEADS = 12


@functools.cache
def _load_mosaic_chains():
    """`(forward_states, backward_states, forward_outputs)` of `mosaic_gpu/state_pass.py`, or
    None where the package does not import (jax < 0.11 or no Mosaic GPU in this jax build)."""
    try:
        from lwm_jax.ops.wkv7.mosaic_gpu.state_pass import (backward_states, forward_outputs,
                                                            forward_states)
    except ImportError:
        return None
    return forward_states, backward_states, forward_outputs


def _is_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"


def mosaic_chains(r, v, chunk_size, output_dtype, precision, tuning, interpret) -> Chains | None:
    """The Mosaic GPU chunk chains for this call, or None for the Triton launches.

    `tuning.chains` "triton" keeps the Triton launches, "mosaic" asks for the Mosaic chains (a
    one-line error where they cannot run), None picks them wherever they apply: a Hopper GPU
    (wgmma, TMA), jax with Mosaic GPU, K = 64 and V a multiple of 64, 32-token chunks (after
    the lowering for short T), TF32 precision ("default" / "high") and a bfloat16 output (the
    backward chain takes the output cotangent as a bf16 operand). With the gradient both
    chains run; forward-only calls as `MOSAIC_PRIMAL_MIN_HEADS` says (`Chains.primal`; with
    "mosaic" always).
    """
    want = (tuning.chains if tuning is not None else None)
    if want not in (None, "triton", "mosaic"):
        raise ValueError(f"Tuning.chains must be None, 'triton' or 'mosaic', got {want!r}")
    if want == "triton" or r.ndim != 4 or not isinstance(chunk_size, int):
        return None  # (malformed inputs get wkv7_gpu's one-line errors)
    B, T, H, K = r.shape
    C, out_dtype, precision = launch_choices(r, v, chunk_size, output_dtype, precision)
    why = None
    if interpret:
        why = "do not run in the Pallas interpreter (CPU)"
    elif _load_mosaic_chains() is None:
        why = f"jax {jax.__version__} has no Pallas Mosaic GPU (needs jax >= 0.11)"
    elif not _is_hopper():
        why = "needs an sm_90 (Hopper) GPU"
    elif K != 64 or v.shape[-1] % 64:
        why = f"needs K = 64 and V a multiple of 64, got K={K}, V={v.shape[-1]}"
    elif C != 32:
        why = f"needs 32-token chunks, got {C}"
    elif precision not in ("default", "high"):
        why = f"needs TF32 precision ('default' / 'high'), got {precision!r}"
    elif out_dtype != jnp.bfloat16:
        why = f"needs a bfloat16 output, got {out_dtype}"
    if why is not None:
        if want == "mosaic":
            raise ValueError(f"Tuning.chains='mosaic': the Mosaic GPU chains {why}; use "
                             "chains=None or 'triton'")
        return None
    return Chains(*_load_mosaic_chains(),
                  primal=want == "mosaic" or B * H >= MOSAIC_PRIMAL_MIN_HEADS)


def _defaults(chunk_size, interpret, platform):
    """`(chunk_size, interpret)` with None filled: chunk 64 on TPU, else 32 (the GPU kernel's
    measured fastest); the interpreter wherever no GPU runs the GPU kernels."""
    on_tpu = platform == "tpu" and not interpret
    if chunk_size is None:
        chunk_size = 64 if on_tpu else 32
    if interpret is None:
        interpret = platform == "cpu"
    return chunk_size, interpret


def wkv7_pallas(r, w, k, v, a, b, initial_state=None, segment_ids=None, chunk_size=None,
                output_dtype=None, *, precision=None, interpret=None, tuning=None,
                platform=None):
    """WKV7 with the Pallas kernel of `platform` (None: JAX's default devices'). Returns `(o, final_state)`.

    Args: as `wkv7_gpu` (see `gpu.py`); `chunk_size` None picks the backend's default (GPU and
    the CPU interpreter: 32, the GPU kernel's measured fastest; TPU: 64, as before).
    `precision` ("default" | "high" | "highest" | "tf32x3" | None) is passed to the backend kernel (None: the
    backend's default; on GPU "highest" for float32 inputs, else TF32). `interpret`: None
    picks the interpreter on CPU only. `tuning` applies to the GPU.
    """
    platform = platform or platform_of()
    chunk_size, interpret = _defaults(chunk_size, interpret, platform)
    if platform == "tpu" and not interpret:
        from lwm_jax.ops.wkv7.pallas_tpu.op import wkv7_tpu  # imported lazily: Mosaic TPU only
        extra = {} if precision is None else {"precision": precision}
        return wkv7_tpu(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype,
                        **extra)
    chains = mosaic_chains(r, v, chunk_size, output_dtype, precision, tuning, interpret)
    return wkv7_gpu(r, w, k, v, a, b, initial_state, segment_ids, chunk_size, output_dtype,
                    precision=precision, interpret=interpret, tuning=tuning, chains=chains)


def pallas_pair_applies(value_width: int, interpret: bool | None = None,
                        platform: str | None = None) -> bool:
    """Whether `wkv7_pallas_pair` runs on `platform` (None: JAX's default devices'): the GPU
    kernels (or their interpreter off TPU) with value width <= 64. On TPU sequence parallelism
    runs its two passes as two calls."""
    from lwm_jax.ops.wkv7.pallas_gpu.op import MAX_V
    on_tpu = (platform or platform_of()) == "tpu" and not interpret
    return not on_tpu and value_width <= MAX_V


def wkv7_pallas_pair(r, w, k, v, a, b, initial_state, identity_state, segment_ids=None,
                     chunk_size=None, output_dtype=None, *, precision=None, interpret=None,
                     tuning=None, platform=None):
    """Sequence parallelism's value and identity passes sharing one set of chunk factors
    (`pallas_gpu/pair.py`): `(o, final_state, q, M_end)`. Only where `pallas_pair_applies`."""
    from lwm_jax.ops.wkv7.pallas_gpu.pair import wkv7_gpu_pair
    platform = platform or platform_of()
    if not pallas_pair_applies(v.shape[-1], interpret, platform):
        raise ValueError("wkv7_pallas_pair: needs the GPU kernels (not TPU) and V <= 64")
    chunk_size, interpret = _defaults(chunk_size, interpret, platform)
    return wkv7_gpu_pair(r, w, k, v, a, b, initial_state, identity_state, segment_ids,
                         chunk_size, output_dtype, precision=precision, interpret=interpret,
                         tuning=tuning)
