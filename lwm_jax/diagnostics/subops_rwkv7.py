"""RWKV-7 sub-ops for the precision report: decay, WKV output and state, `ln_x` GroupNorm,
ChannelMix (FFN), logits, loss.

Formulas follow the model (`lwm_jax.models.rwkv7`, "x070") in float64 NumPy; each op starts
from a value the policy run tapped, so its local error is its own:

| op        | policy value (tap)       | its input (tap)                      | policy storage      |
|-----------|--------------------------|--------------------------------------|---------------------|
| decay     | `att/w`                  | layer input (`ln0` / previous `x_out`) via ln1 + mix | x_w compute dtype, w float32 |
| wkv       | `att/wkv_out`            | `att/{r,w,k,v,a_in,b_in}`            | output compute dtype |
| wkv_state | `att/wkv_state`          | same                                 | float32             |
| ln_x      | `att/ln_x`               | `att/wkv_out`                        | output compute dtype |
| ffn       | `ffn/out`                | `x_att` via ln2 + mix                | k, k W, relu², out in compute dtype |
| logits    | `logits`                 | last `x_out`                         | output dtype        |

Under an FP8 policy the table is `FP8_SUBOPS`: the same ops (the FFN's floor with e4m3 GEMM
operands) plus one per FP8 GEMM site (`att_r`, `att_k`, `att_v`, `att_o`, `ffn_k`, `ffn_v`;
`FP8_GEMMS` maps each meta site to its op), each on its input as the policy formed it.

The report runs each sequence from a fresh state (token shift and WKV state zero at t = 0).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lwm_jax.diagnostics.subops import (F32, LOSS, STRICT_ROUNDING, Context, Family, Local,
                                        SubOp, group_norm64, layer_norm64, logits_from,
                                        projection_or_vector_std, shift64, sigmoid64, storage)
from lwm_jax.ops.wkv7.chunk_math import RoundedOperands
from lwm_jax.ops.wkv7.chunked import wkv7_chunked
from lwm_jax.ops.wkv7.reference import wkv7_reference_np

DECAY_SCALE = math.exp(-0.5)      # w = -exp(-0.5) * sigmoid(d), RWKV-7's log-decay range
KERNEL_CHUNK = {"gpu": 32, "tpu": 64}   # the Pallas kernels' default chunk lengths


def _layer(ctx: Context, group: str, layer: int) -> dict:
    return {k: v[layer] for k, v in ctx.params["blocks"][group].items() if k != "ln_x"}


def _layer_input(ctx: Context, layer: int):
    """Residual stream entering `layer` in the policy run, `[B, T, C]`."""
    return ctx.tap("ln0" if layer == 0 else f"layer{layer - 1}/x_out")


def _mixed(ctx: Context, x_BTC, norm: str, mix, layer: int):
    """`ln(x) + (shift(ln(x)) - ln(x)) * mix`: a mixer's token-shifted input, float64."""
    ln = _layer(ctx, norm, layer)
    xn = layer_norm64(x_BTC, ln["weight"], ln["bias"])
    return xn + (shift64(xn) - xn) * mix


def decay_local(ctx: Context, layer: int) -> Local:
    """`w = -exp(-0.5) sigmoid(w0 + tanh(x_w w1) w2)`; floor: x_w stored in the compute dtype
    (as TimeMix has it), everything after in float32 (the decay island, whose LoRA products
    are IEEE float32 under every policy)."""
    p = _layer(ctx, "att", layer)
    x_w = _mixed(ctx, _layer_input(ctx, layer), "ln1", p["x_w"], layer)

    def w_of(x, prod):
        hidden = np.tanh(prod(x) @ prod(p["w1"]))
        return -DECAY_SCALE * sigmoid64(p["w0"] + prod(hidden) @ prod(p["w2"]))
    ref = w_of(x_w, lambda a: a)
    floor = storage(w_of(storage(x_w, ctx.compute_dtype), lambda a: a), F32)
    value = ctx.tap(f"layer{layer}/att/w").reshape(ref.shape)
    return Local(value, ref, floor)


def _wkv_reference(ctx: Context, layer: int, products: bool = False):
    """`(o, state)` of WKV7 on the run's r, w, k, v, a, b: the float64 recurrence; with
    `products=True` and a backend whose kernel products round their operands (TF32 on GPU,
    bf16 passes on TPU: `Context.product_bits`), the chunked form (`wkv7_chunked`, the kernels'
    algebra at their chunk length) with every product's operands rounded so, float32 elsewhere:
    a model of the kernel's own roundings (its in-chunk operands are decayed keys and chunk
    matrices, not only the inputs)."""
    bits = ctx.product_bits("wkv") if products else None
    key = ("wkv", layer, bits)
    if key not in ctx.memo:
        inputs = [ctx.tap(f"layer{layer}/att/{n}") for n in ("r", "w", "k", "v", "a_in", "b_in")]
        if bits is None:
            ctx.memo[key] = wkv7_reference_np(*inputs)
        else:
            o, state = wkv7_chunked(*(jnp.asarray(x, jnp.float32) for x in inputs), None, None,
                                    chunk_size=KERNEL_CHUNK.get(ctx.platform, 64),
                                    output_dtype=jnp.float32, precision=RoundedOperands(bits))
            ctx.memo[key] = (np.asarray(o, np.float64), np.asarray(state, np.float64))
    return ctx.memo[key]


def wkv_local(ctx: Context, layer: int) -> Local:
    """The WKV7 recurrence on the run's own r, w, k, v, a, b; floor: output stored in the
    compute dtype (TimeMix asks `wkv7` for `output_dtype=compute`), products as the kernel's."""
    o, _ = _wkv_reference(ctx, layer)
    o_floor, _ = _wkv_reference(ctx, layer, products=True)
    return Local(ctx.tap(f"layer{layer}/att/wkv_out"), o, storage(o_floor, ctx.compute_dtype))


def wkv_state_local(ctx: Context, layer: int) -> Local:
    """The final WKV state (float32 always: the state island), products as the kernel's."""
    _, state = _wkv_reference(ctx, layer)
    _, state_floor = _wkv_reference(ctx, layer, products=True)
    return Local(ctx.tap(f"layer{layer}/att/wkv_state"), state, storage(state_floor, F32))


def ln_x_local(ctx: Context, layer: int) -> Local:
    """Per-head GroupNorm of the run's WKV output (eps = N * 1e-5)."""
    o = ctx.tap(f"layer{layer}/att/wkv_out")
    B, T, H, N = o.shape
    ln = ctx.params["blocks"]["att"]["ln_x"]
    ref = group_norm64(o.reshape(B, T, H * N), ln["weight"][layer], ln["bias"][layer], H,
                       N * 1e-5)
    return Local(ctx.tap(f"layer{layer}/att/ln_x"), ref, storage(ref, ctx.compute_dtype))


def ffn_local(ctx: Context, layer: int) -> Local:
    """ChannelMix `relu(k W_key)² W_value` from the run's `x_att`; floor: k, k W_key, the
    squares and the output stored in the compute dtype, products at the matmul precision
    (under an FP8 policy both GEMMs' operands in e4m3: `Context.gemm_operand`)."""
    p = _layer(ctx, "ffn", layer)
    cd, gemm = ctx.compute_dtype, ctx.gemm_operand
    k = _mixed(ctx, ctx.tap(f"layer{layer}/x_att"), "ln2", p["x_k"], layer)
    ref = np.square(np.maximum(k @ p["key"], 0.0)) @ p["value"]
    pre = storage(gemm(storage(k, cd)) @ gemm(p["key"]), cd)
    floor = storage(gemm(storage(np.square(np.maximum(pre, 0.0)), cd)) @ gemm(p["value"]), cd)
    return Local(ctx.tap(f"layer{layer}/ffn/out"), ref, floor)


def logits_local(ctx: Context, layer) -> Local:
    """Final LayerNorm + head on the run's last residual stream; floor: the head's product at
    the matmul precision, output dtype storage."""
    del layer
    x = ctx.tap(f"layer{ctx.cfg.n_layer - 1}/x_out")
    ln = ctx.params["ln_out"]
    return logits_from(ctx, layer_norm64(x, ln["weight"], ln["bias"]), ctx.params["head"])


SUBOPS = (
    SubOp("decay", "layer", "att/w", decay_local,
          "TimeMix log-decay w = -e^-0.5 sigmoid(w0 + tanh(x_w w1) w2)",
          "the decay is computed below float32: keep the decay fp32 island "
          "(lwm_jax.models.rwkv7.time_mix.decay_log: LoRA through Policy.einsum_f32, w0 and "
          "the sigmoid in float32)"),
    SubOp("wkv", "layer", "att/wkv_out", wkv_local,
          "WKV7 output o_t = S_t^T r_t",
          "the WKV kernel loses precision beyond its output rounding: run its in-chunk "
          "products at w=highest (e.g. precision=p=f32,c=bf16,w=highest) or use a smaller "
          "runtime.chunk_size"),
    SubOp("wkv_state", "layer", "att/wkv_state", wkv_state_local,
          "WKV7 final state S_T (float32)",
          "the WKV state is held below float32: keep the state island (wkv7 state and "
          "initial_state are float32 under every policy)"),
    SubOp("ln_x", "layer", "att/ln_x", ln_x_local,
          "TimeMix per-head GroupNorm of the WKV output",
          "GroupNorm statistics below float32: keep the norm island "
          "(lwm_jax.ops.group_norm: float32 mean and variance)"),
    SubOp("ffn", "layer", "ffn/out", ffn_local,
          "ChannelMix relu(k W_key)^2 W_value",
          "ChannelMix loses more than its storage rounding: under float16 keep the "
          "power-of-two scaled squares (or use bf16-mixed, whose range holds them); otherwise "
          "check its matmul precision (m=highest)"),
    SubOp("logits", "post", "logits", logits_local,
          "final LayerNorm + head (float32 logits island)",
          "logits computed below float32: keep the logits island (head_fn: float32 "
          "LayerNorm and Policy.einsum_f32; output dtype o=f32)"),
    LOSS,
)


# ---------------------------------------------------------------- FP8 GEMMs (fp8-mixed)
# One sub-op per FP8 GEMM site, measured on its input as the policy formed it: the token-shift
# mixes, gates and bonus are re-formed in float64 with every value the policy stores in the
# compute dtype rounded there (`_in_cd`), so the local error is the GEMM's own (plus the output
# rounding and, for key / value, the elementwise step after it). Floor: operands in e4m3 at
# their ideal scale (`Context.gemm_operand`), product stored in the compute dtype.


def _in_cd(ctx: Context):
    return lambda x: storage(x, ctx.compute_dtype)


def _policy_mixes(ctx: Context, x_BTC, norm: str, mixes, layer: int) -> list:
    """`x + (shift(x) - x) * mu` per mu as `token_shift_mixes` forms them: `x = ln(x_BTC)`
    stored in the compute dtype, the difference, the product (mu in the compute dtype) and the
    sum each rounded there. float64 `[B, T, C]` arrays."""
    cd = _in_cd(ctx)
    ln = _layer(ctx, norm, layer)
    xn = cd(layer_norm64(x_BTC, ln["weight"], ln["bias"]))
    xx = cd(shift64(xn) - xn)
    return [cd(xn + cd(xx * cd(mu))) for mu in mixes]


def _policy_sigmoid(ctx: Context, z):
    """`sigmoid(z)` of a compute-dtype `z` as the policy's program computes it, float64: XLA
    computes the logistic op in steps that each round to a 16-bit dtype on some backends
    (XLA:CPU: `exp`, `1 +`, `1 /`), so a float64 sigmoid rounded once would differ from the
    run's gate in ~1 entry of 5."""
    return np.asarray(_SIGMOID(jnp.asarray(z, ctx.compute_dtype)), np.float64)


_SIGMOID = jax.jit(jax.nn.sigmoid, compiler_options=STRICT_ROUNDING)


def _gemm(ctx: Context, x, w):
    """(`x @ w` in float64, its floor: operands as `Context.gemm_operand`, product stored in
    the compute dtype)."""
    return x @ w, storage(ctx.gemm_operand(x) @ ctx.gemm_operand(w), ctx.compute_dtype)


def _att_inputs(ctx: Context, layer: int) -> dict:
    key = ("att_gemm_inputs", layer)
    if key not in ctx.memo:
        p = _layer(ctx, "att", layer)
        xr, xk, xv = _policy_mixes(ctx, _layer_input(ctx, layer), "ln1",
                                   (p["x_r"], p["x_k"], p["x_v"]), layer)
        ctx.memo[key] = {"r": xr, "k": xk, "v": xv}
    return ctx.memo[key]


def _flat(x):
    return x.reshape(*x.shape[:2], -1)


def att_r_local(ctx: Context, layer: int) -> Local:
    """TimeMix receptance `r = x_r W_r` (tap `att/r`)."""
    ref, floor = _gemm(ctx, _att_inputs(ctx, layer)["r"], _layer(ctx, "att", layer)["receptance"])
    return Local(_flat(ctx.tap(f"layer{layer}/att/r")), ref, floor)


def att_k_local(ctx: Context, layer: int) -> Local:
    """TimeMix key `k = (x_k W_k) (1 + (a - 1) k_a)` (tap `att/k`, after the in-context rate's
    factor, which the policy forms from the tapped `a` in the compute dtype)."""
    cd, p = _in_cd(ctx), _layer(ctx, "att", layer)
    factor = cd(1.0 + cd(cd(ctx.tap(f"layer{layer}/att/a") - 1.0) * cd(p["k_a"])))
    ref, floor = _gemm(ctx, _att_inputs(ctx, layer)["k"], p["key"])
    return Local(_flat(ctx.tap(f"layer{layer}/att/k")), ref * factor, cd(floor * factor))


def att_v_local(ctx: Context, layer: int) -> Local:
    """TimeMix value `v = x_v W_v`, past layer 0 mixed with layer 0's value by the value gate
    `sigmoid(v0 + (x_v v1) v2)` (tap `att/v`; the gate formed as the policy does, layer 0's
    value its tap)."""
    cd, p = _in_cd(ctx), _layer(ctx, "att", layer)
    xv = _att_inputs(ctx, layer)["v"]
    ref, floor = _gemm(ctx, xv, p["value"])
    if layer > 0:
        lora = cd(cd(xv @ cd(p["v1"])) @ cd(p["v2"]))
        gate = _policy_sigmoid(ctx, cd(lora + cd(p["v0"])))
        first = _flat(ctx.tap("layer0/att/v"))
        ref = ref + (first - ref) * gate
        floor = cd(floor + cd(cd(first - floor) * gate))
    return Local(_flat(ctx.tap(f"layer{layer}/att/v")), ref, floor)


def att_o_local(ctx: Context, layer: int) -> Local:
    """TimeMix output projection `(y g) W_o`, `y = ln_x + (sum(r k r_k) v)` per head, formed
    from the run's taps as the policy forms it (tap `att/out`)."""
    cd, p, t = _in_cd(ctx), _layer(ctx, "att", layer), f"layer{layer}/att/"
    r, k, v = (ctx.tap(t + n) for n in ("r", "k", "v"))
    bonus = cd(np.sum(cd(cd(r * k) * cd(p["r_k"])), axis=-1, keepdims=True))
    y = cd(ctx.tap(t + "ln_x") + _flat(cd(bonus * v)))
    ref, floor = _gemm(ctx, cd(y * ctx.tap(t + "g")), p["output"])
    return Local(ctx.tap(t + "out"), ref, floor)


def _ffn_key_input(ctx: Context, layer: int):
    p = _layer(ctx, "ffn", layer)
    return _policy_mixes(ctx, ctx.tap(f"layer{layer}/x_att"), "ln2", (p["x_k"],), layer)[0]


def ffn_k_local(ctx: Context, layer: int) -> Local:
    """ChannelMix key GEMM through the squared ReLU, `relu(k W_key)²` (tap `ffn/hidden`)."""
    ref, floor = _gemm(ctx, _ffn_key_input(ctx, layer), _layer(ctx, "ffn", layer)["key"])
    sq = lambda x: np.square(np.maximum(x, 0.0))  # noqa: E731
    return Local(ctx.tap(f"layer{layer}/ffn/hidden"), sq(ref), storage(sq(floor),
                                                                       ctx.compute_dtype))


def ffn_v_local(ctx: Context, layer: int) -> Local:
    """ChannelMix value GEMM on the run's hidden layer (tap `ffn/hidden` -> `ffn/out`)."""
    ref, floor = _gemm(ctx, ctx.tap(f"layer{layer}/ffn/hidden"),
                       _layer(ctx, "ffn", layer)["value"])
    return Local(ctx.tap(f"layer{layer}/ffn/out"), ref, floor)


FP8_FIX = ("this FP8 GEMM loses more than e4m3 rounding at a working scale: its delayed scale "
           "is stale or lost (values clipped at 448 x scale or flushed below 2^-9 x scale); "
           "read its scale / amax trajectory (the report's fp8 section), calibrate longer "
           "(--fp8-calibration-steps) or keep this GEMM in bf16")
FP8_GEMM_SUBOPS = {
    "att_r": SubOp("att_r", "layer", "att/r", att_r_local,
                   "TimeMix receptance GEMM x_r W_r (FP8)", FP8_FIX),
    "att_k": SubOp("att_k", "layer", "att/k", att_k_local,
                   "TimeMix key GEMM x_k W_k (FP8), times (1 + (a - 1) k_a)", FP8_FIX),
    "att_v": SubOp("att_v", "layer", "att/v", att_v_local,
                   "TimeMix value GEMM x_v W_v (FP8), value-residual gate after layer 0",
                   FP8_FIX),
    "att_o": SubOp("att_o", "layer", "att/out", att_o_local,
                   "TimeMix output GEMM (y g) W_o (FP8)", FP8_FIX),
    "ffn_k": SubOp("ffn_k", "layer", "ffn/hidden", ffn_k_local,
                   "ChannelMix key GEMM relu(k W_key)^2 (FP8)", FP8_FIX),
    "ffn_v": SubOp("ffn_v", "layer", "ffn/out", ffn_v_local,
                   "ChannelMix value GEMM hidden W_value (FP8)", FP8_FIX),
}
FP8_GEMMS = (("att/receptance", "att_r"), ("att/key", "att_k"), ("att/value", "att_v"),
             ("att/output", "att_o"), ("ffn/key", "ffn_k"), ("ffn/value", "ffn_v"))
_BY_NAME = {op.name: op for op in SUBOPS} | FP8_GEMM_SUBOPS
FP8_SUBOPS = tuple(_BY_NAME[n] for n in (
    "att_r", "att_k", "att_v", "decay", "wkv", "wkv_state", "ln_x", "att_o", "ffn_k", "ffn_v",
    "ffn", "logits", "loss"))


def grad_group(path: tuple[str, ...]) -> str:
    """Parameter group of a gradient leaf (per layer under `blocks`)."""
    if path[0] != "blocks":
        return {"emb": "emb", "ln0": "ln0", "ln_out": "head", "head": "head"}.get(path[0],
                                                                               path[0])
    group, leaf = path[1], path[2]
    if group == "att":
        if leaf in ("w0", "w1", "w2"):
            return "decay"
        if leaf == "ln_x":
            return "ln_x"
        if leaf in ("receptance", "key", "value", "output"):
            return "att_proj"
        return "att_other"
    return {"ffn": "ffn", "ln1": "norms", "ln2": "norms"}.get(group, group)


# `[..., in, out]` matrices applied as `x @ W` (att.output, ffn.value and the LoRA down
# projections w1/a1/v1/g1 are zero at the official init).
PROJECTIONS = frozenset({"receptance", "key", "value", "output", "head",
                         "w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"})
EMB_TINY_RMS = 1e-3     # below ln0's sqrt(eps) ~ 3e-3: the official U(+-1e-4) embedding
EMB_WARM_STD = 1.0      # ln0 normalises the embedding, so any scale well above sqrt(eps) works


def warm_std(path: tuple[str, ...], x) -> float | None:
    """`Family.warm_std` for RWKV-7: `projection_or_vector_std` (zero projections, constant
    norm weights/biases, `r_k`, `k_a`, per-layer `ln_x` weights), and the embedding when its
    RMS is below `EMB_TINY_RMS` (ln0 then normalises values comparable to its eps, a regime
    training leaves within its first steps)."""
    if path == ("emb",):
        rms = float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))
        return EMB_WARM_STD if rms < EMB_TINY_RMS else None
    return projection_or_vector_std(path, x, PROJECTIONS)


FAMILY = Family("rwkv7", SUBOPS, grad_group, warm_std, FP8_SUBOPS, FP8_GEMMS,
                fp8_spans=("ffn",))
