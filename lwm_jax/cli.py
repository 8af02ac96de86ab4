"""`lwm-jax` command line.

    lwm-jax train                                   # tiny byte-level model on the built-in corpus
    lwm-jax train --config configs/rwkv7-0.1b.yaml train.lr=3e-4 precision=bf16-mixed
    lwm-jax prepare --input docs/ --output data/mydata --tokenizer world
    lwm-jax convert --input RWKV-x070-World-0.1B.pth --output ckpt/0.1b
    lwm-jax export --input ckpt/0.1b --output out.pth --format rwkv-pth
    lwm-jax generate --checkpoint ckpt/0.1b --prompt "The capital of France is"
    lwm-jax eval --checkpoint ckpt/0.1b --data book.txt --lambada lambada.jsonl

`train` takes dotted `key=value` overrides after the options (values are parsed as YAML).
Bad input is reported as one line (`error: train.lrr: unknown key; valid keys: ...`) with exit
status 2; set LWM_JAX_DEBUG=1 to get the Python traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def _train(args: argparse.Namespace) -> int:
    from lwm_jax.train.compile_cache import enable_compilation_cache
    from lwm_jax.train.config import load_config
    from lwm_jax.train.trainer import train

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    enable_compilation_cache()              # before the first compilation
    result = train(cfg, progress=not args.no_progress, stop_after=args.stop_after)
    if result.stopped_by == "non-finite":
        print(f"lwm-jax train: error: {result.diagnosis}", file=sys.stderr)
        return 3
    if result.stopped_by == "complete":
        return 0
    if result.stopped_by in ("SIGINT", "SIGTERM"):   # the trainer said where it checkpointed
        return 130 if result.stopped_by == "SIGINT" else 143
    val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
    print(f"lwm-jax train: step {result.step}, validation loss {val}, run dir {result.run_dir}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from lwm_jax.data.prepare import run_prepare
    return run_prepare(args)


def build_parser() -> argparse.ArgumentParser:
    from lwm_jax.data.prepare import add_prepare_args

    parser = argparse.ArgumentParser(prog="lwm-jax", description="RWKV-7 in JAX: train, prepare, convert, export, generate, eval")
    sub = parser.add_subparsers(dest="command", required=True)

    tr = sub.add_parser("train", help="train (or resume) a model",
                        description="Train an RWKV-7 model. With no --config: the tiny "
                                    "byte-level model on the built-in corpus. Rerunning the "
                                    "same command resumes from the newest checkpoint.")
    tr.add_argument("--config", "-c", default=None, metavar="YAML",
                    help="run config (default: the built-in tiny config, = configs/tiny.yaml)")
    tr.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="dotted overrides, e.g. train.lr=3e-4 model.n_layer=4 precision=bf16")
    tr.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="run at most N steps now, checkpoint and exit (resume later)")
    tr.add_argument("--print-config", action="store_true",
                    help="print the resolved config as YAML and exit")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=_train)

    pr = sub.add_parser("prepare", help="tokenise .txt/.jsonl files into a binidx dataset")
    add_prepare_args(pr)
    pr.set_defaults(func=_prepare)

    # (name, help, module, add-arguments function, main function); imported lazily on use
    for name, help_text, module, add_fn, main_fn in (
        ("convert", "import an official .pth or FLA/HF checkpoint as an lwm_jax checkpoint",
         "lwm_jax.interop.cli", "add_convert_args", "convert_main"),
        ("export", "export a checkpoint to the official .pth or FLA/HF format",
         "lwm_jax.interop.cli", "add_export_args", "export_main"),
        ("generate", "sample text from a checkpoint (RNN-mode decoding)",
         "lwm_jax.generate.cli", "add_generate_args", "generate_main"),
        ("eval", "perplexity / bits-per-byte and LAMBADA-style accuracy",
         "lwm_jax.eval.cli", "add_eval_args", "eval_main"),
    ):
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(mod, add_fn)(p)
        p.set_defaults(func=_returns_zero(getattr(mod, main_fn)))
    return parser


def _returns_zero(main_fn):
    """Adapt a subcommand main that returns a result (or None) to an exit status of 0."""
    def run(args: argparse.Namespace) -> int:
        main_fn(args)
        return 0
    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "stop_after", None) is not None and args.stop_after < 1:
        parser.error(f"--stop-after: must be >= 1, got {args.stop_after}")
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        if os.environ.get("LWM_JAX_DEBUG"):
            raise
        print(f"lwm-jax {args.command}: error: {e}  (LWM_JAX_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
