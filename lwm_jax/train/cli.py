"""`lwm-jax train`: the entry point (arguments: `lwm_jax.cli.args.add_train_args`).

Loads and validates the config, checks the run directories, the memory and the data's recorded
tokenizer before anything is allocated, then calls `lwm_jax.train.trainer.train`.
"""
from __future__ import annotations

import argparse
import os
import sys

from lwm_jax.user_input import check_config_path, check_output_dir, load_yaml_file, one_line


def train_main(args: argparse.Namespace) -> int:
    """`lwm-jax train`: load + validate the config; check the run directories, the memory and
    the data's recorded tokenizer before anything is allocated; then train. Returns the exit
    status (3 when training diverged, 130 / 143 when SIGINT / SIGTERM stopped it after its
    checkpoint); raises ValueError (one line) for bad input."""
    from lwm_jax.train.config import load_config

    check_config_path(args.config)
    # --print-config shows the resolved config only: the data need not exist yet
    cfg = load_config(args.config, args.overrides, data_files=not args.print_config)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from lwm_jax.train.distributed import initialize_from_env, is_primary
    initialize_from_env()                   # a multi-process launch: before any device use
    _check_run_dirs(cfg)
    if args.compiled is not None:          # a wrong file is refused before the run dir is used
        import jax

        from lwm_jax.train.saved_step import check_header, read_header
        check_header(read_header(args.compiled)[0], args.compiled, cfg, jax.devices())
    from lwm_jax.train.preflight import check_memory_on_devices
    check_memory_on_devices(cfg)
    from lwm_jax.train.batches import check_tokenizer_record
    for key, prefix in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if prefix is not None:          # fail before the model is built (load_splits re-checks)
            check_tokenizer_record(key, prefix, cfg.data.tokenizer, None)
    from lwm_jax.train.compile_cache import enable_compilation_cache
    from lwm_jax.train.trainer import train

    enable_compilation_cache()              # before the first compilation
    result = train(cfg, progress=not args.no_progress, stop_after=args.stop_after,
                   compiled=args.compiled)
    if result.stopped_by == "non-finite":
        print(f"lwm-jax train: error: {one_line(result.diagnosis, 2000)}", file=sys.stderr)
        return 3
    if result.stopped_by == "complete":                # the trainer said so; nothing written
        return 0
    if result.stopped_by in ("SIGINT", "SIGTERM"):   # the trainer said where it checkpointed
        return 130 if result.stopped_by == "SIGINT" else 143
    val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
    if is_primary():
        print(f"lwm-jax train: step {result.step}, validation loss {val}, "
              f"run dir {result.run_dir}")
    return 0


def _check_run_dirs(cfg) -> None:
    """Refuse unusable run/checkpoint directories and a damaged saved `config.yaml` (which the
    trainer compares against before resuming) with one line each."""
    check_output_dir(cfg.resolved_run_dir, "run_dir")
    check_output_dir(cfg.checkpoint_dir, "checkpoint.dir")
    saved = os.path.join(cfg.resolved_run_dir, "config.yaml")
    if os.path.isfile(saved) and os.path.isdir(cfg.checkpoint_dir):
        doc = load_yaml_file(saved, f"run_dir: {saved}")
        if not isinstance(doc, dict):
            raise ValueError(f"run_dir: {saved} should hold the run's config mapping but holds a "
                             f"{type(doc).__name__}; restore it or choose a new run_dir")
