"""Shared test helpers for WKV7: RWKV-7-like random inputs, float64 reference with gradients.

Used by the op tests and by the Pallas kernel tests, so every implementation is measured on the
same input distribution (the FLA benchmark's, `shared/bench/fla_wkv7.py`).
"""
from __future__ import annotations

import math

import numpy as np
import jax
import jax.numpy as jnp

from lwm_jax.ops.wkv7.recurrent import recurrent_scan

LOG_DECAY_LOWER = -math.exp(-0.5)  # RWKV-7's log-decay lower bound, -0.6065...
WKV7_ARG_NAMES = ("r", "w", "k", "v", "a", "b")


def random_wkv7_inputs(key_or_seed, B, T, H, K, V, dtype=jnp.float32):
    """RWKV-7-like random WKV7 inputs `(r, w, k, v, a, b)`, all in `dtype`.

    Distribution (per element, drawn in float32 then cast): r ~ N(0,1), k ~ 0.5 N(0,1),
    v ~ N(0,1), w = -e^{-1/2} sigmoid(2 N(0,1) - 1), kk = l2-normalise(N(0,1)) over the last axis,
    a_icl = sigmoid(N(0,1)), a = -kk, b = kk * a_icl.
    Shapes: r, w, k, a, b `[B, T, H, K]`, v `[B, T, H, V]`.
    """
    key = (jax.random.PRNGKey(key_or_seed) if isinstance(key_or_seed, int) else key_or_seed)
    kr, kw, kk_, kv, kkk, ka = jax.random.split(key, 6)
    shape = (B, T, H, K)
    normal = lambda kx, s=shape: jax.random.normal(kx, s, jnp.float32)
    r = normal(kr)
    k = 0.5 * normal(kk_)
    v = normal(kv, (B, T, H, V))
    w = LOG_DECAY_LOWER * jax.nn.sigmoid(2.0 * normal(kw) - 1.0)
    kk = normal(kkk)
    kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
    a_icl = jax.nn.sigmoid(normal(ka))
    return tuple(x.astype(dtype) for x in (r, w, k, v, -kk, kk * a_icl))


def rel_err(x, ref) -> float:
    """`||x - ref|| / ||ref||` in float64 (Frobenius norm over all elements)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def wkv7_reference_vjp_f64(inputs, initial_state, segment_ids, d_out, d_state):
    """Float64 WKV7 outputs and gradients (recurrent JAX form run under `jax.enable_x64`).

    Runs on the CPU whatever accelerator holds the inputs: IEEE float64 there, while a GPU's
    float64 units are few and a token scan of small float64 steps there takes minutes.

    Args:
      inputs: `(r, w, k, v, a, b)` arrays (any float dtype; values are converted exactly to f64).
      initial_state: `[B, H, K, V]` or None.
      segment_ids: int `[B, T]` or None.
      d_out: cotangent of `o` `[B, T, H, V]`; d_state: cotangent of the final state `[B, H, K, V]`.

    Returns:
      `(o, final_state, grads)` as float64 NumPy arrays; `grads` maps "r", "w", "k", "v", "a",
      "b" (and "initial_state" when given) to the gradient of `<o, d_out> + <S_T, d_state>`.
    """
    f64 = lambda x: np.asarray(x, dtype=np.float64)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        xs = tuple(jnp.asarray(f64(x)) for x in inputs)
        s0 = None if initial_state is None else jnp.asarray(f64(initial_state))
        seg = None if segment_ids is None else jnp.asarray(np.asarray(segment_ids))

        def run(xs, s0):
            return recurrent_scan(*xs, s0, seg, compute_dtype=jnp.float64)

        (o, s_T), vjp = jax.vjp(run, xs, s0)
        d_xs, d_s0 = vjp((jnp.asarray(f64(d_out)), jnp.asarray(f64(d_state))))
        grads = {name: np.asarray(g) for name, g in zip(WKV7_ARG_NAMES, d_xs)}
        if initial_state is not None:
            grads["initial_state"] = np.asarray(d_s0)
        return np.asarray(o), np.asarray(s_T), grads


def random_segment_ids(seed: int, B: int, T: int, max_docs: int = 4) -> np.ndarray:
    """int32 `[B, T]` packed-document ids: each row cut at up to `max_docs - 1` random positions.

    Row 0 always gets a document of length 1 at position 1 when T >= 3 (a reset right after the
    start and again one token later), so short edge cases are covered.
    """
    rng = np.random.default_rng(seed)
    ids = np.zeros((B, T), dtype=np.int32)
    for row in range(B):
        n_cuts = min(max_docs - 1, T - 1)
        cuts = np.sort(rng.choice(np.arange(1, T), size=n_cuts, replace=False)) if n_cuts else []
        if row == 0 and T >= 3:
            cuts = np.union1d(cuts, [1, 2])
        for c in cuts:
            ids[row, c:] += 1
    return ids


def chunk_chains_f64(M, D, Q, do, s0, dsT, H: int):
    """The GPU kernel's chunk chains in float64 (NumPy) from its float32 maps: the start state
    of every chunk (`S <- M S + D` from s0) and the cotangent of every chunk's end state
    (`dS <- M^T dS + Q^T dO` from dsT, in reverse).

    M [BH, NT, K, K], D [BH, NT, K, V], Q [BH, NT, C, K]; do [B, NT * C, H, V]; s0, dsT
    [B, H, K, V]. Returns `(states, dS_end)`, each [BH, NT, K, V], and the final state and
    d(initial state) [BH, K, V]: `(states, S_T, dS_end, dS_0)`."""
    M, D, Q = (np.asarray(x, np.float64) for x in (M, D, Q))
    BH, NT, C = Q.shape[:3]
    B, V = BH // H, D.shape[-1]
    dO = np.asarray(np.asarray(do, np.float32), np.float64)
    dO = dO.reshape(B, NT, C, H, V).transpose(0, 3, 1, 2, 4).reshape(BH, NT, C, V)
    S = np.asarray(np.asarray(s0, np.float32), np.float64).reshape(BH, -1, V)
    states = np.empty_like(D)
    for c in range(NT):
        states[:, c] = S
        S = M[:, c] @ S + D[:, c]
    g = np.asarray(np.asarray(dsT, np.float32), np.float64).reshape(BH, -1, V)
    dS = np.empty_like(D)
    for c in range(NT - 1, -1, -1):
        dS[:, c] = g
        g = M[:, c].transpose(0, 2, 1) @ g + Q[:, c].transpose(0, 2, 1) @ dO[:, c]
    return states, S, dS, g


def lowered_triton_kernels(fn, *args) -> list[dict]:
    """Each Pallas-Triton kernel of `jax.jit(fn)(*args)` as JAX lowers it for CUDA, on any host
    (jaxlib <= 0.10.2 lowers Pallas-Triton calls without compiling them; `args` may be
    `jax.ShapeDtypeStruct`s): `[{"name", "num_warps", "num_stages", "ttir"}]` in lowering order.
    Hooks JAX's private Pallas-Triton lowering for the duration of the call (ImportError or
    AttributeError where it has moved)."""
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as reg
    orig_lower, orig_call = reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call
    kernels: list[dict] = []

    def lower(*a, **k):
        res = orig_lower(*a, **k)
        kernels.append({"ttir": res.module.operation.get_asm(enable_debug_info=False)})
        return res

    def custom_call(*a, backend_config=None, **k):
        if backend_config and "num_warps" in backend_config:   # the last lowered kernel's
            kernels[-1].update({f: str(backend_config[f]).split(":")[0].strip(' "')
                                for f in ("name", "num_warps", "num_stages")})
        return orig_call(*a, backend_config=backend_config, **k)

    triton = "__gpu$xla.gpu.triton"
    reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = lower, custom_call
    try:
        export.export(jax.jit(fn), platforms=("cuda",),
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(*args)
    finally:
        reg.lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = orig_lower, orig_call
    return kernels
