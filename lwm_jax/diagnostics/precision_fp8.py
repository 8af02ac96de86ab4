"""FP8 policies in the precision report: calibrated delayed scaling, the scale / amax
trajectories, and the check that every GEMM meant to be FP8 ran as one.

An FP8 GEMM (`lwm_jax.precision.fp8`) quantizes with scales computed from the amax history of
*earlier* steps, so one batch through fresh metas (scale 1, empty history) would measure
whatever the formats' fixed ranges happen to give: at scale 1 values below 2^-9 (e4m3) or
2^-16 (e5m2) flush to zero and values above 448 / 57344 clip, and output gradients shrink with
the number of tokens the loss averages (~1 / (B T)). The report therefore first *calibrates*:

1. starting metas: those given (`fp8_metas=`, e.g. a training checkpoint's `TrainState.fp8`),
   else the model's own `Fp8Meta` state when it has recorded any amax, else fresh ones;
2. `steps` calibration steps (default `CALIBRATION_STEPS` from fresh metas, 0 from recorded
   ones), each a forward + backward of the mean next-token cross-entropy on one batch (the
   report's batch, or the calibration batches given, cycled) that replaces every meta by the
   value its backward returns, kept where the step is not finite (loss, parameter gradients or
   metas), as the train step's `fp8.overwrite` does; parameters never change;
3. after each step the scale each site, layer and row (input, kernel, output gradient) used
   and the amax it recorded: the trajectories (`Fp8Section.scale` / `.amax`, `[steps][L][3]`).

The report's batch is then measured with the calibrated metas. Its own backward gives the
scales that batch used and its amaxes (`measured_scale` / `measured_amax`, `[L][3]`), read for
two checks:

* *not FP8* (`not_fp8`): a site whose meta came back all zeros (no product read it: the GEMM
  ran without its meta); a GEMM whose local error is nearer its compute-dtype floor than its
  e4m3 floor (below their geometric mean; `gemms` holds both floors: e4m3's 3 mantissa bits
  against bf16's 8 put them ~20x apart, so a bf16 GEMM sits far below the e4m3 floor and an
  FP8 one at it); or fewer float8 products in the traced forward than site-layers
  (`float8_dots`: dot_generals whose operands are all float8, `Policy.einsum`'s "xla" form);
* *clipped* (`clipped`): a tensor whose amax exceeded `format max x scale`, so values were
  saturated (a scale the history had not caught up with).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lwm_jax.precision import fp8
from lwm_jax.precision.fp8 import Fp8Meta

CALIBRATION_STEPS = 8     # from fresh metas: step 1 records amaxes at scale 1, 2.. use them
FORMAT_MAX = (float(jnp.finfo(fp8.E4M3).max), float(jnp.finfo(fp8.E4M3).max),
              float(jnp.finfo(fp8.E5M2).max))     # per row: input, kernel (e4m3), grad (e5m2)


@dataclasses.dataclass(frozen=True)
class NotFp8:
    """A GEMM meant to be FP8 that did not run as one (`layer` None: model-wide)."""

    site: str
    layer: int | None
    why: str


@dataclasses.dataclass(frozen=True)
class GemmCheck:
    """One FP8 GEMM site and layer: its local error, its floor with e4m3 operands and its
    floor with compute-dtype operands (the same sub-op under the policy without FP8), and
    whether the local error reads as FP8 (at or above the floors' geometric mean)."""

    site: str
    layer: int
    local_rel: float
    fp8_floor_rel: float
    compute_floor_rel: float
    fp8: bool


@dataclasses.dataclass(frozen=True)
class Clipped:
    """A tensor of the measured batch whose amax exceeded its format's range at its scale."""

    site: str
    layer: int
    row: str
    amax: float
    limit: float


@dataclasses.dataclass(frozen=True)
class Fp8Section:
    """The FP8 part of a report. Sites are meta paths without `blocks/` and `fp8_`
    (`att/receptance`, ...); arrays are nested lists of floats: `scale[site]` and
    `amax[site]` `[steps][L][3]` (rows input, kernel, output gradient: the scale each
    calibration step quantized with and the amax it recorded), `measured_scale[site]` and
    `measured_amax[site]` `[L][3]` (the report's batch); `gemms` the per-GEMM floors, `not_fp8`
    and `clipped` the checks (module docstring)."""

    meta_source: str
    calibration_steps: int
    calibration_data: str
    skipped_steps: int
    history: int
    sites: tuple[str, ...]
    scale: dict
    amax: dict
    measured_scale: dict
    measured_amax: dict
    float8_dots: int
    expected_float8_dots: int
    gemms: tuple[GemmCheck, ...]
    not_fp8: tuple[NotFp8, ...]
    clipped: tuple[Clipped, ...]


@dataclasses.dataclass
class Calibration:
    """What `calibrate` hands the report: the calibrated metas (the model's pure-dict tree)
    and the section's fields known before the measurement."""

    metas: dict
    meta_source: str
    steps: int
    data: str
    skipped: int
    scale: dict
    amax: dict
    float8_dots: int
    expected_float8_dots: int


def site_name(path) -> str:
    """`("blocks", "att", "fp8_receptance")` (keys or strings) -> `att/receptance`."""
    names = [str(getattr(k, "key", k)) for k in path]
    names = names[1:] if names and names[0] == "blocks" else names
    return "/".join(n[4:] if n.startswith("fp8_") else n for n in names)


def flat_metas(metas) -> list[tuple[str, np.ndarray]]:
    """`(site, float32 [L, 3, 1 + history])` per meta leaf, in tree order (a leaf without a
    layer axis gets one of size 1)."""
    out = []
    for path, meta in jax.tree_util.tree_flatten_with_path(metas)[0]:
        meta = np.asarray(meta, np.float32)
        out.append((site_name(path), meta[None] if meta.ndim == 2 else meta))
    return out


def with_metas(params: dict, metas: dict | None) -> dict:
    """One nested dict of the model's variables: `params` with the metas' `fp8_*` leaves
    merged in (what `nnx.merge` of the model's one-state graphdef takes)."""
    if metas is None:
        return params
    out = dict(params)
    for key, value in metas.items():
        out[key] = with_metas(out[key], value) if isinstance(value, dict) and key in out \
            else value
    return out


def _starting_metas(model, want: dict, given, source: str | None):
    """`(metas, source text, recorded)`: `given` checked against the model's meta tree `want`,
    else the model's own metas when they recorded an amax, else fresh ones."""
    want_flat = {site: tuple(m.shape) for site, m in flat_metas(
        jax.tree.map(lambda a: np.zeros(a.shape, np.float32), want))}
    if given is not None:
        got = dict(flat_metas(given))
        extra = sorted(set(got) - set(want_flat))
        if extra:
            raise ValueError(f"precision report: fp8_metas holds site {extra[0]}, which the "
                             f"model does not; its sites: {', '.join(want_flat)}")
        for site, shape in want_flat.items():
            if site not in got:
                raise ValueError(f"precision report: fp8_metas has no meta for site {site}; "
                                 f"the model's sites: {', '.join(want_flat)}")
            m = got[site]
            if m.shape[:-1] != shape[:-1] or m.shape[-1] < 2:
                raise ValueError(f"precision report: fp8_metas[{site}] has shape {m.shape}, "
                                 f"expected {shape[:-1] + ('1 + history',)}")
        return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), given), \
            source or "the FP8 metas given", True
    own = nnx.to_pure_dict(nnx.state(model, Fp8Meta))
    own_flat = dict(flat_metas(own)) if jax.tree.leaves(own) else {}
    if set(own_flat) == set(want_flat) and any(np.any(m[..., 1:] != 0)
                                               for m in own_flat.values()):
        return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), own), \
            source or "the model's own FP8 metas (recorded amax history)", True
    fresh = jax.tree.map(lambda a: fp8.init_meta(history=a.shape[-1] - 1, stack=a.shape[:-2]),
                         want)
    return fresh, "fresh FP8 metas (scale 1, empty amax history)", False


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"precision report: fp8_calibration_steps must be an integer >= 0, "
                         f"got {steps!r}")
    return int(steps)


def _batches(tokens_BT1, given):
    """`[N, B, T + 1]` int32 calibration batches and their description."""
    if given is None:
        return np.asarray(tokens_BT1, np.int32)[None], "the report's batch at every step"
    batches = np.asarray(given)
    if batches.ndim != 3 or batches.shape[0] < 1 or batches.shape[2] < 2 or \
            not np.issubdtype(batches.dtype, np.integer):
        raise ValueError(f"precision report: fp8_calibration_tokens must be an integer "
                         f"[N, B, T + 1] array with N >= 1 and T >= 1, got shape "
                         f"{batches.shape} dtype {batches.dtype}")
    n, b, t = batches.shape
    return batches.astype(np.int32), f"{n} calibration batches of {b} x {t - 1} tokens, cycled"


def calibrate(model, make: Callable, params: dict, tokens_BT1, *, token_loss: Callable,
              compiler_options: dict, metas: dict | None = None, steps: int | None = None,
              tokens=None, source: str | None = None) -> Calibration:
    """Calibrate the FP8 metas of the model `make()` builds (module docstring).

    Args:
      model: the model studied (its own `Fp8Meta` state is read when `metas` is None).
      make: `() -> model` under the FP8 policy (remat and layer scan off).
      params: its parameter pure dict, in the policy's param dtype.
      tokens_BT1: the report's batch, int `[B, T + 1]`.
      token_loss: `(logits [B, T, V], targets [B, T]) -> float32 [B, T]` cross-entropy.
      compiler_options: XLA options of the report's compilations.
      metas, steps, tokens, source: `precision_report`'s `fp8_metas`,
        `fp8_calibration_steps`, `fp8_calibration_tokens` and `fp8_source`.
    """
    abstract = nnx.eval_shape(make)
    graphdef = nnx.split(abstract)[0]
    want = nnx.to_pure_dict(nnx.state(abstract, Fp8Meta))
    start, origin, recorded = _starting_metas(model, want, metas, source)
    steps = (0 if recorded else CALIBRATION_STEPS) if steps is None else _check_steps(steps)
    batches, data = _batches(tokens_BT1, tokens)
    step = _calibration_step(graphdef, token_loss, compiler_options)
    sites = [s for s, _ in flat_metas(start)]
    scale: dict = {s: [] for s in sites}
    amax: dict = {s: [] for s in sites}
    current, skipped = start, 0
    for i in range(steps):
        current, finite, head = step(params, current, jnp.asarray(batches[i % len(batches)]))
        skipped += int(not bool(finite))
        for site, h in flat_metas(jax.device_get(head)):
            scale[site].append(h[..., 0].tolist())
            amax[site].append(h[..., 1].tolist())
    found = count_float8_dots(graphdef, with_metas(params, start),
                              jnp.asarray(batches[0][:, :-1]))
    expected = sum(m.shape[0] for _, m in flat_metas(start))
    return Calibration(current, origin, steps, data if steps else "none", skipped, scale, amax,
                       found, expected)


def _calibration_step(graphdef, token_loss: Callable, compiler_options: dict):
    """Jitted `(params, metas, tokens [B, T + 1]) -> (new metas, finite, new metas[..., :2])`:
    one forward + backward whose returned metas replace the old ones where the step is finite
    (`fp8.overwrite`, the train step's rule; its guard also fails a non-finite gradient)."""
    def loss(p, m, tokens):
        logits = nnx.merge(graphdef, with_metas(p, m))(tokens[:, :-1])
        return jnp.mean(token_loss(logits, tokens[:, 1:]))

    def step(p, m, tokens):
        value, (grads, returned) = jax.value_and_grad(loss, argnums=(0, 1))(p, m, tokens)
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
        finite = jnp.isfinite(value) & jnp.isfinite(sq) & fp8.all_finite(returned)
        new = fp8.overwrite(m, returned, finite)
        return new, finite, jax.tree.map(lambda a: a[..., :2], new)
    return jax.jit(step, compiler_options=compiler_options)


def count_float8_dots(graphdef, variables: dict, inputs_BT) -> int:
    """dot_generals of the model's traced forward (sub-jaxprs included) whose operands are
    all float8: one per FP8 GEMM site and layer in `Policy.einsum`'s default form."""
    jaxpr = jax.make_jaxpr(lambda v, t: nnx.merge(graphdef, v)(t))(variables, inputs_BT)
    return fp8.float8_dots(jaxpr.jaxpr)


def gemm_checks(family, rows, ctx) -> tuple[GemmCheck, ...]:
    """A `GemmCheck` per FP8 GEMM row of `rows`: its e4m3 floor is the row's; its
    compute-dtype floor comes from the same sub-op on a copy of the measurement's `Context`
    (`subops.Context`) whose policy runs no FP8."""
    plain = dataclasses.replace(ctx, policy=dataclasses.replace(ctx.policy, gemm="compute"),
                                memo={})
    ops = {op.name: op for op in family.fp8_subops}
    out = []
    for site, name in family.fp8_gemms:
        for r in (r for r in rows if r.subop == name):
            local = ops[name].local(plain, r.layer)
            floor = _rel(local.floor, local.ref)
            fp8_run = not math.isfinite(r.local_rel) or \
                r.local_rel >= math.sqrt(r.floor_rel * floor)
            out.append(GemmCheck(site, r.layer, r.local_rel, r.floor_rel, floor, fp8_run))
    return tuple(out)


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = float(np.linalg.norm(ref))
    return 0.0 if den == 0 else float(np.linalg.norm(x - ref)) / den


def section(cal: Calibration, family, rows, returned: dict, ctx) -> Fp8Section:
    """The report's FP8 section from the calibration, the family (`subops.Family`: its FP8
    sub-ops and sites), the measured rows (`Row`s), the metas the measured batch's backward
    returned and the measurement's `Context`."""
    flat = sorted(flat_metas(returned), key=lambda sm: _order(family, sm[0]))
    problems: dict[tuple, list[str]] = {}
    for site, meta in flat:
        for layer in range(meta.shape[0]):
            if not np.any(meta[layer]):
                problems.setdefault((site, layer), []).append(
                    "its meta came back all zeros: no product read it")
    gemms = gemm_checks(family, rows, ctx)
    for g in gemms:
        if not g.fp8:
            problems.setdefault((g.site, g.layer), []).append(
                f"local error {g.local_rel:.1e} sits at its {ctx.compute_dtype.name} floor "
                f"{g.compute_floor_rel:.1e}, not its e4m3 floor {g.fp8_floor_rel:.1e}")
    not_fp8 = [NotFp8(site, layer, "; ".join(why))
               for (site, layer), why in sorted(problems.items(),
                                                key=lambda kv: (kv[0][1], _order(family,
                                                                                 kv[0][0])))]
    if cal.float8_dots < cal.expected_float8_dots:
        not_fp8.append(NotFp8("traced forward", None, f"{cal.float8_dots} products of float8 "
                              f"operands for {cal.expected_float8_dots} FP8 GEMM site-layers"))
    clipped = []
    for site, meta in flat:
        for layer in range(meta.shape[0]):
            for row, name in enumerate(fp8.ROWS):
                s, a = float(meta[layer, row, 0]), float(meta[layer, row, 1])
                if s > 0 and a > FORMAT_MAX[row] * s:
                    clipped.append(Clipped(site, layer, name, a, FORMAT_MAX[row] * s))
    return Fp8Section(cal.meta_source, cal.steps, cal.data, cal.skipped,
                      int(flat[0][1].shape[-1] - 1) if flat else 0, tuple(s for s, _ in flat),
                      cal.scale, cal.amax, {s: m[..., 0].tolist() for s, m in flat},
                      {s: m[..., 1].tolist() for s, m in flat}, cal.float8_dots,
                      cal.expected_float8_dots, gemms, tuple(not_fp8), tuple(clipped))


def _order(family, site: str) -> int:
    """A site's place in the family's FP8 GEMM order (execution order), unknown sites last."""
    order = [s for s, _ in family.fp8_gemms]
    return order.index(site) if site in order else len(order)


def is_fp8_row(subop: str, family) -> bool:
    """Whether a sub-op's error under an FP8 policy is its FP8 GEMMs' e4m3 rounding: a GEMM
    site's op or one of `family.fp8_spans` (RWKV-7's `ffn`: both ChannelMix GEMMs)."""
    return subop in {op for _, op in family.fp8_gemms} or subop in family.fp8_spans


# ------------------------------------------------------------------------------- output
def _pow2(x: float) -> str:
    if x > 0 and math.isfinite(x) and math.log2(x) == round(math.log2(x)):
        return f"2^{round(math.log2(x))}"
    return f"{x:.3g}"


def _range(values) -> str:
    lo, hi = min(values), max(values)
    return _pow2(lo) if lo == hi else f"{_pow2(lo)}..{_pow2(hi)}"


def format_lines(sec: Fp8Section) -> list[str]:
    """The table's FP8 summary: the metas' origin and calibration, per site the range of the
    scales the report's batch used (over layers, per row) and the largest amax seen
    (calibration steps and the batch), then the checks."""
    steps = (f"{sec.calibration_steps} calibration steps ({sec.skipped_steps} skipped) on "
             f"{sec.calibration_data}" if sec.calibration_steps else "no calibration steps")
    lines = [f"FP8 GEMMs: metas: {sec.meta_source}; {steps}; amax history {sec.history}",
             f"float8 products in the traced forward: {sec.float8_dots} for "
             f"{sec.expected_float8_dots} FP8 GEMM site-layers",
             f"{'site':<16} {'input scale':>16} {'kernel scale':>16} {'grad scale':>16}  "
             "largest amax"]
    for site in sec.sites:
        scales = np.asarray(sec.measured_scale[site], np.float64)
        amaxes = np.concatenate([np.asarray(sec.amax[site], np.float64).reshape(-1, 3),
                                 np.asarray(sec.measured_amax[site], np.float64)])
        layers = np.asarray(sec.measured_amax[site]).shape[0]
        i = int(np.argmax(amaxes))
        where = f"layer {(i // 3) % layers} {fp8.ROWS[i % 3]}"
        lines.append(f"{site:<16} " + " ".join(f"{_range(scales[:, r].tolist()):>16}"
                                                for r in range(3))
                     + f"  {amaxes.flat[i]:.3g} ({where})")
    if sec.not_fp8:
        lines += [f"NOT FP8: {n.site}" + ("" if n.layer is None else f" layer {n.layer}")
                  + f": {n.why}" for n in sec.not_fp8]
    else:
        lines.append("every GEMM meant to be FP8 ran as FP8 (every meta read, no local error "
                     "at its compute-dtype floor)")
    lines += [f"clipped: {c.site} layer {c.layer} {c.row}: amax {c.amax:.3g} > {c.limit:.3g} "
              "(format max x scale)" for c in sec.clipped]
    return lines


def advice(where: str, local_rel: float) -> str:
    """The `policy`-kind suggestion when the largest local error is an FP8 GEMM's."""
    return (f"every sub-op is within this policy's precision; the largest local error is "
            f"{where} at {local_rel:.1e}, the e4m3 rounding of its FP8 operands (3 mantissa "
            "bits): bf16-mixed runs the block GEMMs in bf16 (about 20x smaller error)")
