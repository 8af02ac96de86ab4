"""Sub-operations of a model, as the precision report measures them: what each one is, where
its output is tapped, and its float64 reference.

A sub-op's *local* error is measured on the policy run's own inputs: the float64 reference
`ref` is the op's formula evaluated in float64 on exactly the values the policy run fed it, so
errors made upstream do not count against it. Its *floor* is the same formula in float64 with
only the roundings the policy asks for (the op's inputs and outputs stored in their dtypes,
exact arithmetic in between, and the operands of its products rounded as the backend multiplies
float32 at the policy's matmul precision: TF32 on GPU, bf16 passes on TPU, see
`PRODUCT_MANTISSA_BITS`): the best any implementation of that policy can do. A local error
far above the floor means the op computes less precisely than the policy promises (a lost fp32
island, a low-precision product); one at the floor is the price of the policy itself. Under an
FP8 policy the block GEMMs' operands round to float8 e4m3 at their ideal per-tensor scale
(`e4m3_operand`, `Context.gemm_operand`): the floor of delayed scaling that works.

Family tables (`subops_rwkv7`, `subops_llama`) are data plus NumPy formulas written from the
papers' math; this package imports no model code (models import the probe from here).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import jax.numpy as jnp


@dataclasses.dataclass
class Context:
    """Everything a sub-op's local measurement reads.

    taps: the policy run's tapped values by probe name (`layer0/att/w`, `logits`, ...).
    params: the policy run's parameters (stored in its param dtype), nested dict of float64.
    cfg: the model's resolved config (family-specific dataclass).
    policy: the `lwm_jax.precision.Policy` under test.
    inputs_BT, targets_BT: int tokens the model saw and the next tokens.
    loss_BT: the per-token cross-entropy the policy run computed (float32 values).
    memo: cache shared by sub-ops of one report (e.g. one WKV reference per layer).
    platform: the JAX backend the policy ran on (`cpu`, `gpu`, `tpu`): how its float32
      products round (`product`).
    """

    taps: dict[str, np.ndarray]
    params: dict
    cfg: Any
    policy: Any
    inputs_BT: np.ndarray
    targets_BT: np.ndarray
    loss_BT: np.ndarray
    memo: dict = dataclasses.field(default_factory=dict)
    platform: str = "cpu"

    def product_bits(self, which: str = "matmul") -> int | None:
        """Explicit mantissa bits of this backend's float32 product operands at the policy's
        `matmul` (or `wkv`) precision; None where products are IEEE float32 (CPU, `highest`,
        `tf32x3`)."""
        precision = self.policy.wkv_precision if which == "wkv" else self.policy.matmul_precision
        return PRODUCT_MANTISSA_BITS.get((self.platform, precision))

    def product(self, x, which: str = "matmul") -> np.ndarray:
        """`x` as a product operand of this run, float64: rounded to `product_bits(which)`
        (unchanged where products are IEEE float32). 16-bit operands pass exactly."""
        bits = self.product_bits(which)
        x = np.asarray(x, np.float64)
        return x if bits is None else round_mantissa(x, bits)

    def gemm_operand(self, x) -> np.ndarray:
        """`x` as an operand of a block GEMM (a projection that owns an FP8 meta under an FP8
        policy), float64: rounded to e4m3 at its own per-tensor scale under an FP8 policy
        (`e4m3_operand`: the FP8 floor), else as any product operand (`product`)."""
        return e4m3_operand(x) if getattr(self.policy, "fp8", False) else self.product(x)

    def tap(self, name: str) -> np.ndarray:
        """A tapped value as float64 (ValueError naming the tap when the model has none)."""
        if name not in self.taps:
            raise ValueError(f"precision report: the model recorded no probe tap {name!r}; "
                             f"taps seen: {', '.join(list(self.taps)[:8])}, ...")
        return np.asarray(self.taps[name], np.float64)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.policy.compute_dtype)

    @property
    def output_dtype(self):
        return jnp.dtype(self.policy.output_dtype)


@dataclasses.dataclass(frozen=True)
class Local:
    """One local measurement: the policy's value, the float64 reference on the same inputs and
    the float64 floor (policy's storage roundings only); float64 arrays of one shape."""

    value: np.ndarray
    ref: np.ndarray
    floor: np.ndarray


@dataclasses.dataclass(frozen=True)
class SubOp:
    """A sub-operation of a model family.

    name: short label (`decay`, `wkv`, ...), a column of the heat map.
    stage: "pre" (before the layers), "layer" (once per layer) or "post" (after the layers).
    tap: probe name of its output, relative to `layer{l}/` for per-layer ops; None for an op
      measured in isolation (its end-to-end error against the shadow is then not available).
    local: `(ctx, layer or None) -> Local`.
    meaning: what it computes, one line.
    fix: what restores precision when the op's local error is far above its floor.
    """

    name: str
    stage: str
    tap: str | None
    local: Callable[[Context, int | None], Local]
    meaning: str
    fix: str


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's sub-ops and gradient groups.

    grad_group: `(path tuple of the parameter) -> group name`; parameters under `blocks` have a
    leading layer axis and are grouped per layer.
    warm_std: `(path tuple, float64 value) -> std or None`: the standard deviation of the
      Gaussian noise `lwm_jax.diagnostics.warm` adds to a parameter whose initial value is
      degenerate (a zero-initialised projection, a constant norm weight, ...), None to keep it.
    fp8_subops: the sub-op table under an FP8 policy (every sub-op in execution order: the
      regular ones, whose block-GEMM floors then take e4m3 operands, plus one per FP8 GEMM
      site); empty where the family's FP8 GEMMs are not modelled (the report refuses them).
    fp8_gemms: `(site, sub-op name)` pairs: the FP8 GEMM site (its meta's path without
      `blocks/` and `fp8_`, e.g. `att/receptance`) whose output the sub-op measures alone.
    fp8_spans: regular sub-ops whose error under an FP8 policy is mostly their FP8 GEMMs'
      e4m3 rounding (LLaMA's `attention` and `mlp`): when one is the largest local error the
      report's advice names the FP8 policy's price, as for a GEMM row.
    """

    name: str
    subops: tuple[SubOp, ...]
    grad_group: Callable[[tuple[str, ...]], str]
    warm_std: Callable[[tuple[str, ...], np.ndarray], float | None]
    fp8_subops: tuple[SubOp, ...] = ()
    fp8_gemms: tuple[tuple[str, str], ...] = ()
    fp8_spans: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- helpers
F32 = jnp.dtype(jnp.float32)
# Every value rounded to its dtype: XLA's default lets a fusion keep a 16-bit intermediate in
# float32 ("excess precision"), so a downstream op would not see the value the probe recorded
# (measured: the logits of a bf16-mixed RWKV-7 then differ from the head applied to the tapped
# residual by 1.7e-3, the bf16 rounding). The report measures the policy as written.
STRICT_ROUNDING = {"xla_allow_excess_precision": False}
WARM_VECTOR_STD = 0.1      # noise of a warmed vector (norm weight / bias, per-head constants)


def constant_rows(x) -> bool:
    """True when every row (last axis) of `x` holds one value: zeros, ones, a per-layer constant
    (a stacked `[L, C]` vector), a zero `[L, in, out]` projection. Such a parameter keeps an
    op's output at a special value (a zero projection makes its product exactly 0, in every
    precision) until training moves it."""
    x = np.asarray(x)
    return x.ndim > 0 and x.size > 0 and bool(np.all(x == x[..., :1]))


def projection_or_vector_std(path: tuple[str, ...], x, projections: frozenset) -> float | None:
    """`Family.warm_std` of a parameter with `constant_rows`, else None: a projection (leaf
    name in `projections`, `[..., in, out]` applied as `x @ W`) gets `1 / sqrt(in)` (unit-scale
    outputs for unit-scale inputs), anything else `WARM_VECTOR_STD` around its constant."""
    if not constant_rows(x):
        return None
    if path[-1] in projections and np.ndim(x) >= 2:
        return 1.0 / float(np.sqrt(np.shape(x)[-2]))
    return WARM_VECTOR_STD


# Explicit mantissa bits of a float32 product's operands by (backend, precision name), where the
# backend shortens them: NVIDIA tensor cores' TF32 (10 bits; XLA's `default` and `high` for
# float32 dots and the WKV kernel's `high`), TPU's one bf16 pass (`default`, 7 bits) and three
# bf16 passes (`high`, hi + lo halves: ~15 bits). Absent: IEEE float32 products (CPU at every
# precision, `highest`, the GPU kernel's `tf32x3`, whose split passes reach float32 error).
PRODUCT_MANTISSA_BITS = {("gpu", "default"): 10, ("gpu", "high"): 10,
                         ("tpu", "default"): 7, ("tpu", "high"): 15}


def round_mantissa(x, bits: int) -> np.ndarray:
    """`x` (float64) rounded to `bits` explicit mantissa bits, to nearest with ties to even;
    the exponent range is float64's (TF32 and bf16 share float32's, which a float32 operand
    already fits)."""
    mant, exp = np.frexp(np.asarray(x, np.float64))        # x = mant * 2**exp, |mant| in [0.5, 1)
    return np.ldexp(np.rint(np.ldexp(mant, bits + 1)), exp - (bits + 1))


E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)     # 448


def pow2_scale(amax: float, fmax: float = E4M3_MAX) -> float:
    """The power of two at or above `amax / fmax` (1 for amax 0 or not finite): the delayed-
    scaling recipe's scale (`lwm_jax.precision.fp8`) for a tensor whose largest magnitude is
    `amax`, so that it maps into the format's top binade."""
    if not (amax > 0 and np.isfinite(amax)):
        return 1.0
    mant, expo = np.frexp(amax / fmax)          # amax / fmax = mant * 2^expo, mant in [1/2, 1)
    return float(np.ldexp(1.0, int(expo) - 1 if mant == 0.5 else int(expo)))


def e4m3_operand(x) -> np.ndarray:
    """`x` (float64) as an FP8 GEMM's forward operand at the *ideal* delayed scale: divided by
    `pow2_scale(max |x|)` (the scale a history holding this very tensor's amax gives), rounded
    to float8 e4m3 (3 mantissa bits, nearest-even, clipped to +-448) and scaled back; float64.

    The FP8 floor of a block GEMM: what its policy asks for with scaling that works. A GEMM
    that ran in bf16 instead measures ~20x below it (8 mantissa bits); one whose delayed scale
    is far off (a lost or stale scale: values clipped at 448 or flushed below e4m3's smallest
    subnormal, 2^-9) measures far above it."""
    x = np.asarray(x, np.float64)
    finite = x[np.isfinite(x)]
    scale = pow2_scale(float(np.max(np.abs(finite), initial=0.0)))
    q = np.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(np.float64)
    return q * scale


def storage(x, dtype) -> np.ndarray:
    """`x` rounded to `dtype`'s precision, as float64: the rounding of storing it there.

    Relative rounding only: the tensor is first scaled by a power of two (exact) that brings
    its largest magnitude near 1, so float16's range does not turn large values into inf here
    (the policy's own range handling, e.g. ChannelMix's scaled squares, is measured by the
    local error, not assumed by the floor).
    """
    x = np.asarray(x, np.float64)
    dtype = jnp.dtype(dtype)
    if dtype == np.float64:
        return x
    peak = np.max(np.abs(x[np.isfinite(x)]), initial=0.0)
    shift = 0.0 if peak == 0 else float(np.ceil(np.log2(peak)))
    scale = np.exp2(-shift)
    return (x * scale).astype(dtype).astype(np.float64) / scale


def layer_norm64(x, weight, bias, eps: float = 1e-5):
    mean = x.mean(-1, keepdims=True)
    var = np.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def group_norm64(x, weight, bias, n_groups: int, eps: float):
    xg = x.reshape(*x.shape[:-1], n_groups, -1)
    mean = xg.mean(-1, keepdims=True)
    var = np.square(xg - mean).mean(-1, keepdims=True)
    return ((xg - mean) / np.sqrt(var + eps)).reshape(x.shape) * weight + bias


def rms_norm64(x, weight, eps: float):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight


def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-x))


def shift64(x_BTC):
    """Previous token's value, zeros at t = 0 (a fresh state, one document per row)."""
    return np.concatenate([np.zeros_like(x_BTC[:, :1]), x_BTC[:, :-1]], axis=1)


def logits_from(ctx: Context, normed_BTC, head_CV) -> Local:
    """The logits island's head product on the run's final-normed residual (float64): the
    policy's `logits` tap against `normed @ head`; floor: the product at the policy's matmul
    precision, stored in the output dtype."""
    ref = normed_BTC @ head_CV
    floor = ctx.product(normed_BTC) @ ctx.product(head_CV)
    return Local(ctx.tap("logits"), ref, storage(floor, ctx.output_dtype))


def cross_entropy64(logits_BTV, targets_BT):
    """Per-token cross-entropy `[B, T]` in float64."""
    z = np.asarray(logits_BTV, np.float64)
    top = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(-1)) + top[..., 0]
    return lse - np.take_along_axis(z, np.asarray(targets_BT)[..., None], -1)[..., 0]


def loss_local(ctx: Context, layer) -> Local:
    """The per-token loss the report computed in float32 from the policy's logits, against
    float64 cross-entropy of the same logits; floor: float32 storage of that."""
    del layer
    ref = cross_entropy64(ctx.tap("logits"), ctx.targets_BT)
    return Local(np.asarray(ctx.loss_BT, np.float64), ref, storage(ref, F32))


LOSS = SubOp("loss", "post", None, loss_local,
             "mean cross-entropy of the next token (float32 log-sum-exp)",
             "compute the cross-entropy in float32 from float32 logits (the loss island, "
             "lwm_jax.train.loss)")


def rel_error(x, ref) -> float:
    """`||x - ref|| / ||ref||` over all entries, float64; inf when x holds a NaN/inf; 0 when
    both are zero."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    num, den = float(np.linalg.norm(x - ref)), float(np.linalg.norm(ref))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def max_abs_error(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.max(np.abs(x - ref), initial=0.0))


def nonfinite_count(x) -> int:
    return int(np.size(x) - np.count_nonzero(np.isfinite(np.asarray(x, np.float64))))
