"""`lwm-jax precision-report` once the model exists: choose the batch, warm an initialised
model, run the report, print the table and write `report.json` + `heatmap.png`.

`lwm_jax.cli.precision_report.precision_report_main` builds the model (a run config at its initialisation, or a
checkpoint) and calls `run_report(model, args, policy)`; building lives there because this
package sits below the model and training packages.

Which model is studied: a checkpoint as loaded; an initialisation warmed by `--seed`
(`lwm_jax.diagnostics.warm`: a freshly initialised RWKV-7 has zero output and FFN value
projections, whose products are exact in any precision, so its report would call those ops
exact where a trained model's lose the policy's precision), or with `--no-warm` as built. The
table's header, `report.json`'s `model_source` and the heat map's title say which.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from lwm_jax.precision import parse_policy
from lwm_jax.user_input import check_output_dir

MAX_TOKENS = 1 << 16          # batch_size * seq_len: the report keeps every tap of every layer
MAX_SEED = 2**63              # NumPy's generators take any non-negative int; kept to int64


def check_args(args: argparse.Namespace) -> None:
    """One-line ValueErrors for impossible sizes and seeds, unknown policies, an unusable output
    directory and options that do not apply (before anything is built)."""
    for flag, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    if not 0 <= args.seed < MAX_SEED:
        raise ValueError(f"--seed: must be an integer in [0, 2**63), got {args.seed}; give a "
                         "non-negative seed such as 0")
    if args.checkpoint is not None and args.no_warm:
        raise ValueError("--no-warm: a checkpoint is studied as loaded, never warmed; drop "
                         "--no-warm")
    steps = getattr(args, "fp8_calibration_steps", None)
    if steps is not None and steps < 0:
        raise ValueError(f"--fp8-calibration-steps: must be >= 0, got {steps}; give the number "
                         "of forward + backward steps that calibrate the FP8 scales (e.g. 8)")
    if args.checkpoint is None and args.format is not None:
        raise ValueError(f"--format {args.format}: names a checkpoint's format; give "
                         "--checkpoint PATH or drop --format")
    if not args.output:
        raise ValueError("--output: empty path; give a directory, e.g. -o precision_report")
    if args.batch_size * args.seq_len > MAX_TOKENS:
        raise ValueError(f"--batch-size x --seq-len = {args.batch_size * args.seq_len} tokens; "
                         f"the report holds every layer's intermediate values, keep it <= "
                         f"{MAX_TOKENS}")
    parsed = {}
    for flag, spec in (("--policy", args.policy), ("--shadow", args.shadow)):
        if spec is not None and not (flag == "--shadow" and spec == "none"):
            try:
                parsed[flag] = parse_policy(spec)
            except ValueError as err:
                raise ValueError(f"{flag}: {err}") from None
    if "--shadow" in parsed and parsed["--shadow"].fp8:
        raise ValueError(f"--shadow {args.shadow}: has FP8 GEMMs; the reference must compute "
                         "more precisely than the policy examined (e.g. --shadow fp32)")
    if steps is not None and "--policy" in parsed and not parsed["--policy"].fp8:
        raise ValueError(f"--fp8-calibration-steps: applies to an FP8 policy (fp8-mixed, "
                         f"g=fp8), not {args.policy!r}; drop it")
    check_output_dir(args.output, "--output")


def report_tokens(vocab_size: int, data: str, batch_size: int, seq_len: int,
                  seed: int) -> tuple[np.ndarray, dict]:
    """`(tokens [B, T + 1] int32, description)`: random windows of the embedded byte-level
    corpus's validation split, or uniform random tokens, both from `seed`."""
    if data == "auto":
        data = "corpus" if vocab_size == 256 else "random"
    rng = np.random.default_rng(seed)
    if data == "random":
        tokens = rng.integers(0, vocab_size, (batch_size, seq_len + 1))
        return tokens.astype(np.int32), {"data": "random", "seed": seed}
    if vocab_size != 256:
        raise ValueError(f"--data corpus: the embedded corpus is byte-level (256 ids) but the "
                         f"model's vocab_size is {vocab_size}; use --data random")
    from lwm_jax.data.corpus import stdlib_corpus

    _, val = stdlib_corpus()
    if len(val) < seq_len + 2:
        raise ValueError(f"--seq-len {seq_len}: the corpus's validation split holds only "
                         f"{len(val)} tokens; use a shorter --seq-len")
    starts = rng.integers(0, len(val) - seq_len - 1, batch_size)
    tokens = np.stack([np.asarray(val[s:s + seq_len + 1]) for s in starts])
    return tokens.astype(np.int32), {"data": "corpus (byte-level stdlib, validation split)",
                                     "seed": seed}


def _config_name(args: argparse.Namespace) -> str:
    name = f"config {args.config}" if args.config else "the built-in tiny config"
    return name + (f" with {' '.join(args.overrides)}" if args.overrides else "")


def prepare_model(model, args: argparse.Namespace,
                  source: str | None = None) -> tuple[str, tuple[str, ...]]:
    """Warm `model` in place unless it is a checkpoint (`args.checkpoint`) or `--no-warm`;
    returns `(model source, warmed parameter paths)`. `source` describes a checkpoint (e.g. its
    step); default `checkpoint <path>`."""
    if args.checkpoint is not None:
        fmt = f" ({args.format})" if args.format else ""
        return source or f"checkpoint {args.checkpoint}{fmt}", ()
    if args.no_warm:
        return (f"fresh initialisation of {_config_name(args)}, not warmed (zero-initialised "
                "projections measure as exact)"), ()
    from lwm_jax.diagnostics.warm import warm_params

    warmed = warm_params(model, args.seed)
    return (f"warmed initialisation of {_config_name(args)} (seed {args.seed}): {len(warmed)} "
            f"zero- or constant-initialised parameters drawn at a trained-like scale, listed in "
            f"report.json; --checkpoint RUN_DIR studies a trained model"), warmed


def fp8_calibration(args: argparse.Namespace, policy: str, vocab_size: int,
                    recorded: bool) -> tuple[dict, dict]:
    """`precision_report`'s FP8 keywords for `policy` (empty for a policy without FP8) and what
    `report.json`'s batch records of them. Calibration batches are drawn as the report's batch
    is, from seeds `--seed + 1`, `--seed + 2`, ... (so no step sees the measured batch); their
    number is `--fp8-calibration-steps`, by default `CALIBRATION_STEPS`, or 0 when the metas
    were `recorded` (a training run's)."""
    steps = getattr(args, "fp8_calibration_steps", None)
    if not parse_policy(policy).fp8:
        if steps is not None:
            raise ValueError(f"--fp8-calibration-steps: applies to an FP8 policy (fp8-mixed, "
                             f"g=fp8), not {policy!r}; drop it")
        return {}, {}
    from lwm_jax.diagnostics.precision_fp8 import CALIBRATION_STEPS

    steps = (0 if recorded else CALIBRATION_STEPS) if steps is None else steps
    if steps == 0:
        return {"fp8_calibration_steps": 0}, {"fp8_calibration": "none"}
    batches = np.stack([report_tokens(vocab_size, args.data, args.batch_size, args.seq_len,
                                      args.seed + 1 + i)[0] for i in range(steps)])
    return ({"fp8_calibration_steps": steps, "fp8_calibration_tokens": batches},
            {"fp8_calibration": f"{steps} batches drawn as this one, seeds {args.seed + 1}.."
                                f"{args.seed + steps}"})


def run_report(model, args: argparse.Namespace, policy: str, source: str | None = None,
               fp8_metas: dict | None = None, fp8_source: str | None = None) -> int:
    """Report on `model` (warmed first, see `prepare_model`) under `policy` with the batch and
    outputs `args` name; prints the table and the paths written. `fp8_metas` / `fp8_source`:
    an FP8 policy's starting metas and where they came from (a training run's), or None.
    Returns 0, or 3 when the policy run produced a non-finite value."""
    from lwm_jax.diagnostics.precision_plot import plot_heatmap
    from lwm_jax.diagnostics.precision_report import format_table, precision_report, write_json

    fp8_kw, fp8_info = fp8_calibration(args, policy, model.cfg.vocab_size,
                                       fp8_metas is not None)
    if fp8_metas is not None and fp8_kw:
        fp8_kw.update(fp8_metas=fp8_metas, fp8_source=fp8_source)
    tokens, info = report_tokens(model.cfg.vocab_size, args.data, args.batch_size,
                                 args.seq_len, args.seed)
    model_source, warmed = prepare_model(model, args, source)
    report = precision_report(model, tokens, policy, shadow=args.shadow,
                              gradients=not args.no_gradients, batch_info={**info, **fp8_info},
                              model_source=model_source, warmed=warmed, **fp8_kw)
    print(format_table(report))
    os.makedirs(args.output, exist_ok=True)
    json_path = os.path.join(args.output, "report.json")
    write_json(report, json_path)
    png = plot_heatmap(report, os.path.join(args.output, "heatmap.png"))
    print(f"wrote {json_path} and {png}")
    return 3 if report.worst.kind == "nonfinite" else 0
