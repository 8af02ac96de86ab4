"""`lwm-jax precision-report` once the model exists: choose the batch, run the report, print
the table and write `report.json` + `heatmap.png`.

`lwm_jax.cli.precision_report_main` builds the model (a run config at its initialisation, or a
checkpoint) and calls `run_report(model, args)`; building lives there because this package sits
below the model and training packages.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from lwm_jax.precision import parse_policy
from lwm_jax.user_input import check_output_dir

MAX_TOKENS = 1 << 16          # batch_size * seq_len: the report keeps every tap of every layer


def check_args(args: argparse.Namespace) -> None:
    """One-line ValueErrors for impossible sizes, unknown policies and an unusable output
    directory (before anything is built)."""
    for flag, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    if args.batch_size * args.seq_len > MAX_TOKENS:
        raise ValueError(f"--batch-size x --seq-len = {args.batch_size * args.seq_len} tokens; "
                         f"the report holds every layer's intermediate values, keep it <= "
                         f"{MAX_TOKENS}")
    for flag, spec in (("--policy", args.policy), ("--shadow", args.shadow)):
        if spec is not None and not (flag == "--shadow" and spec == "none"):
            try:
                parse_policy(spec)
            except ValueError as err:
                raise ValueError(f"{flag}: {err}") from None
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


def run_report(model, args: argparse.Namespace, policy: str) -> int:
    """Report on `model` under `policy` with the batch and outputs `args` name; prints the table
    and the paths written. Returns 0, or 3 when the policy run produced a non-finite value."""
    from lwm_jax.diagnostics.precision_plot import plot_heatmap
    from lwm_jax.diagnostics.precision_report import format_table, precision_report, write_json

    tokens, info = report_tokens(model.cfg.vocab_size, args.data, args.batch_size,
                                 args.seq_len, args.seed)
    report = precision_report(model, tokens, policy, shadow=args.shadow,
                              gradients=not args.no_gradients, batch_info=info)
    print(format_table(report))
    os.makedirs(args.output, exist_ok=True)
    json_path = os.path.join(args.output, "report.json")
    write_json(report, json_path)
    png = plot_heatmap(report, os.path.join(args.output, "heatmap.png"))
    print(f"wrote {json_path} and {png}")
    return 3 if report.worst.kind == "nonfinite" else 0
