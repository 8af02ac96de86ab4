"""Precision report: where does a precision policy lose accuracy, and what would fix it?

```python
report = precision_report(model, tokens_BT1, "bf16-mixed", shadow="fp32")
print(format_table(report)); report.worst.suggestion
write_json(report, "report.json"); plot_heatmap(report, "heatmap.png")   # precision_plot
```

One batch goes through the model twice in this process: under the policy being examined and
under a shadow policy (default `fp32`: IEEE float32, matmul precision `highest`), each a probed
forward (every layer's taps) plus the gradient of the mean next-token cross-entropy. For every
layer and sub-op (RWKV-7: decay, WKV output and state, `ln_x`, FFN; LLaMA: attention, RMSNorm,
MLP; both: logits, loss; see `subops_rwkv7` / `subops_llama`) it reports

* local error: the op's output against its float64 formula on the very inputs the policy run
  fed it (`||x - ref|| / ||ref||` and max |x - ref|), and the *floor*, the same formula with only
  the roundings the policy asks for (its storage dtypes, and its products' operands as this
  backend rounds them at the policy's matmul precision: TF32 on GPU, bf16 passes on TPU);
  `excess` = local / max(floor, 64 * 2^-24);
* end-to-end error: the tapped value against the shadow run's (upstream errors included);
* non-finite entries in the policy run;
* per parameter group (per layer), the gradient's error against the shadow's gradient.

Worst offender: the op with the largest excess when one is at least `EXCESS_LIMIT` (it computes
less precisely than the policy promises: a lost fp32 island, a low-precision product) or holds
a non-finite value (the first in execution order); else, under an FP8 policy, a GEMM meant to
be FP8 that did not run as one; otherwise the op with the largest local error (the cost of the
policy itself). `Report.worst.suggestion` says what would fix it.

FP8 policies (`fp8-mixed`; RWKV-7 and LLaMA): the metas are calibrated over a few forward + backward
steps first (delayed scaling reads earlier steps' amaxes), the measurement uses the calibrated
scales, every FP8 GEMM site gets its own sub-op (its floor: e4m3 operands at their ideal
scale), and `Report.fp8` holds the scale / amax trajectories and the not-FP8 and clipping
checks (`precision_fp8`).

Family-neutral: the model is any class with the registry's interface (`lwm_jax.models.registry`:
`Cls(cfg, policy, runtime=, rngs=)`, `__call__(tokens, probe=)`), rebuilt per policy from its
own class and parameters; the sub-op table is chosen by the class name. CPU note: XLA's CPU
backend computes float32 products in IEEE float32 at every matmul precision, so `fp32-fast`
equals `fp32` there and TF32 effects need a GPU run (measured on an H200: bf16-mixed's float32
logits island and WKV state carry TF32's rounding, at their product floors; figures in
docs/precision.md, "Measuring a policy").
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.diagnostics import precision_fp8, subops_llama, subops_rwkv7
from lwm_jax.diagnostics.nonfinite import probed_forward
from lwm_jax.diagnostics.subops import (STRICT_ROUNDING, Context, Family, max_abs_error,
                                        nonfinite_count, rel_error)
from lwm_jax.precision.loss_scale import loss_scale_for
from lwm_jax.precision import Policy, parse_policy

FAMILIES: dict[str, Family] = {"RWKV7": subops_rwkv7.FAMILY, "Llama": subops_llama.FAMILY}
EXCESS_LIMIT = 8.0          # local error this many times the policy's floor = below contract
FLOOR_MIN = 64 * 2.0**-24   # float32 arithmetic slack: floors below this count as this
# On GPU, XLA's GEMM autotuning of the float32 (shadow) programs takes minutes at a 65536-entry
# vocabulary (as for the fp32 train step, benchmarks/RESULTS.md): the report takes cuBLAS's
# default algorithms instead, a valid implementation of the same policy (its rounding model,
# TF32 or IEEE float32 operands, does not depend on the algorithm).
GPU_QUICK_COMPILE = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def _compiler_options() -> dict:
    return {**STRICT_ROUNDING, **(GPU_QUICK_COMPILE if jax.default_backend() == "gpu" else {})}


@dataclasses.dataclass(frozen=True)
class Row:
    """One sub-op of one layer (`layer` None for ops outside the layers). Errors are relative
    (`||x - ref|| / ||ref||`) except the `*_max_abs` ones; `e2e_*` is None where the op has no
    tap to compare with the shadow's."""

    layer: int | None
    subop: str
    meaning: str
    local_rel: float
    local_max_abs: float
    floor_rel: float
    excess: float
    e2e_rel: float | None
    e2e_max_abs: float | None
    nonfinite: int


@dataclasses.dataclass(frozen=True)
class GradRow:
    """The loss gradient of one parameter group (one layer's slice for block parameters)
    against the shadow's gradient."""

    layer: int | None
    group: str
    rel: float
    max_abs: float
    nonfinite: int


@dataclasses.dataclass(frozen=True)
class Worst:
    """The worst offender. kind: "contract" (excess >= EXCESS_LIMIT), "nonfinite", "not_fp8"
    (under an FP8 policy, a GEMM meant to be FP8 that did not run as one; `layer` None and
    `subop` "traced forward" for the model-wide float8 product count), or "policy" (every op
    within its contract; the largest local error)."""

    layer: int | None
    subop: str
    kind: str
    local_rel: float
    excess: float
    suggestion: str


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything `precision_report` measured (see the module docstring). `model_source` says
    which model was studied (a checkpoint, a warmed or a fresh initialisation); `warmed` names
    the parameters `lwm_jax.diagnostics.warm` gave random values, if any; `fp8` the FP8
    section under an FP8 policy (`precision_fp8.Fp8Section`), else None."""

    family: str
    model: str
    policy: str
    shadow: str
    batch: dict
    rows: tuple[Row, ...]
    grads: tuple[GradRow, ...]
    worst: Worst
    loss: float
    shadow_loss: float | None
    platform: str = "cpu"
    model_source: str = "the model given"
    warmed: tuple[str, ...] = ()
    fp8: precision_fp8.Fp8Section | None = None

    @property
    def layers(self) -> int:
        return 1 + max((r.layer for r in self.rows if r.layer is not None), default=-1)

    def to_dict(self) -> dict:
        """JSON-ready dict (non-finite numbers become the strings "inf" / "nan")."""
        return _finite_json(dataclasses.asdict(self))


def family_of(model) -> Family:
    return family_of_class(type(model))


def family_of_class(model_cls: type) -> Family:
    """The sub-op table of a model class; a class without one is a one-line ValueError. The CLI
    asks before it builds the model: a refusal does not wait for an initialisation."""
    name = model_cls.__name__
    if name not in FAMILIES:
        raise ValueError(f"precision report: no sub-op table for model class {name}; "
                         f"supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


# ---------------------------------------------------------------------------------- runs
@dataclasses.dataclass
class _Run:
    taps: dict[str, np.ndarray]
    loss_BT: np.ndarray
    grads: dict
    params: dict
    metas: dict | None = None       # FP8: the metas the backward returned (host arrays)


def _model_fn(model, policy: Policy):
    """`() -> model` of the same class, config and runtime under `policy`, with remat and
    layer scan off (probes need every layer's taps)."""
    runtime = dataclasses.replace(model.runtime, remat=False, scan_layers=False)
    return lambda: type(model)(model.cfg, policy, runtime=runtime, rngs=nnx.Rngs(0))


def _token_loss(logits_BTV, targets_BT):
    """Per-token cross-entropy in float32 (log-sum-exp on float32 logits)."""
    z = logits_BTV.astype(jnp.float32)
    picked = jnp.take_along_axis(z, targets_BT[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(z, axis=-1) - picked


def _run(model, params: dict, policy: Policy, inputs_BT, targets_BT, gradients: bool,
         metas: dict | None = None) -> _Run:
    """Probed forward and (when `gradients`) the loss gradient of `model`'s parameters under
    `policy` (an fp16 policy's gradient through its dynamic loss scale's initial scale).
    `metas`: an FP8 policy's metas (the forward quantizes with them; the backward, run in any
    case, returns their updated values: `_Run.metas`)."""
    make = _model_fn(model, policy)
    p = policy.cast_to_param(params)
    logits, records = probed_forward(make, precision_fp8.with_metas(p, metas), inputs_BT,
                                     reduce=lambda name, x: x,
                                     compiler_options=_compiler_options())
    taps = {name: np.asarray(value) for name, value in jax.device_get(records)}
    loss = np.asarray(_token_loss(logits, targets_BT))
    grads, returned = {}, None
    if gradients or metas is not None:
        grads, returned = _gradients(make, p, policy, inputs_BT, targets_BT, metas)
    return _Run(taps, loss, grads if gradients else {}, jax.device_get(p), returned)


def _gradients(make, params, policy: Policy, inputs_BT, targets_BT, metas=None):
    """`(parameter gradients, the FP8 metas the backward returned or None)`, on the host."""
    graphdef = nnx.split(nnx.eval_shape(make))[0]
    scale = loss_scale_for(policy)

    def scaled_loss(p, m):
        logits = nnx.merge(graphdef, precision_fp8.with_metas(p, m))(inputs_BT)
        return scale.scale_loss(jnp.mean(_token_loss(logits, targets_BT)))

    grads, returned = jax.jit(jax.grad(scaled_loss, argnums=(0, 1)),
                              compiler_options=_compiler_options())(params, metas)
    return jax.device_get(scale.unscale(grads)), jax.device_get(returned)


def _f64_tree(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ------------------------------------------------------------------------------- report
def precision_report(model, tokens_BT1, policy: Policy | str | None = None, *,
                     shadow: Policy | str | None = "fp32", gradients: bool = True,
                     batch_info: dict | None = None, platform: str | None = None,
                     model_source: str | None = None, warmed: tuple[str, ...] = (),
                     fp8_metas: dict | None = None, fp8_calibration_steps: int | None = None,
                     fp8_calibration_tokens=None, fp8_source: str | None = None) -> Report:
    """Measure `policy` against float64 formulas and a `shadow` policy on one batch.

    Args:
      model: an `RWKV7` or `Llama` (any policy; its parameters are cast to each policy's
        param dtype).
      tokens_BT1: int `[B, T + 1]`: the model reads `[:, :-1]` and predicts `[:, 1:]`.
      policy: the policy to examine (None: the model's own).
      shadow: the reference policy for end-to-end and gradient errors (default `fp32`), or
        None: local errors only (one run, no gradients).
      gradients: also compare the loss gradients with the shadow's (one more compilation per
        policy).
      batch_info: recorded as is in the report (data source, seed, ...).
      platform: the backend whose product rounding the floors model (`cpu`, `gpu`, `tpu`;
        default: the backend the runs use, `jax.default_backend()`).
      model_source, warmed: recorded as is (which model this is; `Report.model_source`).
      fp8_metas: FP8 policy only: the starting metas, a nested dict of float32
        `[L, 3, 1 + history]` arrays as the model holds them (`TrainState.fp8` of a training
        checkpoint); None: the model's own `Fp8Meta` state if it recorded an amax, else fresh.
      fp8_calibration_steps: FP8 only: forward + backward steps that update the metas before
        the measurement (None: `precision_fp8.CALIBRATION_STEPS` from fresh metas, 0 from
        recorded ones).
      fp8_calibration_tokens: FP8 only: int `[N, B, T + 1]` batches of the calibration steps
        (cycled); None: the report's batch at every step.
      fp8_source: FP8 only: where `fp8_metas` came from, for the report.
    Returns:
      a `Report`.
    """
    family = family_of(model)
    policy = parse_policy(model.policy if policy is None else policy)
    shadow = None if shadow is None or shadow == "none" else parse_policy(shadow)
    if shadow is not None and shadow.fp8:
        raise ValueError(f"precision report: shadow {shadow.name!r} has FP8 GEMMs; the "
                         "reference must compute more precisely than the policy (e.g. fp32)")
    fp8_args = (fp8_metas, fp8_calibration_steps, fp8_calibration_tokens)
    if policy.fp8:
        if not family.fp8_subops:
            raise ValueError(f"precision report: policy {policy.name!r} has FP8 GEMMs, whose "
                             f"floors this report models for RWKV-7 and LLaMA only, not "
                             f"{family.name} yet; examine 'bf16-mixed'")
        family = dataclasses.replace(family, subops=family.fp8_subops)
    elif any(a is not None for a in fp8_args):
        raise ValueError(f"precision report: fp8_metas / fp8_calibration_* apply to an FP8 "
                         f"policy (fp8-mixed, g=fp8), not {policy.name!r}; drop them")
    gradients = gradients and shadow is not None
    tokens = np.asarray(tokens_BT1)
    if tokens.ndim != 2 or tokens.shape[1] < 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"precision report: tokens must be an integer [B, T + 1] array with "
                         f"T >= 1, got shape {tokens.shape} dtype {tokens.dtype}")
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    cal = None
    if policy.fp8:
        cal = precision_fp8.calibrate(
            model, _model_fn(model, policy), policy.cast_to_param(params), tokens,
            token_loss=_token_loss, compiler_options=_compiler_options(), metas=fp8_metas,
            steps=fp8_calibration_steps, tokens=fp8_calibration_tokens, source=fp8_source)
    run = _run(model, params, policy, inputs, targets, gradients,
               None if cal is None else cal.metas)
    ref = None if shadow is None else _run(model, params, shadow, inputs, targets, gradients)
    platform = jax.default_backend() if platform is None else platform
    ctx = Context(run.taps, _f64_tree(run.params), model.cfg, policy, np.asarray(inputs),
                  np.asarray(targets), run.loss_BT, platform=platform)
    rows = tuple(_measure(ctx, family, ref))
    grads = tuple(_grad_rows(family, run.grads, ref.grads)) if gradients else ()
    info = {"batch_size": int(tokens.shape[0]), "seq_len": int(tokens.shape[1] - 1),
            **(batch_info or {})}
    fp8 = None if cal is None else precision_fp8.section(cal, family, rows, run.metas, ctx)
    return Report(family.name, _describe(model.cfg), policy.name,
                  "none" if shadow is None else shadow.name, info, rows, grads,
                  pick_worst(rows, policy, family, platform, () if fp8 is None else fp8.not_fp8),
                  float(np.mean(run.loss_BT)),
                  None if ref is None else float(np.mean(ref.loss_BT)), platform,
                  model_source or Report.model_source, tuple(warmed), fp8)


def _describe(cfg) -> str:
    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {}
    keys = ("vocab_size", "n_layer", "n_embd", "head_size", "n_head", "n_kv_head", "head_dim")
    return " ".join(f"{k}={fields[k]}" for k in keys if k in fields)


def _execution_order(family: Family, n_layer: int):
    for stage in ("pre", "layer", "post"):
        ops = [op for op in family.subops if op.stage == stage]
        for layer in (range(n_layer) if stage == "layer" else [None]):
            for op in ops:
                yield op, layer


def _measure(ctx: Context, family: Family, ref: _Run | None):
    for op, layer in _execution_order(family, ctx.cfg.n_layer):
        local = op.local(ctx, layer)
        local_rel = rel_error(local.value, local.ref)
        floor_rel = rel_error(local.floor, local.ref)
        e2e_rel = e2e_abs = None
        if ref is not None and op.tap is not None:
            name = op.tap if layer is None else f"layer{layer}/{op.tap}"
            e2e_rel = rel_error(ctx.taps[name], ref.taps[name])
            e2e_abs = max_abs_error(ctx.taps[name], ref.taps[name])
        elif ref is not None and op.name == "loss":
            e2e_rel = rel_error(local.value, ref.loss_BT)
            e2e_abs = max_abs_error(local.value, ref.loss_BT)
        excess = local_rel / max(floor_rel, FLOOR_MIN) if math.isfinite(local_rel) else math.inf
        yield Row(layer, op.name, op.meaning, local_rel, max_abs_error(local.value, local.ref),
                  floor_rel, excess, e2e_rel, e2e_abs, nonfinite_count(local.value))


def _grad_rows(family: Family, grads: dict, ref: dict):
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    ref_flat = dict(jax.tree_util.tree_flatten_with_path(ref)[0])
    groups: dict[tuple, list] = {}
    for path, g in flat:
        names = tuple(str(getattr(k, "key", k)) for k in path)
        g64, r64 = np.asarray(g, np.float64), np.asarray(ref_flat[path], np.float64)
        layers = range(g64.shape[0]) if names[0] == "blocks" else [None]
        for layer in layers:
            pair = (g64, r64) if layer is None else (g64[layer], r64[layer])
            groups.setdefault((layer, family.grad_group(names)), []).append(pair)
    for (layer, group), pairs in sorted(groups.items(), key=lambda kv: (
            -1 if kv[0][0] is None else kv[0][0], kv[0][1])):
        g = np.concatenate([p.ravel() for p, _ in pairs])
        r = np.concatenate([q.ravel() for _, q in pairs])
        yield GradRow(layer, group, rel_error(g, r), max_abs_error(g, r), nonfinite_count(g))


def pick_worst(rows: tuple[Row, ...], policy: Policy, family: Family,
               platform: str = "cpu", not_fp8: tuple = ()) -> Worst:
    """The worst offender and the change that would fix it (see the module docstring);
    `not_fp8`: `precision_fp8.NotFp8` findings of an FP8 policy."""
    def make(row, kind, text):
        return Worst(row.layer, row.subop, kind, row.local_rel, row.excess, text)

    where = lambda r: r.subop if r.layer is None else f"layer {r.layer} {r.subop}"  # noqa: E731
    fixes = {op.name: op.fix for op in family.subops}
    bad = next((r for r in rows if r.nonfinite), None)
    if bad is not None:
        return make(bad, "nonfinite", f"{where(bad)} holds {bad.nonfinite} non-finite values: "
                    f"{fixes[bad.subop]}; `lwm_jax.diagnostics.nonfinite` names the first tap")
    top = max(rows, key=lambda r: r.excess)
    if top.excess >= EXCESS_LIMIT:
        return make(top, "contract", f"{where(top)}: local error {top.local_rel:.2e} is "
                    f"{top.excess:.0f}x what this policy's storage and products allow "
                    f"({top.floor_rel:.1e}): {fixes[top.subop]}")
    if not_fp8:
        n = not_fp8[0]
        op = dict(family.fp8_gemms).get(n.site, n.site)
        row = next((r for r in rows if r.subop == op and r.layer == n.layer), None)
        what = (f"{n.site}: {n.why}, so a GEMM meant to be FP8 under {policy.name} is not"
                if n.layer is None else f"{n.site} layer {n.layer} did not run as an FP8 GEMM "
                f"under {policy.name} ({n.why})")
        return Worst(n.layer, op, "not_fp8", math.nan if row is None else row.local_rel,
                     math.nan if row is None else row.excess,
                     f"{what}: give its product the site's meta "
                     "(Policy.einsum(..., fp8_meta=p['fp8_<name>']))")
    top = max(rows, key=lambda r: r.local_rel)
    if policy.fp8 and precision_fp8.is_fp8_row(top.subop, family):
        return make(top, "policy", precision_fp8.advice(where(top), top.local_rel))
    return make(top, "policy", _policy_advice(top, policy, where(top), platform))


def _policy_advice(row: Row, policy: Policy, where: str, platform: str = "cpu") -> str:
    cd = jnp.dtype(policy.compute_dtype)
    head = (f"every sub-op is within this policy's precision; the largest local error is "
            f"{where} at {row.local_rel:.1e}")
    if cd != jnp.float32:
        extra = ""
        if row.subop in ("wkv", "wkv_state") and policy.wkv_precision != "highest":
            extra = "; for the WKV alone, w=highest keeps its in-chunk products IEEE float32"
        return (f"{head}, the {cd.name} storage of `{policy.name}` itself: use "
                f"precision=fp32-fast to keep activations in float32 (same islands, float32 "
                f"storage){extra}")
    if policy.matmul_precision != "highest":
        if platform == "cpu":
            return (f"{head}: float32 storage; on GPU/TPU use precision=fp32 (matmul precision "
                    "highest) to remove TF32 / bf16-pass products (CPU already computes IEEE "
                    "float32)")
        short = "TF32" if platform == "gpu" else "bf16-pass"
        extra = ""
        if platform == "gpu" and row.subop in ("wkv", "wkv_state"):
            extra = ("; for the WKV alone, w=tf32x3 reaches float32 error at tensor-core "
                     "speed (precision=p=f32,c=f32,w=tf32x3)")
        return (f"{head}: float32 storage with {short} products; precision=fp32 (matmul "
                f"precision highest) makes them IEEE float32{extra}")
    return f"{head}: float32 level, no change needed"


# ------------------------------------------------------------------------------- output
def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2e}" if math.isfinite(x) else str(x)


def format_table(report: Report) -> str:
    """The report as a fixed-width text table (sub-ops, then gradients, then the verdict)."""
    lines = [f"precision report: {report.family} {report.model}; policy {report.policy} vs "
             f"shadow {report.shadow} on {report.platform}; batch {report.batch}",
             f"model studied: {report.model_source}",
             f"loss {report.loss:.6f} (shadow "
             f"{'-' if report.shadow_loss is None else f'{report.shadow_loss:.6f}'})", "",
             f"{'layer':>5} {'sub-op':<10} {'local rel':>10} {'floor':>9} {'excess':>8} "
             f"{'local max':>10} {'e2e rel':>9} {'e2e max':>9} {'nonfinite':>9}"]
    for r in report.rows:
        lines.append(f"{'-' if r.layer is None else r.layer:>5} {r.subop:<10} "
                     f"{_fmt(r.local_rel):>10} {_fmt(r.floor_rel):>9} {r.excess:>8.2f} "
                     f"{_fmt(r.local_max_abs):>10} {_fmt(r.e2e_rel):>9} "
                     f"{_fmt(r.e2e_max_abs):>9} {r.nonfinite:>9}")
    lines += ["", f"{'layer':>5} {'gradient':<10} {'rel':>10} {'max abs':>10} {'nonfinite':>9}"]
    for g in report.grads:
        lines.append(f"{'-' if g.layer is None else g.layer:>5} {g.group:<10} "
                     f"{_fmt(g.rel):>10} {_fmt(g.max_abs):>10} {g.nonfinite:>9}")
    if report.fp8 is not None:
        lines += ["", *precision_fp8.format_lines(report.fp8)]
    w = report.worst
    lines += ["", f"worst offender ({w.kind}): "
              f"{w.subop if w.layer is None else f'layer {w.layer} {w.subop}'}",
              f"suggestion: {w.suggestion}"]
    return "\n".join(lines)


def _finite_json(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def write_json(report: Report, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1)
        f.write("\n")
