"""`lwm-jax precision-report`: build the model studied, then hand it to the diagnostics.

Building lives here, above the model, training and interop packages: the diagnostics package
sits below them (the trainer and the models import its probes), so it cannot build a model.
"""
from __future__ import annotations

import argparse

from lwm_jax.user_input import check_config_path


def precision_report_main(args: argparse.Namespace) -> int:
    """`lwm-jax precision-report`: the model from `--checkpoint`, or a run config's model at
    its initialisation (seed `train.seed`), then `lwm_jax.diagnostics.report_cli.run_report`.
    Returns 0, or 3 when the examined policy produced a non-finite value."""
    from lwm_jax.diagnostics.report_cli import check_args, run_report

    check_args(args)
    if args.checkpoint is not None:
        if args.overrides:
            raise ValueError(f"precision-report: {args.overrides[0]!r}: KEY=VALUE overrides "
                             "apply to --config only; drop them or use --config")
        from lwm_jax.interop.api import load_pretrained
        model, _ = load_pretrained(args.checkpoint, args.format)
        return run_report(model, args, args.policy or "bf16-mixed")
    from flax import nnx

    from lwm_jax.models.registry import get_arch
    from lwm_jax.train.config import load_config
    check_config_path(args.config)
    cfg = load_config(args.config, args.overrides, data_files=False)   # the model only
    model = get_arch(cfg.arch).model_cls(cfg.model, cfg.precision, runtime=cfg.runtime,
                                         rngs=nnx.Rngs(cfg.train.seed))
    return run_report(model, args, args.policy or cfg.precision)
