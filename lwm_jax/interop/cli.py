"""`lwm-jax convert` and `lwm-jax export`: argparse setup and entry points (wired by the lead).

    lwm-jax convert --input RWKV-x070-World-0.1B.pth --output ckpt/0.1b   # config.yaml + params/
    lwm-jax export --input ckpt/0.1b --output out/model.pth --format rwkv-pth   # bf16 by default
    lwm-jax export --input ckpt/0.1b --output out/hf-model --format hf [--dtype bf16]
"""
from __future__ import annotations

import argparse

from lwm_jax.interop.api import EXPORT_FORMATS, FORMATS, convert, export


def add_convert_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--input", "-i", required=True,
                   help="official .pth file, HF directory or training run directory")
    p.add_argument("--output", "-o", required=True, dest="output_dir",
                   help="new directory for config.yaml + params/")
    p.add_argument("--format", default=None, choices=FORMATS, help="input format (default: detect)")
    return p


def convert_main(args: argparse.Namespace) -> None:
    out = convert(args.input, args.output_dir, format=args.format)
    print(f"wrote {out}")


def add_export_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--input", "-i", required=True, help="any checkpoint load_pretrained reads")
    p.add_argument("--output", "-o", required=True,
                   help=".pth file (rwkv-pth) or directory (hf)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    p.add_argument("--dtype", default=None, choices=("bf16", "f32"),
                   help="stored dtype (default: bf16 for rwkv-pth, f32 for hf)")
    p.add_argument("--input-format", default=None, choices=FORMATS)
    p.add_argument("--max-shard-mb", type=int, default=None, help="hf: split weights into shards")
    return p


def export_main(args: argparse.Namespace) -> None:
    shard = args.max_shard_mb * 2**20 if args.max_shard_mb else None
    out = export(args.input, args.output, format=args.format, dtype=args.dtype,
                 input_format=args.input_format, max_shard_bytes=shard)
    print(f"wrote {out}")
