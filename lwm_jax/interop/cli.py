"""`lwm-jax convert` and `lwm-jax export`: entry points (arguments: `lwm_jax.cli.args`).

    lwm-jax convert --input RWKV-x070-World-0.1B.pth --output ckpt/0.1b   # config.yaml + params/
    lwm-jax export --input ckpt/0.1b --output out/model.pth --format rwkv-pth   # bf16 by default
    lwm-jax export --input ckpt/0.1b --output out/hf-model --format hf [--dtype bf16]
"""
from __future__ import annotations

import argparse

from lwm_jax.interop.orbax_files import shown

__all__ = ["convert_main", "export_main"]


def convert_main(args: argparse.Namespace) -> None:
    """Run `lwm-jax convert` (see `lwm_jax.interop.api.convert` for what it raises)."""
    from lwm_jax.interop.api import convert
    out = convert(args.input, args.output_dir, format=args.format)
    print(f"wrote {shown(out)}")     # a path that is not UTF-8 prints as \xNN, never raises


def export_main(args: argparse.Namespace) -> None:
    """Run `lwm-jax export` (see `lwm_jax.interop.api.export` for what it raises)."""
    from lwm_jax.interop.api import export
    if args.max_shard_mb is not None and args.max_shard_mb < 1:
        raise ValueError(f"--max-shard-mb: must be >= 1, got {args.max_shard_mb}")
    shard = args.max_shard_mb * 2**20 if args.max_shard_mb else None
    out = export(args.input, args.output, format=args.format, dtype=args.dtype,
                 input_format=args.input_format, max_shard_bytes=shard)
    print(f"wrote {shown(out)}")
