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
        from lwm_jax.precision import parse_policy
        model, _ = load_pretrained(args.checkpoint, args.format)
        policy = args.policy or "bf16-mixed"
        metas, where = (checkpoint_fp8_metas(args.checkpoint, args.format)
                        if parse_policy(policy).fp8 else (None, None))
        return run_report(model, args, policy, fp8_metas=metas, fp8_source=where)
    from flax import nnx

    from lwm_jax.diagnostics.precision_report import family_of_class
    from lwm_jax.models.registry import get_arch
    from lwm_jax.train.config import load_config
    check_config_path(args.config)
    cfg = load_config(args.config, args.overrides, data_files=False)   # the model only
    model_cls = get_arch(cfg.arch).model_cls
    family_of_class(model_cls)        # a family without a sub-op table: refused before the init
    model = model_cls(cfg.model, cfg.precision, runtime=cfg.runtime,
                      rngs=nnx.Rngs(cfg.train.seed))
    return run_report(model, args, args.policy or cfg.precision)


def checkpoint_fp8_metas(path: str, fmt: str | None) -> tuple[dict | None, str | None]:
    """`(metas, description)`: the FP8 scaling state (`TrainState.fp8`, float32 NumPy
    `[L, 3, 1 + history]` arrays) of the newest complete step of the training run directory
    `path`, the step its parameters are read from; `(None, None)` when `path` is no run
    directory or its state holds none (a run under a policy without FP8). One-line ValueError
    when orbax cannot restore it."""
    from lwm_jax.interop import run_ckpt
    if fmt not in (None, "run") or not run_ckpt.is_run_dir(path):
        return None, None
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from lwm_jax.interop.orbax_files import restore_detail, utf8_path
    step = run_ckpt.complete_steps(path)[-1]
    state_dir = (run_ckpt.checkpoint_dir(path) / str(step) / "state").absolute()
    with utf8_path(state_dir, "--checkpoint") as view:
        try:
            tree = ocp.PyTreeCheckpointHandler().metadata(view)     # the tree's, no step's
            if "fp8" not in tree:
                return None, None
            target = {"fp8": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, np.float32),
                                          dict(tree["fp8"]))}
            restore_args = jax.tree.map(
                lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32), target)
            out = ocp.PyTreeCheckpointer().restore(
                view, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                  partial_restore=True))
        except Exception as err:     # orbax/tensorstore raise many types for a damaged step
            raise ValueError(f"--checkpoint {path}: orbax cannot restore the FP8 scales of "
                             f"step {step} ({restore_detail(err)})") from None
    return out["fp8"], f"checkpoint {path} step {step} (the run's saved FP8 scales)"
