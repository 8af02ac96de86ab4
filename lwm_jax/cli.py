"""`lwm-jax` command line.

    lwm-jax train                                   # tiny byte-level model on the built-in corpus
    lwm-jax train --config configs/rwkv7-0.1b.yaml train.lr=3e-4 precision=bf16-mixed
    lwm-jax prepare --input docs/ --output data/mydata --tokenizer world
    lwm-jax convert --input RWKV-x070-World-0.1B.pth --output ckpt/0.1b
    lwm-jax export --input ckpt/0.1b --output out.pth --format rwkv-pth
    lwm-jax generate --checkpoint ckpt/0.1b --prompt "The capital of France is"
    lwm-jax eval --checkpoint ckpt/0.1b --data book.txt --lambada lambada.jsonl
    lwm-jax precision-report --policy bf16-mixed model.n_layer=2    # where precision is lost

`train` takes dotted `key=value` overrides after the options (values are parsed as YAML).
Arguments are defined in `lwm_jax.cli_args` (light); only the chosen subcommand's module is
imported. Every problem is reported as ONE line on stderr:

  status 0  success
  status 1  internal error (a bug): one line plus the path of a crash log holding the traceback
  status 2  bad input or environment, e.g. `lwm-jax train: error: train.lrr: unknown key; ...`
            (also argparse usage errors): a wrong value, a damaged file, a path that cannot be
            written, a full disk, a missing optional dependency, a model too large for memory
  status 3  non-finite result: training stopped on NaN/inf, or `eval` computed a NaN/inf loss
  status 130 interrupted (Ctrl-C outside training; `train` handles signals itself)

Set LWM_DEBUG=1 (or LWM_JAX_DEBUG=1) to get the Python traceback instead of the one line.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys

from lwm_jax.cli_args import COMMANDS, DESCRIPTIONS, HelpFormatter
from lwm_jax.diagnostics.report_args import DESCRIPTION as REPORT_DESCRIPTION
from lwm_jax.diagnostics.report_args import HELP as REPORT_HELP
from lwm_jax.diagnostics.report_args import add_precision_report_args
from lwm_jax.user_input import (check_output_dir, ignore_closed_event_loop_noise, load_yaml_file,
                                one_line, quote_path)

DEBUG_VARS = ("LWM_DEBUG", "LWM_JAX_DEBUG")


# ------------------------------------------------------------------------------------ train
def check_config_path(path: str | None) -> None:
    """Refuse (one line) a `--config` that exists but is not a regular file or directory (a
    FIFO would block the read; `load_config` would call it "not found")."""
    if path is not None and os.path.exists(path) and not os.path.isfile(path) \
            and not os.path.isdir(path):
        raise ValueError(f"--config: {quote_path(path)} is not a regular file (a FIFO, device "
                         "or socket); give a YAML file")


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


# ------------------------------------------------------------------------ precision-report
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


# Subcommands whose light argument modules live beside their implementation.
EXTRA_COMMANDS = (
    ("precision-report", REPORT_HELP, "lwm_jax.cli", "precision_report_main",
     add_precision_report_args),
)


# ----------------------------------------------------------------------------------- parser
class Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (`lwm-jax generate: error: ...; see --help`)
    instead of the usage block plus the error; exit status 2 as usual."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


class _Entry:
    """Imports `module` and calls `function(args)` only when the subcommand runs; an int result
    is the exit status, anything else (None, ids, a results dict) means 0."""

    def __init__(self, module: str, function: str):
        self.module, self.function = module, function

    def __call__(self, args: argparse.Namespace) -> int:
        status = getattr(importlib.import_module(self.module), self.function)(args)
        return status if isinstance(status, int) and not isinstance(status, bool) else 0


def build_parser() -> argparse.ArgumentParser:
    """The `lwm-jax` parser with every subcommand; imports no subcommand implementation."""
    parser = Parser(
        prog="lwm-jax", formatter_class=HelpFormatter,
        description="Long-context language models in JAX (RWKV-7, LLaMA-style, hybrids): "
                    "train, prepare, convert, export, generate, eval, compile",
        epilog="Errors are one line on stderr: exit status 2 bad input, 3 non-finite result,\n"
               "1 internal error (with a crash log). LWM_DEBUG=1 shows tracebacks.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    descriptions = {**DESCRIPTIONS, "precision-report": REPORT_DESCRIPTION}
    for name, help_text, module, function, add_args in COMMANDS + EXTRA_COMMANDS:
        p = sub.add_parser(name, help=help_text, description=descriptions.get(name, help_text),
                           formatter_class=HelpFormatter)
        add_args(p)
        p.set_defaults(func=_Entry(module, function))
    return parser


# ----------------------------------------------------------------------------------- errors
_OS_HINTS = {
    errno.ENOSPC: "no space left on device; free some space or write somewhere else",
    errno.EDQUOT: "disk quota exceeded; free some space or write somewhere else",
    errno.EACCES: "permission denied; choose a location you may use or fix its permissions",
    errno.EPERM: "operation not permitted; choose a location you may use or fix its "
                 "permissions",
    errno.EROFS: "read-only file system; choose a writable location",
    errno.EISDIR: "is a directory, but a file is needed here; give a file name",
    errno.ENOTDIR: "a part of this path is a file, not a directory; choose another path",
    errno.EEXIST: "already exists; choose another path or remove it",
    errno.ENOENT: "no such file or directory; check the path",
    errno.ENAMETOOLONG: "file name too long; choose a shorter path",
}


def _clean(text: str) -> str:
    """One line; drops the long JSON spec tensorstore appends to its messages."""
    text = str(text)
    cut = text.find("[tensorstore_spec=")
    return one_line(text[:cut] if cut > 0 else text)


def _os_message(err: OSError) -> str:
    hint = _OS_HINTS.get(err.errno) or one_line(err.strerror or err, 200)
    name = err.filename if err.filename is not None else None
    return f"{quote_path(name)}: {hint}" if name is not None else hint


def classify(err: BaseException) -> tuple[int, str] | None:
    """`(exit status, one-line message)` for an error caused by the input or the environment;
    None for an unexpected one (a bug: the caller writes a crash log)."""
    text = str(err)
    status = getattr(err, "exit_status", None)
    if isinstance(status, int):
        return status, _clean(text or type(err).__name__)
    if isinstance(err, OSError):
        return 2, _os_message(err)
    if "No space left on device" in text:
        return 2, f"{_clean(text)}; free some space or write somewhere else"
    if "RESOURCE_EXHAUSTED" in text or isinstance(err, MemoryError):
        return 2, (f"out of memory ({_clean(text or type(err).__name__)[:200]}); use a smaller "
                   "model, batch_size or ctx_len")
    if "Event loop is closed" in text:       # orbax's error path after a failed read/write
        return 2, ("an orbax checkpoint could not be read or written (its directory may be "
                   "damaged or incomplete); remove the damaged step directory or use another "
                   "run_dir / checkpoint")
    if isinstance(err, RecursionError):
        return 2, "input nested too deeply for Python's recursion limit; flatten it"
    if isinstance(err, ImportError):
        return 2, _clean(text)
    if isinstance(err, (ValueError, TypeError)) or type(err).__module__.startswith("yaml"):
        return 2, _clean(text or type(err).__name__)
    return None


def write_crash_log(command: str, argv: list[str] | None, err: BaseException) -> str | None:
    """Write the full traceback of `err` to a new file under the system temp dir (or the
    working directory when that fails); returns its path, or None when nothing could be
    written."""
    import tempfile
    import time
    import traceback
    stamp = time.strftime("%Y%m%d-%H%M%S")
    head = (f"lwm-jax {command} crashed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            f"argv: {sys.argv[:1] + list(argv if argv is not None else sys.argv[1:])}\n"
            f"python {sys.version.split()[0]}\n\n")
    body = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    for folder in (tempfile.gettempdir(), os.getcwd()):
        try:
            fd, path = tempfile.mkstemp(prefix=f"lwm-jax-crash-{stamp}-", suffix=".log",
                                        dir=folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(head + body)
            return path
        except OSError:
            continue
    return None


def _debug() -> bool:
    return any(os.environ.get(v, "") not in ("", "0") for v in DEBUG_VARS)


class Terminated(BaseException):
    """SIGTERM outside `train`'s own handler (while JAX imports, a config loads, a file
    converts): exit 143 with one line, not a silent death by the signal. Raised from the
    handler, so `with` blocks and `finally` clauses (temporary files) still run."""


def _terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run `lwm-jax` with `argv` (default: `sys.argv[1:]`); returns the exit status (see the
    module docstring). Usage errors raise SystemExit(2) from argparse."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "stop_after", None) is not None and args.stop_after < 1:
        parser.error(f"--stop-after: must be >= 1, got {args.stop_after}")
    ignore_closed_event_loop_noise()
    name = f"lwm-jax {args.command}"
    previous = signal.signal(signal.SIGTERM, _terminated)   # until `train` installs its own
    try:
        from lwm_jax.hardware import skip_absent_tpu
        skip_absent_tpu()           # libtpu on a CPU host: no failed TPU start-up on stderr
        return args.func(args)
    except KeyboardInterrupt:
        if _debug():
            raise
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{name}: stopped by SIGTERM", file=sys.stderr)
        return 143
    except Exception as err:        # noqa: BLE001 -- every error becomes one line
        if _debug():
            raise
        known = classify(err)
        if known is not None:
            status, message = known
            print(f"{name}: error: {message}  (LWM_DEBUG=1 shows the traceback)",
                  file=sys.stderr)
            return status
        log = write_crash_log(args.command, argv, err)
        where = (f"full traceback in {log}" if log else "no crash log could be written")
        print(f"{name}: internal error: {type(err).__name__}: {_clean(err)[:300]} ({where}; "
              "LWM_DEBUG=1 prints it; please report this)", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
