"""Precision policy: which dtype each tensor lives in, and how matmuls are computed.

A `Policy` is a frozen dataclass decided once per run (from a config string) and passed to every
module. Nothing in the library reads a global matmul-precision flag: every `einsum`/`dot` goes
through `Policy.einsum`, which passes `precision=` explicitly.

Presets (names accepted by `parse_policy`):

| name         | params | compute | output | matmul    | WKV matmul | loss scale |
|--------------|--------|---------|--------|-----------|------------|------------|
| `fp32`       | f32    | f32     | f32    | highest   | highest    | none       |
| `fp32-fast`  | f32    | f32     | f32    | default   | high       | none       |
| `bf16-mixed` | f32    | bf16    | f32    | default   | high       | none       |
| `fp16-mixed` | f32    | f16     | f32    | default   | high       | dynamic    |
| `bf16`       | bf16   | bf16    | f32    | default   | high       | none       |
| `fp8-mixed`  | f32    | bf16    | f32    | default   | high       | none       |

`fp8-mixed` is `bf16-mixed` whose block GEMMs (the projections that own an FP8 meta: RWKV-7's
time-mix r/k/v/output and channel-mix key/value; the LLaMA and hybrid models refuse FP8
policies until theirs are wired) run as FP8 GEMMs with delayed scaling (`fp8.fp8_einsum`: e4m3 operands forward, e5m2 output gradient backward,
float32 accumulation); every other matmul, the LM head and the fp32 islands stay as in
`bf16-mixed`.

The WKV matmul precision is the precision of the chunked WKV7's in-chunk products (its state
and accumulation are fp32 always): `high` is TF32 on GPU (the kernel's measured accuracy is at
the bf16 output rounding) and three bf16 passes on TPU (one pass, `default`, would round the
decayed keys to 8 bits); `highest` is IEEE fp32 everywhere.

`tf32x3` (WKV only, opt-in: `w=tf32x3`) runs the GPU kernel's products as three TF32 tensor-core
passes on split operands: fp32-level error at tensor-core speed (measured against `highest`
in benchmarks/RESULTS.md, kernel precision table). Backends without it (XLA chunked form, TPU, the CPU
interpreter) compute it as `highest`.

`fp32` is true IEEE fp32 even on TPU and H100 (`highest` = no bf16 passes, no TF32).
`fp32-fast` keeps fp32 storage but lets XLA use its default (bf16 passes on TPU, TF32 on GPU).

Levanter/jmp-style strings are accepted too: `p=f32,c=bf16[,o=f32][,m=highest][,w=high][,s=dynamic][,g=fp8]`
(keys p=param, c=compute, o=output, m=matmul precision, w=WKV matmul precision (default: highest
when m=highest, else high), s=loss scale, g=the block GEMMs' format: `compute` (default) or
`fp8`, which needs c=bf16 and no loss scale).

Whatever the policy, the fp32 islands (RWKV-7 decay, WKV state, norm statistics, `kk`
normalisation, logits and loss, optimizer moments) are computed in float32 by the modules that
own them; the policy never reaches inside those. An island is its forward values: the
gradients flowing back through the island's matmuls (the head, the decay LoRA) are products in
the compute dtype with float32 accumulation, like every other backward product of the step.
Every parameter's gradient is accumulated in float32: the matmuls' by `preferred_element_type`,
the per-channel parameters applied elementwise to 16-bit activations (token-shift mixes,
biases, per-head scales) through `param_mul` / `param_add`, whose gradients sum the tokens
in float32.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lwm_jax.precision import bf16_split, fp8
from lwm_jax.precision.einsum_spec import einsum_terms
from lwm_jax.remat_names import MATMUL_OUTPUT_NAME

DTYPES: dict[str, Any] = {
    "f32": jnp.float32, "fp32": jnp.float32, "float32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f16": jnp.float16, "fp16": jnp.float16, "float16": jnp.float16,
}
MATMUL_PRECISIONS = ("default", "high", "highest")
WKV_PRECISIONS = MATMUL_PRECISIONS + ("tf32x3",)
LOSS_SCALES = ("none", "dynamic")
GEMM_FORMATS = ("compute", "fp8")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes and matmul precision for one run.

    Attributes:
      name: the preset or string the policy was parsed from (for logs and checkpoints).
      param_dtype: dtype parameters are stored (and optimised) in.
      compute_dtype: dtype of activations and matmul operands outside the fp32 islands.
      output_dtype: dtype of the model's returned logits (logits are computed in fp32 and stay
        fp32 unless this says otherwise; the loss is always fp32).
      matmul_precision: XLA precision name ("default" | "high" | "highest"), passed explicitly to
        every einsum/dot.
      loss_scale: "none" or "dynamic" (fp16 training: see `DynamicLossScale`).
      wkv_precision: precision name of the WKV7 op's in-chunk matmuls (passed to
        `lwm_jax.ops.wkv7.wkv7(..., precision=)`, one of `WKV_PRECISIONS`); None = "highest" if
        `matmul_precision` is "highest", else "high".
      gemm: the block GEMMs' format, one of `GEMM_FORMATS`: "compute" (the compute dtype) or
        "fp8" (`fp8.fp8_einsum` at every `einsum` given an FP8 meta).
    """

    name: str
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32
    matmul_precision: str = "highest"
    loss_scale: str = "none"
    wkv_precision: str | None = None
    gemm: str = "compute"

    def __post_init__(self):
        if self.wkv_precision is None:
            object.__setattr__(self, "wkv_precision",
                               "highest" if self.matmul_precision == "highest" else "high")
        if self.wkv_precision not in WKV_PRECISIONS:
            raise ValueError(f"precision policy {self.name!r}: WKV matmul precision "
                             f"{self.wkv_precision!r} is not one of {WKV_PRECISIONS}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"precision policy {self.name!r}: matmul precision "
                             f"{self.matmul_precision!r} is not one of {MATMUL_PRECISIONS}")
        if self.loss_scale not in LOSS_SCALES:
            raise ValueError(f"precision policy {self.name!r}: loss scale {self.loss_scale!r} "
                             f"is not one of {LOSS_SCALES}")
        if self.gemm not in GEMM_FORMATS:
            raise ValueError(f"precision policy {self.name!r}: GEMM format {self.gemm!r} is not "
                             f"one of {GEMM_FORMATS}")
        if self.gemm == "fp8" and (jnp.dtype(self.compute_dtype) != jnp.bfloat16
                                   or self.loss_scale != "none"):
            raise ValueError(f"precision policy {self.name!r}: g=fp8 needs c=bf16 and no loss "
                             "scale (FP8 GEMMs scale each tensor themselves); use 'fp8-mixed' "
                             "or p=f32,c=bf16,g=fp8")

    @property
    def fp8(self) -> bool:
        """Whether the block GEMMs given an FP8 meta run as FP8 GEMMs."""
        return self.gemm == "fp8"

    @property
    def lax_precision(self) -> jax.lax.Precision:
        return jax.lax.Precision(self.matmul_precision)

    def cast_to_compute(self, x):
        """Cast floating arrays (or a pytree of them) to `compute_dtype`; ints pass through."""
        return _cast_floats(x, self.compute_dtype)

    def cast_to_param(self, x):
        return _cast_floats(x, self.param_dtype)

    def cast_to_output(self, x):
        return _cast_floats(x, self.output_dtype)

    def einsum(self, spec: str, *operands, out_dtype=None, fp8_meta=None):
        """`jnp.einsum` with operands in `compute_dtype` and this policy's explicit precision.

        Accumulation is fp32 on every backend (`preferred_element_type=float32`); the result is
        returned in `out_dtype` (default: `compute_dtype`). With a 16-bit compute dtype the
        backward products run in it too (see `_low_precision_einsum`), not in float32. Under
        an FP8 policy (`gemm="fp8"`) a call given its site's `fp8_meta` runs as an FP8 GEMM
        (`fp8.fp8_einsum`); elsewhere `fp8_meta` is ignored.
        """
        out_dtype = self.compute_dtype if out_dtype is None else out_dtype
        if fp8_meta is not None and self.fp8:
            einsum_terms(spec)
            y = fp8.fp8_einsum(spec, *operands, fp8_meta, compute_dtype=self.compute_dtype,
                               out_dtype=out_dtype)
            return checkpoint_name(y, MATMUL_OUTPUT_NAME)
        if len(operands) == 2 and jnp.dtype(self.compute_dtype) != jnp.float32:
            einsum_terms(spec)               # a spec the custom backward cannot transpose
            y = _low_precision_einsum(spec, jnp.dtype(self.compute_dtype), self.lax_precision,
                                      *operands)
            return checkpoint_name(y.astype(out_dtype), MATMUL_OUTPUT_NAME)
        ops = [x.astype(self.compute_dtype) for x in operands]
        y = jnp.einsum(spec, *ops, precision=self.lax_precision,
                       preferred_element_type=jnp.float32)
        return checkpoint_name(y.astype(out_dtype), MATMUL_OUTPUT_NAME)

    def einsum_f32(self, spec: str, *operands, precision: str | None = None):
        """fp32 einsum for the fp32 islands (logits, decay): operands upcast, result float32.

        Operands are stored and accumulated in fp32; the forward multiply uses `precision` if
        given (an island that needs IEEE float32 whatever the policy passes "highest"), else
        this policy's matmul precision: under `fp32` IEEE fp32, under the mixed presets what
        XLA does for an fp32 matmul at `default` (TF32 on GPU, one bf16 pass on TPU) -- never
        less precise than a bf16 matmul, and as fast as the hardware's fp32 path allows. Under
        a bf16 compute dtype an explicit "highest" is computed from the operands' bf16 pieces
        (`bf16_split.split_einsum`: IEEE-float32-level accuracy on the tensor cores, which a
        GPU's HIGHEST does not use).

        The island is the forward value. Under a 16-bit compute dtype the two backward products
        (two operands) take 16-bit operands with float32 accumulation and float32 gradients,
        like every other backward product of the step (`_island_einsum`): the LM head's
        gradient GEMMs were two thirds of its time as TF32.
        """
        ops = [x.astype(jnp.float32) for x in operands]
        forward = self.lax_precision if precision is None else jax.lax.Precision(precision)
        if len(ops) == 2 and jnp.dtype(self.compute_dtype) != jnp.float32:
            einsum_terms(spec)               # a spec the custom backward cannot transpose
            pieces = None
            if precision == "highest" and jnp.dtype(self.compute_dtype) == jnp.bfloat16:
                # an island that asks for IEEE float32: the same accuracy from bf16 tensor-core
                # passes (`bf16_split`; a bf16 operand is one exact piece, a float32 one three)
                pieces = tuple(1 if jnp.dtype(x.dtype) == jnp.bfloat16 else 3 for x in operands)
            y = _island_einsum(spec, jnp.dtype(self.compute_dtype), self.lax_precision,
                               forward, pieces, *ops)
        else:
            y = jnp.einsum(spec, *ops, precision=forward, preferred_element_type=jnp.float32)
        return checkpoint_name(y, MATMUL_OUTPUT_NAME)


def matmul_outputs_saveable(*names: str):
    """A `jax.checkpoint` policy that keeps every `Policy.einsum` / `einsum_f32` result (in its
    returned dtype, `MATMUL_OUTPUT_NAME`) and the values `checkpoint_name`d `names`; the
    elementwise work between them is recomputed in the backward pass."""
    return jax.checkpoint_policies.save_only_these_names(MATMUL_OUTPUT_NAME, *names)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _low_precision_einsum(spec: str, compute_dtype, precision, x, y):
    """`einsum(spec, x, y)` on operands cast to the 16-bit `compute_dtype`, accumulated and
    returned in float32, whose backward products also take 16-bit operands.

    Plain autodiff of that forward would not: the output's cotangent is float32, and XLA runs a
    float32 x bf16 product as a float32 (TF32 on GPU) matmul at about half the tensor-core rate
    of bf16 -- every backward GEMM of a `bf16-mixed` step did so before this existed. Here the
    cotangent is rounded to `compute_dtype` (as torch autocast's backward does), each gradient
    is accumulated in float32 and returned in its operand's own dtype: float32 parameters get a
    float32 gradient from a bf16 x bf16 product. Two operands, explicit `->`, no ellipsis.
    """
    return jnp.einsum(spec, x.astype(compute_dtype), y.astype(compute_dtype),
                      precision=precision, preferred_element_type=jnp.float32)


def _low_precision_einsum_fwd(spec, compute_dtype, precision, x, y):
    x_c, y_c = x.astype(compute_dtype), y.astype(compute_dtype)
    out = jnp.einsum(spec, x_c, y_c, precision=precision, preferred_element_type=jnp.float32)
    return out, (x_c, y_c, np.zeros((0,), x.dtype), np.zeros((0,), y.dtype))


def _low_precision_einsum_bwd(spec, compute_dtype, precision, res, ct):
    x_c, y_c, x_proto, y_proto = res
    xs, ys, out = einsum_terms(spec)
    ct_c = ct.astype(compute_dtype)
    dx = jnp.einsum(f"{out},{ys}->{xs}", ct_c, y_c, precision=precision,
                    preferred_element_type=jnp.float32)
    dy = jnp.einsum(f"{xs},{out}->{ys}", x_c, ct_c, precision=precision,
                    preferred_element_type=jnp.float32)
    return dx.astype(x_proto.dtype), dy.astype(y_proto.dtype)


_low_precision_einsum.defvjp(_low_precision_einsum_fwd, _low_precision_einsum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _island_einsum(spec: str, compute_dtype, precision, forward_precision, pieces, x, y):
    """`einsum(spec, x, y)` on float32 operands at `forward_precision` (an fp32 island's
    forward), whose backward products round the cotangent and the saved operands to the 16-bit
    `compute_dtype` and accumulate in float32 at `precision` (`_low_precision_einsum_bwd`);
    gradients are float32. `pieces` (x's, y's) computes the forward from bf16 pieces instead
    (`bf16_split.split_einsum`, IEEE-float32-level accuracy); None: one product at
    `forward_precision`."""
    return _island_forward(spec, forward_precision, pieces, x, y)


def _island_forward(spec, forward_precision, pieces, x, y):
    if pieces is not None:
        return bf16_split.split_einsum(spec, x, y, x_pieces=pieces[0], y_pieces=pieces[1])
    return jnp.einsum(spec, x, y, precision=forward_precision,
                      preferred_element_type=jnp.float32)


def _island_einsum_fwd(spec, compute_dtype, precision, forward_precision, pieces, x, y):
    out = _island_forward(spec, forward_precision, pieces, x, y)
    return out, (x.astype(compute_dtype), y.astype(compute_dtype),
                 np.zeros((0,), x.dtype), np.zeros((0,), y.dtype))


def _island_einsum_bwd(spec, compute_dtype, precision, forward_precision, pieces, res, ct):
    return _low_precision_einsum_bwd(spec, compute_dtype, precision, res, ct)


_island_einsum.defvjp(_island_einsum_fwd, _island_einsum_bwd)


def param_mul(x, p):
    """`x * p` in x's dtype for a parameter `p` whose shape is x's trailing dims (a per-channel
    mix, a per-head scale); p's gradient is summed over x's leading axes in float32.

    Plain autodiff of `x * p.astype(x.dtype)` sums p's gradient in x's (16-bit) dtype: a
    16-bit sum over B*T tokens keeps ~8 bits, so a `[C]` parameter's gradient was ~1-2% off
    on random data and stalled outright on biased data (a bfloat16 sum of 32768 ones is 256
    in a sequential fold, 8192 in XLA's split one). The forward and x's gradient are those of
    the plain product, bit for bit.
    """
    check_trailing(x, p, "param_mul")
    return _param_mul(x, p)


def param_add(x, p):
    """`x + p` in x's dtype for a bias `p` shaped as x's trailing dims; p's gradient (the
    incoming cotangent summed over x's leading axes) is accumulated in float32 (`param_mul`)."""
    check_trailing(x, p, "param_add")
    return _param_add(x, p)


def check_trailing(x, p, name):
    """Raise a one-line ValueError (prefixed `name`) unless `p`'s shape is `x`'s trailing dims."""
    if p.ndim > x.ndim or tuple(x.shape[x.ndim - p.ndim:]) != tuple(p.shape):
        raise ValueError(f"{name}: parameter shape {tuple(p.shape)} is not the trailing dims of "
                         f"the activations' {tuple(x.shape)}")


def _sum_lead_f32(g, like_p):
    return jnp.sum(g, axis=tuple(range(g.ndim - like_p.ndim)), dtype=jnp.float32)


@jax.custom_vjp
def _param_mul(x, p):
    return x * p.astype(x.dtype)


def _param_mul_fwd(x, p):
    return x * p.astype(x.dtype), (x, p)


def _param_mul_bwd(res, g):
    x, p = res
    dp = _sum_lead_f32(g.astype(jnp.float32) * x.astype(jnp.float32), p)
    return (g * p.astype(g.dtype)).astype(x.dtype), dp.astype(p.dtype)


_param_mul.defvjp(_param_mul_fwd, _param_mul_bwd)


@jax.custom_vjp
def _param_add(x, p):
    return x + p.astype(x.dtype)


def _param_add_fwd(x, p):
    return x + p.astype(x.dtype), p          # p (a [C]-sized parameter) for its shape and dtype


def _param_add_bwd(p, g):
    return g, _sum_lead_f32(g, p).astype(p.dtype)


_param_add.defvjp(_param_add_fwd, _param_add_bwd)


def _cast_floats(tree, dtype):
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree.map(cast, tree)


PRESETS: dict[str, Policy] = {
    "fp32": Policy("fp32", jnp.float32, jnp.float32, jnp.float32, "highest"),
    "fp32-fast": Policy("fp32-fast", jnp.float32, jnp.float32, jnp.float32, "default"),
    "bf16-mixed": Policy("bf16-mixed", jnp.float32, jnp.bfloat16, jnp.float32, "default"),
    "fp16-mixed": Policy("fp16-mixed", jnp.float32, jnp.float16, jnp.float32, "default",
                         "dynamic"),
    "bf16": Policy("bf16", jnp.bfloat16, jnp.bfloat16, jnp.float32, "default"),
    "fp8-mixed": Policy("fp8-mixed", jnp.float32, jnp.bfloat16, jnp.float32, "default",
                        gemm="fp8"),
}

_KEYS = {"p": "param_dtype", "c": "compute_dtype", "o": "output_dtype",
         "m": "matmul_precision", "w": "wkv_precision", "s": "loss_scale", "g": "gemm"}


def parse_policy(spec: str | Policy) -> Policy:
    """Parse a preset name (`bf16-mixed`) or a `p=f32,c=bf16` string into a `Policy`.

    Raises ValueError naming the bad part and listing what is valid.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"precision: expected a preset name or 'p=..,c=..' string, got {spec!r}; "
                         f"presets: {', '.join(PRESETS)}")
    text = spec.strip().lower()
    if text in PRESETS:
        return PRESETS[text]
    if "=" not in text:
        raise ValueError(f"precision: unknown preset {spec!r}; valid presets: "
                         f"{', '.join(PRESETS)} (or a string like 'p=f32,c=bf16')")
    fields: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in _KEYS:
            raise ValueError(f"precision: bad part {part.strip()!r} in {spec!r}; keys are "
                             "p=param, c=compute, o=output dtype, m=matmul precision, w=WKV matmul "
                             "precision, s=loss scale, g=GEMM format")
        field = _KEYS[key]
        if field in fields:
            raise ValueError(f"precision: key {key}= given twice in {spec!r}")
        if field.endswith("dtype"):
            if value not in DTYPES:
                raise ValueError(f"precision: unknown dtype {value!r} for {key}= in {spec!r}; "
                                 f"valid dtypes: {', '.join(sorted(set(DTYPES)))}")
            fields[field] = DTYPES[value]
        else:
            fields[field] = value
    fields.setdefault("param_dtype", jnp.float32)
    fields.setdefault("compute_dtype", fields["param_dtype"])
    fields.setdefault("output_dtype", jnp.float32)
    compute_is_f32 = jnp.dtype(fields["compute_dtype"]) == jnp.float32
    fields.setdefault("matmul_precision", "highest" if compute_is_f32 else "default")
    is_f16 = jnp.dtype(fields["compute_dtype"]) == jnp.float16
    fields.setdefault("loss_scale", "dynamic" if is_f16 else "none")
    return Policy(name=spec.strip(), **fields)
